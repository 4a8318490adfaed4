"""The GPU check scripts' own logic, on the CPU (the PyTorch reference backend): a script that
only ever runs on a lent GPU must not be found broken there."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("regime", ["model", "fla_test"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_prefill_accuracy_script_calls_each_implementation_as_its_peer_takes_it(monkeypatch, regime, lower_bound):
    """gpu_prefill_accuracy.py: its float64 recurrence against kdakit.reference, and kdakit's
    native calls and both drop-ins (sglang's A_log [1, 1, HV, 1] and pool in place, fla's K-major
    states) against that recurrence, at a tiny size on the reference backend."""
    monkeypatch.setenv("KDAKIT_BACKEND", "reference")
    import gpu_prefill_accuracy as script
    from kdakit import reference
    # (the peers' kernels need a GPU; importing sglang would also rebind triton's helpers for the
    # other tests of this process)
    monkeypatch.setattr(script, "sglang_peer", lambda: None)
    monkeypatch.setattr(script, "fla_peer", lambda: None)
    monkeypatch.setattr(script, "K", 16)
    monkeypatch.setattr(script, "V", 16)
    L = script.make_inputs([40, 7], 2, regime, seed=1, device="cpu")
    scale = 16 ** -0.5
    ref_out, ref_final = script.ref64(L, lower_bound, scale)
    pool = L["state"].double()
    out = torch.zeros(ref_out.shape, dtype=torch.float64)
    reference.recurrent_forward(*(L[n].double() for n in ("q", "k", "v", "g", "beta")), pool, L["idx"], out,
                                cu_seqlens=L["cu"], A_log=L["A_log"].double(), dt_bias=L["dt_bias"].double(),
                                lower_bound=lower_bound, beta_is_logit=True, compute_dtype=torch.float64)
    assert script.rel(out, ref_out) < 1e-12 and script.rel(pool[L["idx"].long()], ref_final) < 1e-12
    impls = script.implementations(L, lower_bound, scale, L["state"])
    for name in ("kdakit.chunk_prefill", "kdakit.recurrent_forward", "kdakit.compat.sglang.chunk_kda",
                 "kdakit.compat.fla.chunk_kda"):
        before = L["state"].clone()
        got_out, got_final = impls[name](L["state"].clone())
        assert torch.equal(L["state"], before), name
        assert script.rel(got_out, ref_out) < 1e-2, name      # bf16 outputs
        assert script.rel(got_final, ref_final) < 1e-5, name  # float32 states


def test_multi_device_script_on_two_cpu_devices(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_multi_device_check.py"),
                           "--devices", "cpu,cpu", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "KDAKIT_BACKEND": "reference",
                                                       "TRITON_INTERPRET": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "multi_device_check_cpu.json").exists()
