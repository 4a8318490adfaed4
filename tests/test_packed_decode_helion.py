"""Packed decode, Helion backend: against the float64 reference with poisoned outputs and pools.

Runs on CPU tensors in Helion's eager reference mode (HELION_INTERPRET=1, set per
test), plus two cases that run the Triton code Helion generates through Triton's
interpreter, so the code a GPU would compile is checked too. Skipped without helion.
"""
import importlib
import sys

import pytest
import torch

pytest.importorskip("helion")

import kdakit  # noqa: E402
from kdakit import backends, reference  # noqa: E402
from kdakit.ops import packed_decode_helion as helion_mod  # noqa: E402
from kdakit.ops.packed_decode_helion import helion_fused_recurrent_kda_packed_decode  # noqa: E402
from kdakit.ops import launch  # noqa: E402

from helpers import POISON, assert_close, kda_params, pick_slots, random_pool, tol_for, untouched_slots  # noqa: E402
from test_packed_decode import run_case  # noqa: E402

POW2_ERROR = "Helion KDA decode requires power-of-two key and value head dimensions (got K={K}, V={V})."


@pytest.fixture(autouse=True)
def helion_interpret(monkeypatch):
    monkeypatch.setenv("HELION_INTERPRET", "1")


@pytest.mark.parametrize("H,HV,K,V", [
    pytest.param(2, 2, 16, 16, id="H2-HV2-K16-V16"),
    pytest.param(1, 4, 16, 32, id="gva-H1-HV4-K16-V32"),
    pytest.param(2, 4, 32, 16, id="gva-H2-HV4-K32-V16"),
])
def test_shapes(H, HV, K, V):
    run_case("helion", H, HV, K, V)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dtypes(state_dtype, act_dtype):
    run_case("helion", 1, 2, 16, 32, state_dtype=state_dtype, act_dtype=act_dtype, seed=1)


@pytest.mark.parametrize("lower_bound", [None, -5.0, -1.0], ids=["default-gate", "safe-gate-5", "safe-gate-1"])
@pytest.mark.parametrize("use_qk_l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_gates_and_norm(lower_bound, use_qk_l2norm):
    run_case("helion", 1, 2, 16, 32, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm, seed=2)


def test_interleaved_pool_and_all_padding():
    run_case("helion", 1, 2, 16, 32, slot_stride=3 * 2 * 32 * 16 + 8, seed=3)
    run_case("helion", 1, 2, 16, 32, batch=3, num_padding=3, seed=4)


def test_empty_batch():
    state = torch.randn(3, 2, 16, 16)
    before = state.clone()
    out = kdakit.packed_decode(torch.randn(0, 2 * 16 + 32), torch.randn(0, 32), torch.randn(0, 2), torch.zeros(2),
                               torch.zeros(32), state, torch.zeros(0, dtype=torch.int32), backend="helion")
    assert out.shape == (0, 1, 2, 16) and torch.equal(state, before)


def test_env_routes_to_helion(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "helion")
    assert backends.select("packed_decode", torch.device("cpu"))[0] == "helion"
    calls = []
    real = helion_mod._kernel
    monkeypatch.setattr(helion_mod, "_kernel", lambda *a: calls.append(a) or real(*a))
    run_case(None, 1, 2, 16, 32, seed=7)
    assert calls, "KDAKIT_BACKEND=helion must run the Helion kernel"


def test_cpu_needs_helion_interpret(monkeypatch):
    monkeypatch.delenv("HELION_INTERPRET")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter does not enable the Helion backend
    with pytest.raises(ValueError, match="HELION_INTERPRET=1"):
        backends.select("packed_decode", torch.device("cpu"), "helion")


def _inputs(B, H, HV, K, V, slots=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(B, 2 * H * K + HV * V, generator=gen)
    a, b = torch.randn(B, HV * K, generator=gen), torch.randn(B, HV, generator=gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    state = torch.randn(slots, HV, V, K, generator=gen)
    idx = pick_slots(slots, B, generator=gen)
    return mixed, a, b, A_log, dt_bias, state, idx


@pytest.mark.parametrize("K,V", [(24, 32), (16, 40)])
def test_power_of_two_error(K, V):
    mixed, a, b, A_log, dt_bias, state, idx = _inputs(2, 1, 2, K, V)
    out = torch.full((2, 1, 2, V), POISON)
    before = state.clone()
    message = POW2_ERROR.format(K=K, V=V)
    with pytest.raises(ValueError) as err:
        helion_fused_recurrent_kda_packed_decode(mixed, a, b, A_log, dt_bias, K ** -0.5, state, out, idx)
    assert str(err.value) == message
    with pytest.raises(ValueError) as err:
        kdakit.packed_decode(mixed, a, b, A_log, dt_bias, state, idx, out, backend="helion")
    assert str(err.value) == message
    assert torch.equal(state, before) and bool((out == POISON).all())
    # the rule is Helion's only: the other backends take the same call
    kdakit.packed_decode(mixed, a, b, A_log, dt_bias, state, idx, out, backend="reference")


def test_power_of_two_check_comes_before_shape_checks():
    """In the contract's order: after the state checks, before `a`'s shape."""
    mixed, a, b, A_log, dt_bias, state, idx = _inputs(2, 1, 2, 24, 32)
    with pytest.raises(ValueError) as err:
        helion_fused_recurrent_kda_packed_decode(mixed, a[:, :-1], b, A_log, dt_bias, 0.2, state,
                                                 torch.empty(2, 1, 2, 32), idx)
    assert str(err.value) == POW2_ERROR.format(K=24, V=32)


@pytest.mark.parametrize("lower_bound", [None, -2.0], ids=["default-gate", "safe-gate"])
def test_sglang_compat_returns_callers_objects(lower_bound):
    B, H, HV, K, V = 3, 1, 2, 16, 32
    mixed, a, b, A_log, dt_bias, state, idx = _inputs(B, H, HV, K, V, slots=5, seed=6)
    idx[1] = -1
    ref_state, ref_out = state.double(), torch.empty(B, 1, HV, V, dtype=torch.float64)
    reference.packed_decode(mixed.double(), a.double(), b.double(), A_log.double(), dt_bias.double(), ref_state,
                            idx, ref_out, scale=0.3, use_qk_l2norm=False, lower_bound=lower_bound,
                            compute_dtype=torch.float64)
    out = torch.full((B, 1, HV, V), POISON)
    o, s = helion_fused_recurrent_kda_packed_decode(mixed, a, b, A_log, dt_bias, 0.3, state, out, idx,
                                                    lower_bound=lower_bound)
    assert o is out and s is state
    assert_close(out, ref_out, 1e-5)
    assert_close(state, ref_state, 1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_sglang_compat_shares_the_contract():
    mixed, a, b, A_log, dt_bias, state, idx = _inputs(2, 1, 2, 16, 16)
    with pytest.raises(ValueError) as err:
        helion_fused_recurrent_kda_packed_decode(mixed, a, b, A_log, dt_bias, 0.25, state,
                                                 torch.empty(2, 1, 2, 16), idx[:1])
    assert str(err.value) == "`ssm_state_indices` must have shape [B] (got (1,); expected (2,))."


def test_missing_helion_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "helion", None)
    monkeypatch.setitem(sys.modules, "helion.language", None)
    mixed, a, b, A_log, dt_bias, state, idx = _inputs(2, 1, 2, 16, 16)
    with pytest.raises(ValueError, match=r"pip install kdakit\[helion\]"):
        kdakit.packed_decode(mixed, a, b, A_log, dt_bias, state, idx, backend="helion")


def test_import_kdakit_works_without_helion(monkeypatch):
    """A fresh `import kdakit` with helion unimportable (the originals are restored after)."""
    for name in [m for m in sys.modules if m == "kdakit" or m.startswith("kdakit.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "helion", None)
    fresh = importlib.import_module("kdakit")
    importlib.import_module("kdakit.compat.sglang")
    assert fresh is not kdakit and "helion" in fresh.backends.available("packed_decode")


def test_int64_indexing_when_offsets_pass_2_31():
    HV, V, K = 32, 128, 128
    small = torch.empty(8, HV, V, K, device="meta")
    big = torch.empty(2 ** 31 // (HV * V * K) + 1, HV, V, K, device="meta")
    layers, slots = 8, 600  # 314M elements, but slot 599 of layer 0 starts past 2**31
    interleaved = torch.empty(layers * slots * HV * V * K, device="meta").as_strided(
        (slots, HV, V, K), (layers * HV * V * K, V * K, K, 1))
    assert not helion_mod._needs_int64(small)
    assert helion_mod._needs_int64(big)
    assert helion_mod._needs_int64(interleaved)


# ----------------------------------------------------------------------------
# The generated Triton code, run through Triton's interpreter
# ----------------------------------------------------------------------------
@pytest.mark.skipif(launch.triton_version() >= (3, 9), reason="helion 1.5.1's generated code indexes a 0-d "
                    "tensor, which Triton 3.9's interpreter rejects ('too many indices for tensor of rank 0')")
@pytest.mark.parametrize("state_dtype,lower_bound,use_qk_l2norm", [
    (torch.float32, None, True), (torch.bfloat16, -1.0, False)], ids=["fp32-default-gate", "bf16-safe-gate-no-l2"])
def test_generated_triton_code(monkeypatch, state_dtype, lower_bound, use_qk_l2norm):
    """Helion's Triton output (what a GPU compiles) on CPU: GVA, K != V, an interleaved pool,
    a padding row. Triton's interpreter has no libdevice, so its `exp` stands in for it."""
    import triton.language as tl
    import triton.language.extra.libdevice as libdevice
    monkeypatch.delenv("HELION_INTERPRET")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(libdevice, "exp", lambda x: tl.exp(x), raising=False)
    B, H, HV, K, V, slots = 4, 1, 2, 16, 32, 6
    stride = HV * V * K * 2 + 16
    gen = torch.Generator().manual_seed(11)
    mixed = torch.randn(B, 2 * H * K + HV * V, generator=gen)
    a, b = torch.randn(B, HV * K, generator=gen), torch.randn(B, HV, generator=gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    state = random_pool(slots, HV, V, K, state_dtype, slot_stride=stride, generator=gen)
    idx = pick_slots(slots, B, 1, generator=gen)
    flat = torch.as_strided(state, (slots * stride,), (1,))
    flat_before, before = flat.clone(), state.clone()
    ref_state, ref_out = state.double(), torch.empty(B, 1, HV, V, dtype=torch.float64)
    reference.packed_decode(mixed.double(), a.double(), b.double(), A_log.double(), dt_bias.double(), ref_state,
                            idx, ref_out, use_qk_l2norm=use_qk_l2norm, lower_bound=lower_bound,
                            compute_dtype=torch.float64)
    out = torch.full((B, 1, HV, V), POISON)
    helion_mod.packed_decode_helion(mixed, a, b, A_log, dt_bias, state, idx, out, scale=K ** -0.5,
                                    use_qk_l2norm=use_qk_l2norm, lower_bound=lower_bound,
                                    config=helion_mod.HelionPackedDecodeConfig(block_v=8, num_warps=1))
    tol = tol_for(state_dtype)
    live = [int(s) for s in idx if s >= 0]
    assert_close(out, ref_out, tol, "out")
    assert_close(state[live], ref_state[live], tol, "state")
    assert torch.equal(out[idx < 0], torch.zeros_like(out[idx < 0]))
    for s in untouched_slots(slots, idx):
        assert torch.equal(state[s], before[s])
    gap = torch.ones(slots * stride, dtype=torch.bool)
    for s in range(slots):
        gap[s * stride: s * stride + HV * V * K] = False
    assert torch.equal(flat[gap], flat_before[gap]), "bytes between slots must stay bitwise"
