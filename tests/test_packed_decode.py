"""Packed decode: every backend against the float64 reference, with poisoned pools."""
import pytest
import torch

import kdakit
from kdakit import reference
from kdakit.compat.sglang import fused_recurrent_kda_packed_decode

from helpers import POISON, assert_close, kda_params, pick_slots, random_pool, tol_for, untouched_slots, sweep

BACKENDS = ["reference", "triton"]

# (H, HV, K, V): GVA and K != V included; tiny so the interpreter stays fast.
SHAPES = [
    pytest.param(2, 2, 16, 16, id="H2-HV2-K16-V16"),
    pytest.param(1, 4, 16, 32, id="gva-H1-HV4-K16-V32"),
    pytest.param(2, 4, 32, 16, id="gva-H2-HV4-K32-V16"),
    pytest.param(1, 2, 24, 40, id="nonpow2-K24-V40"),
]


def run_case(backend, H, HV, K, V, *, batch=4, slots=7, num_padding=1, state_dtype=torch.float32,
             act_dtype=torch.float32, lower_bound=None, use_qk_l2norm=True, slot_stride=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(batch, 2 * H * K + HV * V, generator=gen).to(act_dtype)
    a = torch.randn(batch, HV * K, generator=gen).to(act_dtype)
    b = torch.randn(batch, HV, generator=gen).to(act_dtype)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    state = random_pool(slots, HV, V, K, state_dtype, slot_stride=slot_stride, generator=gen)
    idx = pick_slots(slots, batch, num_padding, generator=gen)
    before = state.clone()
    storage_len = slots * (slot_stride or HV * V * K)
    flat_before = torch.as_strided(state, (storage_len,), (1,)).clone()
    ref_state = state.double()
    ref_out = torch.empty(batch, 1, HV, V, dtype=torch.float64)
    reference.packed_decode(mixed.double(), a.double(), b.double(), A_log.double(), dt_bias.double(),
                            ref_state, idx, ref_out, use_qk_l2norm=use_qk_l2norm,
                            lower_bound=lower_bound, compute_dtype=torch.float64)
    out = torch.full((batch, 1, HV, V), POISON).to(act_dtype)
    result = kdakit.packed_decode(mixed, a, b, A_log, dt_bias, state, idx, out, use_qk_l2norm=use_qk_l2norm,
                                  lower_bound=lower_bound, backend=backend)
    assert result is out
    tol = tol_for(state_dtype, act_dtype)
    assert_close(out, ref_out, tol, "out")
    live = [int(s) for s in idx if s >= 0]
    assert_close(state[live], ref_state[live], tol, "state")
    pad_rows = (idx < 0).nonzero().flatten()
    assert torch.equal(out[pad_rows], torch.zeros_like(out[pad_rows])), "padding rows must be zero"
    for s in untouched_slots(slots, idx):
        assert torch.equal(state[s], before[s]), f"slot {s} is not used and must stay bitwise"
    if slot_stride is not None:  # the gaps between slots belong to other layers
        flat_after = torch.as_strided(state, (storage_len,), (1,))
        gap = torch.ones(slots * slot_stride, dtype=torch.bool)
        for s in range(slots):
            gap[s * slot_stride: s * slot_stride + HV * V * K] = False
        assert torch.equal(flat_after[gap], flat_before[gap]), "bytes between slots must stay bitwise"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,HV,K,V", sweep(SHAPES, keep=2))
def test_shapes(backend, H, HV, K, V):
    run_case(backend, H, HV, K, V)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", sweep([torch.float32, torch.bfloat16, torch.float16], keep=2), ids=str)
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dtypes(backend, state_dtype, act_dtype):
    run_case(backend, 1, 2, 16, 32, state_dtype=state_dtype, act_dtype=act_dtype, seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lower_bound", sweep([None, -5.0, -1.0], keep=2), ids=["default-gate", "safe-gate-5", "safe-gate-1"])
@pytest.mark.parametrize("use_qk_l2norm", sweep([True, False]), ids=["l2norm", "no-l2norm"])
def test_gates_and_norm(backend, lower_bound, use_qk_l2norm):
    run_case(backend, 2, 2, 16, 16, lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm, seed=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_interleaved_pool_and_all_padding(backend):
    run_case(backend, 1, 2, 16, 16, slot_stride=3 * 2 * 16 * 16 + 8, seed=3)
    run_case(backend, 1, 2, 16, 16, batch=3, num_padding=3, seed=4)


def test_fla_oracle_agrees_with_reference():
    """fla-core's naive recurrence (K-major state, no L2 norm, log gate) as an independent oracle."""
    naive = pytest.importorskip("fla.ops.kda.naive")
    gen = torch.Generator().manual_seed(5)
    B, H, HV, K, V = 3, 2, 4, 16, 24
    mixed = torch.randn(B, 2 * H * K + HV * V, generator=gen, dtype=torch.float64)
    a = torch.randn(B, HV * K, generator=gen, dtype=torch.float64)
    b = torch.randn(B, HV, generator=gen, dtype=torch.float64)
    A_log, dt_bias = (t.double() for t in kda_params(HV, K, generator=gen))
    state = torch.randn(5, HV, V, K, generator=gen, dtype=torch.float64)
    idx = torch.tensor([3, 0, 4], dtype=torch.int32)
    for lower_bound in (None, -3.0):
        st = state.clone()
        out = torch.empty(B, 1, HV, V, dtype=torch.float64)
        reference.packed_decode(mixed, a, b, A_log, dt_bias, st, idx, out, lower_bound=lower_bound,
                                compute_dtype=torch.float64)
        q, k, v = reference.split_packed_qkv(mixed, H, K, HV, V)
        q, k = reference.l2_normalize(q), reference.l2_normalize(k)
        g = reference.kda_gate(a.view(B, HV, K), A_log, dt_bias.view(HV, K), lower_bound)
        o_fla, S_fla = naive.naive_recurrent_kda(
            q[:, None], k[:, None], v[:, None], g[:, None], torch.sigmoid(b)[:, None],
            initial_state=state[idx.long()].transpose(-1, -2), output_final_state=True)
        # naive computes in float32 internally
        assert_close(out, o_fla, 1e-5, "out vs fla naive")
        assert_close(st[idx.long()], S_fla.transpose(-1, -2), 1e-5, "state vs fla naive")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_compat_returns_callers_objects(backend, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    gen = torch.Generator().manual_seed(6)
    B, H, HV, K, V = 2, 1, 2, 16, 16
    mixed = torch.randn(B, 2 * H * K + HV * V, generator=gen)
    a, b = torch.randn(B, HV * K, generator=gen), torch.randn(B, HV, generator=gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    state = torch.randn(4, HV, V, K, generator=gen)
    ref_state = state.double()
    ref_out = torch.empty(B, 1, HV, V, dtype=torch.float64)
    idx = torch.tensor([2, 0], dtype=torch.int64)
    reference.packed_decode(mixed.double(), a.double(), b.double(), A_log.double(), dt_bias.double(), ref_state,
                            idx, ref_out, scale=0.3, use_qk_l2norm=False, compute_dtype=torch.float64)
    out = torch.full((B, 1, HV, V), POISON)
    o, s = fused_recurrent_kda_packed_decode(mixed, a, b, A_log, dt_bias, 0.3, state, out, idx)
    assert o is out and s is state
    assert_close(out, ref_out, 1e-5)
    assert_close(state, ref_state, 1e-5)


@pytest.mark.parametrize("config", [dict(block_v=8, v_tiles=2, num_warps=1, num_stages=2),
                                    dict(block_v=4, v_tiles=4, num_warps=1, num_stages=1, evict="evict_first")],
                         ids=["bv8-tiles2", "bv4-tiles4"])
def test_triton_multi_tile_configs(config):
    """Configs the benchmark sweeps (several V tiles per program) compute the same thing."""
    from kdakit.ops import packed_decode as mod
    config = mod.PackedDecodeConfig(**config)
    gen = torch.Generator().manual_seed(8)
    B, H, HV, K, V = 3, 1, 2, 16, 40
    mixed = torch.randn(B, 2 * H * K + HV * V, generator=gen)
    a, b = torch.randn(B, HV * K, generator=gen), torch.randn(B, HV, generator=gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    state = torch.randn(5, HV, V, K, generator=gen)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    ref_state, ref_out = state.double(), torch.empty(B, 1, HV, V, dtype=torch.float64)
    reference.packed_decode(mixed.double(), a.double(), b.double(), A_log.double(), dt_bias.double(), ref_state,
                            idx, ref_out, compute_dtype=torch.float64)
    out = torch.full((B, 1, HV, V), POISON)
    mod.packed_decode_triton(mixed, a, b, A_log, dt_bias, state, idx, out, scale=K ** -0.5, use_qk_l2norm=True,
                             lower_bound=None, config=config)
    assert_close(out, ref_out, 1e-5)
    assert_close(state, ref_state, 1e-5)


def test_launch_specialization_key_tracks_alignment_and_ints():
    from kdakit.ops.launch import specialization_key
    t = torch.zeros(64)
    assert specialization_key((t, 1, 32, 0.5)) != specialization_key((t[1:], 1, 32, 0.5))  # 4-byte offset
    assert specialization_key((t, 1)) != specialization_key((t, 2))
    assert specialization_key((t, 16)) != specialization_key((t, 17))
    assert specialization_key((t, 2 ** 31)) != specialization_key((t, 2 ** 31 - 16))
    assert specialization_key((t.bfloat16(),)) != specialization_key((t,))
