"""Tensor parallelism over a real ``torch.distributed`` process group (gloo, CPU, two processes).

Each of two worker processes builds the same unsharded ``KDALayer`` from a fixed seed, cuts
its shard with ``KDALayer.shard(full, rank, 2)``, runs both on the same inputs (prefill,
decode, verify, commit, decode again; snapshot and ring pools) and checks that the shards'
``o_proj`` partial sums, all-reduced with ``dist.all_reduce``, equal the full layer's outputs,
and that after every commit each shard's slots hold the full layer's states of its value
heads and conv windows of its channels. The PyTorch reference backend runs (CPU tensors,
``KDAKIT_BACKEND=reference``, no Triton interpreter). A worker writes its relative errors to
a JSON file; this process asserts on them. The single-process version of the check is
``tests/test_layer.py::test_tensor_parallel_shards_sum_to_the_full_layer``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TP = 2
TOL = 1e-5
PG_TIMEOUT_S = 120    # every collective and the rendezvous
JOIN_TIMEOUT_S = 240  # the whole run of both workers (normally a few seconds)


# ---------------------------------------------------------------------------------- worker
def _shard_rows(full, rank):
    """Index tensors of this shard's value heads (state) and conv channels (q | k | v windows)."""
    H, HV, K, V = full.total_heads // TP, full.total_v_heads // TP, full.K, full.V
    HK, HVV = full.total_heads * K, full.total_v_heads * V
    heads = torch.arange(rank * HV, (rank + 1) * HV)
    hk = torch.arange(rank * H * K, (rank + 1) * H * K)
    channels = torch.cat([hk, HK + hk, 2 * HK + torch.arange(rank * HV * V, (rank + 1) * HV * V)])
    assert channels.numel() == 2 * H * K + HV * V and int(channels.max()) < 2 * HK + HVV
    return heads, channels


def _run_case(dist, rank, spec, lower_bound, errs):
    from helpers import rel_err
    from test_layer import HIDDEN, make_layer, make_pool

    from kdakit.layer import KDALayer
    from kdakit.state_pool import PAD

    num_spec, T = 3, 4
    full = make_layer(lower_bound, seed=11, num_heads=2, num_v_heads=4)  # grouped: HV = 2 H
    shard = KDALayer.shard(full, rank, TP)
    assert (shard.H, shard.HV, shard.tp_rank, shard.tp_size) == (1, 2, rank, TP)
    pools = {}
    for name, layer in (("full", full), ("shard", shard)):
        pools[name] = pool = make_pool(layer, 4, spec, num_spec, scratch_rows=3)
        layer.attach(pool, 0)
        pool.alloc()  # slot 0 stays unused: the requests sit in slots 1 and 2
    slots = [pools["full"].alloc(), pools["full"].alloc()]
    assert [pools["shard"].alloc(), pools["shard"].alloc()] == slots
    heads, channels = _shard_rows(full, rank)
    gen = torch.Generator().manual_seed(12)  # the same inputs on every rank
    tag = f"{spec}/lb={lower_bound}"

    def compare(what, fn):
        ref = fn(full)
        part = fn(shard)
        summed = part.clone()
        dist.all_reduce(summed)  # the engine's all-reduce of the row-parallel o_proj
        errs[f"{tag}/{what}"] = rel_err(summed, ref)
        errs.setdefault("_partial_alone", []).append(rel_err(part, ref))
        return ref

    def compare_caches(what):
        fp, sp = pools["full"], pools["shard"]
        errs[f"{tag}/{what}/state"] = rel_err(sp.state[0, slots], fp.state[0, slots][:, heads])
        errs[f"{tag}/{what}/conv"] = rel_err(sp.conv[0, slots], fp.conv[0, slots][:, channels])

    prompts = torch.randn(11, HIDDEN, generator=gen)
    compare("prefill", lambda l: l.prefill(prompts, slots, cu_seqlens=[0, 5, 11]))
    compare_caches("prefill")
    batch = torch.tensor(slots + [PAD], dtype=torch.int32)
    for t in range(2):
        x = torch.randn(3, HIDDEN, generator=gen)
        out = compare(f"decode{t}", lambda l: l.decode(x, batch))
        assert bool((out[2] == 0).all())
    compare_caches("decode")
    rows = torch.tensor([2, 0, 1], dtype=torch.int32)
    for r, lens in enumerate([(4, 1), (0, 2), (2, 4), (3, 0)]):
        x = torch.randn(3, T, HIDDEN, generator=gen)
        compare(f"verify{r}", lambda l: l.verify(x, batch, rows))
        accept = torch.tensor(list(lens) + [0], dtype=torch.int32)
        for layer in (full, shard):
            layer.commit(batch, rows, accept)
        compare_caches(f"commit{r}")
    x = torch.randn(3, HIDDEN, generator=gen)
    compare("decode_after_commit", lambda l: l.decode(x, batch))
    compare_caches("end")
    # Both ranks must have computed the very same full layer (same seed, same inputs).
    digest = torch.stack([pools["full"].state.double().sum(), pools["full"].conv.double().sum()])
    gathered = [torch.empty_like(digest) for _ in range(TP)]
    dist.all_gather(gathered, digest)
    errs[f"{tag}/ranks_agree"] = float(max((g - digest).abs().max() for g in gathered))


def worker(rank, init_file, out_file):
    import torch.distributed as dist

    import kdakit

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        errs = {"_kdakit": kdakit.__file__}
        with torch.no_grad():
            for spec, lower_bound in (("snapshot", None), ("ring", -2.0)):
                _run_case(dist, rank, spec, lower_bound, errs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_file).write_text(json.dumps(errs))


# ---------------------------------------------------------------------------------- test
def _gloo_available():
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


@pytest.mark.skipif(not _gloo_available(), reason="torch.distributed with the gloo backend is not available")
def test_two_process_shards_all_reduce_to_the_full_layer(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)       # conftest sets it for the kernel tests
    env["KDAKIT_BACKEND"] = "reference"     # CPU tensors: the PyTorch reference, whatever the caller set
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"    # localhost only, whatever the hostname resolves to
    init_file = tmp_path / "pg_init"        # FileStore rendezvous: no port to pick
    outs = [tmp_path / f"rank{r}.json" for r in range(TP)]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(init_file), str(outs[r])], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(TP)]
    logs = [""] * TP
    try:
        for r, p in enumerate(procs):
            logs[r] = p.communicate(timeout=JOIN_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] or "" for p in procs]
        pytest.fail(f"tensor-parallel workers did not finish in {JOIN_TIMEOUT_S} s:\n" + "\n".join(logs))
    failed = [f"rank {r} exited with {p.returncode}:\n{logs[r]}" for r, p in enumerate(procs) if p.returncode]
    assert not failed, "\n".join(failed)
    for r in range(TP):
        errs = json.loads(outs[r].read_text())
        assert Path(errs.pop("_kdakit")).resolve().is_relative_to(ROOT), "workers must import this tree's kdakit"
        # The check can fail: one shard's partial sum alone is far from the full output.
        assert min(errs.pop("_partial_alone")) > 1e-2
        assert len(errs) == 2 * 23, sorted(errs)
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"rank {r}: relative errors >= {TOL:g}: {bad}"


if __name__ == "__main__":  # a worker: python test_tensor_parallel.py RANK INIT_FILE OUT_FILE
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
