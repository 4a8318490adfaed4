"""kdakit.compat.sglang.chunk_kda (sglang 0.5.23's extend entry with its pool extension) on
the reference backend and the Triton kernels (interpreter), against kdakit's float64
recurrence and fla-core's naive recurrence: the pool as initial_state with
initial_state_indices (interleaved, poisoned, padding rows), beta_is_raw, the safe gate and
the log-decay input, output_intermediate_states (h: the state at the start of every 64-token
chunk), track_state / track_chunk_idx with and without h, equal-length batches, error texts."""
import inspect
import itertools

import pytest
import torch

from kdakit import reference
from kdakit.compat.sglang import chunk_kda

from fla_oracle import fla_log_gate, fla_varlen
from helpers import POISON, assert_close, kda_params, sweep

F64 = torch.float64
NAN = float("nan")


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def cu_from(seqlens):
    return torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32)


def make_inputs(H, HV, K, V, T, *, seed, raw_gate=True):
    gen = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(1, T, H, K, generator=gen), "k": torch.randn(1, T, H, K, generator=gen),
         "v": torch.randn(1, T, HV, V, generator=gen), "beta": torch.randn(1, T, HV, generator=gen)}
    if raw_gate:
        x["g"] = torch.randn(1, T, HV, K, generator=gen)
        A_log, dt_bias = kda_params(HV, K, generator=gen)
    else:
        x["g"] = -torch.rand(1, T, HV, K, generator=gen) * 2.0
        A_log = dt_bias = None
    return x, A_log, dt_bias, gen


def poisoned_pool(slots, HV, V, K, used, gen, gap=7):
    """An interleaved pool (slot stride past HV*V*K): used slots random, every other byte NaN."""
    inner = HV * V * K
    flat = torch.full((slots * (inner + gap),), NAN)
    pool = flat.as_strided((slots, HV, V, K), (inner + gap, V * K, K, 1))
    for s in used:
        pool[s] = torch.randn(HV, V, K, generator=gen) * 0.5
    return pool


def bits(pool):
    """The pool's whole storage as int32 words (NaN-safe bitwise comparisons)."""
    return torch.as_strided(pool, (pool.shape[0] * pool.stride(0),), (1,)).view(torch.int32).clone()


def slot_mask(pool, written):
    keep = torch.ones(pool.shape[0] * pool.stride(0), dtype=torch.bool)
    for s in written:
        keep[s * pool.stride(0): s * pool.stride(0) + pool[0].numel()] = False
    return keep


def ref64(x, A_log, dt_bias, cu, pool, idx, *, lower_bound, beta_is_logit, use_qk_l2norm=True):
    """kdakit's float64 recurrence: (out, pool after, starts) with ``starts[n][c]`` the state of
    sequence n at the start of its chunk c (chunk 0: the initial state; zeros for padding)."""
    T, HV, V = x["v"].shape[1:]
    K = x["q"].shape[-1]
    N = cu.numel() - 1
    M = max(T // 64, 1)
    p64 = pool.double()
    cs = torch.zeros(N * M, HV, V, K, dtype=F64)
    csi = torch.arange(N * M, dtype=torch.int32).view(N, M)
    out = torch.full((1, T, HV, V), POISON, dtype=F64)
    init = [p64[int(s)].clone() if int(s) >= 0 else torch.zeros(HV, V, K, dtype=F64) for s in idx]
    reference.chunk_prefill(*(x[n].double() for n in ("q", "k", "v", "g", "beta")), p64, idx, out, cu_seqlens=cu,
                            A_log=None if A_log is None else A_log.double().reshape(-1),
                            dt_bias=None if dt_bias is None else dt_bias.double().reshape(-1),
                            lower_bound=lower_bound, beta_is_logit=beta_is_logit, use_qk_l2norm=use_qk_l2norm,
                            chunk_states=cs, chunk_state_indices=csi, compute_dtype=F64)
    bounds = cu.tolist()
    starts = []
    for n in range(N):
        chunks = -(-(bounds[n + 1] - bounds[n]) // 64)
        pad = int(idx[n]) < 0
        starts.append([init[n]] + [torch.zeros_like(init[n]) if pad else cs[n * M + c - 1] for c in range(1, chunks)])
    return out, p64, starts


# ----------------------------------------------------------------------------
# Varlen: pool, padding row, h and track_state, against float64 and fla naive
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", sweep(["h+track", "track"]))
def test_varlen_pool_prefix_states(backend, mode):
    H, HV, K, V = 1, 2, 16, 32
    seqlens = [65, 3, 2]  # two chunks; one; a padding row of two tokens
    T = sum(seqlens)
    x, A_log, dt_bias, gen = make_inputs(H, HV, K, V, T, seed=3)
    cu = cu_from(seqlens)
    idx = torch.tensor([4, 1, -1], dtype=torch.int32)  # slot 0 is NaN: a padding row must not read it
    pool = poisoned_pool(6, HV, V, K, used=[4, 1], gen=gen)
    before = bits(pool)
    init = {4: pool[4].clone(), 1: pool[1].clone()}
    lb = -5.0
    track = torch.full((3, HV, V, K), NAN)
    tci = torch.tensor([1, 0, 0], dtype=torch.int32)
    res = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, initial_state_indices=idx,
                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu, A_log=A_log.view(1, 1, HV, 1),
                    dt_bias=dt_bias.view(HV, K), lower_bound=lb, output_intermediate_states=mode == "h+track",
                    track_state=track, track_chunk_idx=tci, beta_is_raw=True)
    o, h = res if mode == "h+track" else (res, None)
    assert isinstance(o, torch.Tensor) and o.shape == x["v"].shape and o.dtype == x["v"].dtype

    ref_out, ref_pool, starts = ref64(x, A_log, dt_bias, cu, _pool_before(pool, before), idx, lower_bound=lb,
                                      beta_is_logit=True)
    assert_close(o[:, :68], ref_out[:, :68], 1e-5, "o vs float64")
    assert (o[:, 68:] == 0).all(), "a padding row gives zeros"
    for s in (4, 1):
        assert_close(pool[s], ref_pool[s], 1e-5, f"final state, slot {s}")
    keep = slot_mask(pool, [4, 1])
    assert torch.equal(bits(pool)[keep], before[keep]), "untouched pool bytes changed"

    # fla-core's naive recurrence (K-major) for the outputs and the state after 64 tokens
    g_log = fla_log_gate(x["g"], A_log, dt_bias, lb)
    fla_out, fla_tok, _ = fla_varlen(x["q"], x["k"], x["v"], g_log, torch.sigmoid(x["beta"]), cu,
                                     [init[4].transpose(-1, -2), init[1].transpose(-1, -2), None],
                                     use_qk_l2norm=True)
    assert_close(o[:, :68], fla_out[:, :68], 1e-5, "o vs fla naive")
    after64 = fla_tok[63].transpose(-1, -2)

    assert_close(track[0], starts[0][1], 1e-5, "track: seq 0 chunk 1 vs float64")
    assert_close(track[0], after64, 1e-5, "track: seq 0 chunk 1 vs fla naive")
    assert torch.equal(track[1], init[1]), "track: chunk 0 is the initial state, exactly"
    assert torch.equal(track[2], torch.zeros(HV, V, K)), "track: a padding row's chunk 0 is a zero state"
    if mode == "h+track":
        assert h.shape == (1, 4, HV, V, K) and h.dtype == x["k"].dtype
        assert torch.equal(h[0, 0], init[4]) and torch.equal(h[0, 2], init[1])
        assert_close(h[0, 1], starts[0][1], 1e-5, "h: seq 0 chunk 1 vs float64")
        assert_close(h[0, 1], after64, 1e-5, "h: seq 0 chunk 1 vs fla naive")
        assert torch.equal(h[0, 3], torch.zeros(HV, V, K)), "h: padding row"


def _pool_before(pool, before):
    """The pool as it was before the call, rebuilt from its saved bits."""
    flat = before.view(torch.float32)
    return flat.as_strided(pool.shape, pool.stride())


# ----------------------------------------------------------------------------
# Boundaries: a sequence of exactly 64 tokens, chunks that do not exist, rows left alone
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("with_h", sweep([False, True]), ids=["track", "h+track"])
def test_track_rows_without_a_chunk_are_left_alone(backend, with_h):
    H, HV, K, V = 2, 2, 16, 16
    seqlens = [64, 6]
    T = sum(seqlens)
    x, A_log, dt_bias, gen = make_inputs(H, HV, K, V, T, seed=5)
    cu = cu_from(seqlens)
    idx = torch.tensor([0, 3], dtype=torch.int32)
    pool = poisoned_pool(4, HV, V, K, used=[0, 3], gen=gen)
    before = bits(pool)
    init0 = pool[0].clone()
    for tci_list, expect in (([1, 5], [None, None]), ([0, -1], ["init", None])):
        p = _restrided(_pool_before(pool, before), pool)
        track = torch.full((2, HV, V, K), NAN)
        track_bits = track.view(torch.int32).clone()
        tci = torch.tensor(tci_list, dtype=torch.int64)
        res = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=p, initial_state_indices=idx,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long(), A_log=A_log, dt_bias=dt_bias,
                        output_intermediate_states=with_h, track_state=track, track_chunk_idx=tci,
                        beta_is_raw=True)
        for n, e in enumerate(expect):
            if e is None:
                assert torch.equal(track[n].view(torch.int32), track_bits[n]), f"track row {n} must be untouched"
            else:
                assert torch.equal(track[n], init0), f"track row {n}: the initial state"
        ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, _pool_before(pool, before), idx, lower_bound=None,
                                     beta_is_logit=True)
        o = res[0] if with_h else res
        assert_close(o, ref_out, 1e-5, "o")
        for s in (0, 3):
            assert_close(p[s], ref_pool[s], 1e-5, f"slot {s}")
        if with_h:
            h = res[1]
            assert h.shape == (1, 2, HV, V, K), "a 64-token sequence has one chunk: its final state is not in h"
            assert torch.equal(h[0, 0], init0) and torch.equal(h[0, 1], pool[3])


def _restrided(p, like):
    flat = torch.empty(like.shape[0] * like.stride(0))
    out = flat.as_strided(like.shape, like.stride())
    out.copy_(p)
    return out


# ----------------------------------------------------------------------------
# An equal-length batch (cu_seqlens None), the log-decay input, sglang's defaults
# ----------------------------------------------------------------------------
def test_equal_length_batch_log_decay_defaults(backend):
    H, HV, K, V = 1, 2, 16, 16
    B, L = 2, 33
    x, _, _, gen = make_inputs(H, HV, K, V, B * L, seed=7, raw_gate=False)
    beta = torch.sigmoid(x["beta"])  # beta_is_raw defaults to False: beta as given
    xb = {n: t.reshape(B, L, *t.shape[2:]) for n, t in x.items()}
    pool = poisoned_pool(3, HV, V, K, used=[2, 0], gen=gen)
    before = bits(pool)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    init = [pool[2].clone(), pool[0].clone()]
    # with no A_log, g is the log-decay and sglang ignores dt_bias / lower_bound
    o, h = chunk_kda(xb["q"], xb["k"], xb["v"], xb["g"], beta.reshape(B, L, HV), initial_state=pool,
                     initial_state_indices=idx, use_qk_l2norm_in_kernel=True, dt_bias=torch.randn(HV * K),
                     lower_bound=-1.0, output_intermediate_states=True, some_engine_kwarg=1)
    assert o.shape == (B, L, HV, V) and h.shape == (B, 1, HV, V, K)
    assert torch.equal(h[0, 0], init[0]) and torch.equal(h[1, 0], init[1])
    x["beta"] = beta
    ref_out, ref_pool, _ = ref64(x, None, None, cu_from([L, L]), _pool_before(pool, before), idx, lower_bound=None,
                                 beta_is_logit=False)
    assert_close(o.reshape(1, B * L, HV, V), ref_out, 1e-5, "o")
    for s in (2, 0):
        assert_close(pool[s], ref_pool[s], 1e-5, f"slot {s}")
    keep = slot_mask(pool, [2, 0])
    assert torch.equal(bits(pool)[keep], before[keep])
    # use_qk_l2norm_in_kernel defaults to False, as in sglang: small keys keep the unnormalised run tame
    small = {n: (t * 0.1 if n in ("q", "k") else t) for n, t in xb.items()}
    pool2 = _restrided(_pool_before(pool, before), pool)
    o2 = chunk_kda(small["q"], small["k"], small["v"], small["g"], beta.reshape(B, L, HV), initial_state=pool2,
                   initial_state_indices=idx)
    flat = {n: t.reshape(1, B * L, *t.shape[2:]) for n, t in small.items()}
    flat["beta"] = beta
    ref2, _, _ = ref64(flat, None, None, cu_from([L, L]), _pool_before(pool, before), idx, lower_bound=None,
                       beta_is_logit=False, use_qk_l2norm=False)
    assert_close(o2.reshape(1, B * L, HV, V), ref2, 1e-5, "o without l2 norm")


def test_bf16_inputs_give_h_in_k_dtype(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "reference")
    H, HV, K, V = 1, 1, 16, 16
    x, A_log, dt_bias, gen = make_inputs(H, HV, K, V, 70, seed=9)
    x = {n: t.bfloat16() if n in ("q", "k", "v") else t for n, t in x.items()}
    pool = torch.randn(2, HV, V, K, generator=gen) * 0.5
    o, h = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                     initial_state_indices=torch.tensor([1]), use_qk_l2norm_in_kernel=True,
                     cu_seqlens=torch.tensor([0, 70]), A_log=A_log, dt_bias=dt_bias, beta_is_raw=True,
                     output_intermediate_states=True)
    assert o.dtype == torch.bfloat16 and h.dtype == torch.bfloat16 and h.shape == (1, 2, HV, V, K)


# ----------------------------------------------------------------------------
# The signature and the error texts
# ----------------------------------------------------------------------------
def test_signature_is_sglangs():
    params = inspect.signature(chunk_kda).parameters
    expected = [("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
                ("g", inspect.Parameter.empty), ("beta", inspect.Parameter.empty), ("scale", None),
                ("initial_state", None), ("initial_state_indices", None), ("use_qk_l2norm_in_kernel", False),
                ("cu_seqlens", None), ("A_log", None), ("dt_bias", None), ("lower_bound", None),
                ("output_intermediate_states", False), ("track_state", None), ("track_chunk_idx", None),
                ("beta_is_raw", False), ("chunk_indices", None), ("chunk_offsets", None)]
    got = [(n, p.default) for n, p in params.items() if p.kind != inspect.Parameter.VAR_KEYWORD]
    assert got == expected
    assert list(params.values())[-1].kind == inspect.Parameter.VAR_KEYWORD


def _small():
    x, A_log, dt_bias, gen = make_inputs(1, 1, 16, 16, 5, seed=11)
    pool = torch.randn(2, 1, 16, 16, generator=gen)
    return x, A_log, dt_bias, pool


@pytest.mark.parametrize("case,match", [
    ("no_pool", "chunk_kda requires initial_state and initial_state_indices"),
    ("no_indices", "chunk_kda requires initial_state and initial_state_indices"),
    ("track_alone", "track_state and track_chunk_idx must be passed together"),
    ("idx_alone", "track_state and track_chunk_idx must be passed together"),
    ("track_bf16", "track_state must be fp32, got torch.bfloat16"),
    ("track_shape", r"`track_state` must have shape \[N=1"),
    ("wide_head", "current kernel does not support head dimension larger than 256."),
])
def test_errors_leave_buffers_untouched(monkeypatch, case, match):
    monkeypatch.setenv("KDAKIT_BACKEND", "reference")
    x, A_log, dt_bias, pool = _small()
    kw = dict(initial_state=pool, initial_state_indices=torch.tensor([0]), cu_seqlens=torch.tensor([0, 5]),
              A_log=A_log, dt_bias=dt_bias)
    track = torch.full((1, 1, 16, 16), 3.0)
    if case == "no_pool":
        kw["initial_state"] = None
    elif case == "no_indices":
        kw["initial_state_indices"] = None
    elif case == "track_alone":
        kw["track_state"] = track
    elif case == "idx_alone":
        kw["track_chunk_idx"] = torch.tensor([0])
    elif case == "track_bf16":
        kw.update(track_state=track.bfloat16(), track_chunk_idx=torch.tensor([0]))
    elif case == "track_shape":
        kw.update(track_state=torch.zeros(2, 1, 16, 16), track_chunk_idx=torch.tensor([0]))
    elif case == "wide_head":
        x["q"] = x["k"] = torch.randn(1, 5, 1, 272)
    pool_before, track_before = pool.clone(), track.clone()
    with pytest.raises(ValueError, match=match):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert torch.equal(pool, pool_before) and torch.equal(track, track_before)
