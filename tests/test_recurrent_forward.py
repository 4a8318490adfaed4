"""Varlen recurrent forward: both backends against the float64 reference and fla-core's
naive recurrence, on varlen batches with padding slots, 2-D per-token slots, poisoned
outputs and pools; the contract's error texts, with buffers left untouched."""
import itertools

import pytest
import torch

import kdakit  # noqa: F401
from kdakit import backends, reference
from kdakit.ops.recurrent_forward import RecurrentForwardConfig, recurrent_forward, recurrent_forward_triton

from fla_oracle import fla_log_gate, fla_varlen
from helpers import POISON, assert_close, kda_params, random_pool, tol_for, sweep

BACKENDS = ["reference", "triton"]
F64 = torch.float64

# (H, HV, K, V): GVA, K != V and non-powers of two; tiny so the interpreter stays fast.
SHAPES = [
    pytest.param(2, 4, 16, 16, id="gva-H2-HV4-K16-V16"),
    pytest.param(1, 2, 16, 24, id="gva-H1-HV2-K16-V24"),
    pytest.param(1, 2, 24, 16, id="gva-nonpow2-K24-V16"),
]


def cu_from(seqlens):
    return torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32)


def make_inputs(H, HV, K, V, seqlens, *, gen, act_dtype=torch.float32, raw_gate=True, beta_is_logit=True,
                use_qk_l2norm=True, extra_tokens=0):
    T = sum(seqlens) + extra_tokens
    qk_scale = 1.0 if use_qk_l2norm else K ** -0.5  # without L2 norm keep |k| ~ 1 (contractive delta rule)
    x = {
        "q": (torch.randn(1, T, H, K, generator=gen) * qk_scale).to(act_dtype),
        "k": (torch.randn(1, T, H, K, generator=gen) * qk_scale).to(act_dtype),
        "v": torch.randn(1, T, HV, V, generator=gen).to(act_dtype),
        "g": (torch.randn(1, T, HV, K, generator=gen) if raw_gate
              else -torch.rand(1, T, HV, K, generator=gen)).to(act_dtype),
        "beta": (torch.randn(1, T, HV, generator=gen) if beta_is_logit
                 else torch.rand(1, T, HV, generator=gen)).to(act_dtype),
    }
    return x, T


def run_reference64(x, state, slot_indices, T, **kw):
    """The float64 oracle on copies; returns (out, pool after, token states)."""
    HV, V, K = state.shape[1:]
    pool = state.double()
    out = torch.full((1, T, HV, V), POISON, dtype=F64)
    token_states = torch.full((T, HV, V, K), POISON, dtype=F64)
    params = {n: (p.double() if isinstance(p, torch.Tensor) and p.is_floating_point() else p) for n, p in kw.items()}
    reference.recurrent_forward(*(x[n].double() for n in ("q", "k", "v", "g", "beta")), pool, slot_indices, out,
                                token_states=token_states, compute_dtype=F64, **params)
    return out, pool, token_states


def flat_storage(state, stride):
    return torch.as_strided(state, (state.shape[0] * stride,), (1,))


def run_case(backend, H, HV, K, V, *, seqlens=(3, 1, 0, 2), slots=7, slot_list=None, per_token=None,
             num_accepted=None, raw_gate=True, lower_bound=None, beta_is_logit=True, use_qk_l2norm=True,
             state_dtype=torch.float32, act_dtype=torch.float32, with_token_states=True, write_final_state=True,
             slot_stride=None, extra_tokens=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, T = make_inputs(H, HV, K, V, list(seqlens), gen=gen, act_dtype=act_dtype, raw_gate=raw_gate,
                       beta_is_logit=beta_is_logit, use_qk_l2norm=use_qk_l2norm, extra_tokens=extra_tokens)
    A_log, dt_bias = kda_params(HV, K, generator=gen) if raw_gate else (None, None)
    cu = cu_from(seqlens)
    state = random_pool(slots, HV, V, K, state_dtype, slot_stride=slot_stride, generator=gen)
    stride = slot_stride or HV * V * K
    flat_before = flat_storage(state, stride).clone()
    idx = per_token if per_token is not None else torch.tensor(slot_list, dtype=torch.int32)
    kw = dict(cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, beta_is_logit=beta_is_logit,
              use_qk_l2norm=use_qk_l2norm, num_accepted_tokens=num_accepted, write_final_state=write_final_state)
    ref_out, ref_pool, ref_ts = run_reference64(x, state, idx, T, **kw)

    out = torch.full((1, T, HV, V), POISON).to(act_dtype)
    token_states = torch.full((T, HV, V, K), POISON).to(state_dtype) if with_token_states else None
    result = recurrent_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, out=out,
                               token_states=token_states, backend=backend, **kw)
    assert result is out
    tol = tol_for(state_dtype, act_dtype)
    covered = int(cu[-1])
    assert_close(out[:, :covered], ref_out[:, :covered], tol, "out")
    if extra_tokens:  # tokens after cu_seqlens[-1] belong to no sequence: not written
        assert (out[:, covered:] == POISON).all(), "rows outside cu_seqlens must not be written"
    if with_token_states:
        assert_close(token_states[:covered], ref_ts[:covered], tol, "token_states")
    # The pool: written slots match the reference, every other byte bitwise.
    written = set()
    if write_final_state:
        written = {int(s) for s in idx.flatten() if int(s) >= 0} if per_token is None else {
            int(idx[n, i]) for n, L in enumerate(seqlens) for i in range(L) if int(idx[n, i]) >= 0}
    for s in sorted(written):
        assert_close(state[s], ref_pool[s], tol, f"slot {s}")
    flat_after = flat_storage(state, stride)
    keep = torch.ones_like(flat_before, dtype=torch.bool)
    for s in written:
        keep[s * stride: s * stride + HV * V * K] = False
    assert torch.equal(flat_after[keep], flat_before[keep]), "unwritten slots and gaps must stay bitwise"
    return x, state, idx


# ----------------------------------------------------------------------------
# Against the float64 reference
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,HV,K,V", sweep(SHAPES, keep=2))
def test_shapes_varlen_with_padding_slot(backend, H, HV, K, V):
    # sequence 1 is a padding row (slot -1): zero outputs, no pool access; sequence 2 is empty.
    run_case(backend, H, HV, K, V, slot_list=[4, -1, 2, 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("raw_gate,lower_bound", [(False, None), (True, None), (True, -5.0)],
                         ids=["log-decay", "default-gate", "safe-gate"])
@pytest.mark.parametrize("beta_is_logit", sweep([True, False]), ids=["beta-logit", "beta-prob"])
@pytest.mark.parametrize("use_qk_l2norm", sweep([True, False]), ids=["l2norm", "no-l2norm"])
def test_gates_beta_and_norm(backend, raw_gate, lower_bound, beta_is_logit, use_qk_l2norm):
    run_case(backend, 1, 2, 16, 24, seqlens=(2, 3), slot_list=[5, 1], raw_gate=raw_gate, lower_bound=lower_bound,
             beta_is_logit=beta_is_logit, use_qk_l2norm=use_qk_l2norm, with_token_states=False, seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype,act_dtype", sweep([(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                   (torch.float32, torch.bfloat16)]), ids=str)
def test_dtypes(backend, state_dtype, act_dtype):
    run_case(backend, 1, 2, 16, 16, seqlens=(2, 2), slot_list=[3, 6], state_dtype=state_dtype,
             act_dtype=act_dtype, seed=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_interleaved_pool_no_write_back_and_uncovered_tokens(backend):
    run_case(backend, 1, 2, 16, 16, seqlens=(2, 1), slot_list=[0, 3], slot_stride=2 * 16 * 16 + 40,
             extra_tokens=2, seed=3)
    run_case(backend, 1, 2, 16, 16, seqlens=(2, 1), slot_list=[0, 3], write_final_state=False, seed=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_sequence_without_cu_seqlens(backend):
    gen = torch.Generator().manual_seed(5)
    H, HV, K, V, T = 1, 2, 16, 16, 3
    x, _ = make_inputs(H, HV, K, V, [T], gen=gen, raw_gate=False, beta_is_logit=False)
    state = random_pool(3, HV, V, K, torch.float32, generator=gen)
    idx = torch.tensor([1], dtype=torch.int64)
    ref_out, ref_pool, _ = run_reference64(x, state, idx, T, scale=0.2)
    out = recurrent_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, scale=0.2, backend=backend)
    assert out.dtype == x["v"].dtype and out.shape == x["v"].shape
    assert_close(out, ref_out, 1e-5)
    assert_close(state, ref_pool, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_accepted", [True, False], ids=["num-accepted", "column-0"])
def test_per_token_slots(backend, with_accepted):
    """fla's speculative path: start from [n, num_accepted-1], state after token i to [n, i]."""
    per_token = torch.tensor([[2, 7, 5, -1],    # 3 tokens, starts from column 1 (slot 7)
                              [-1, 3, -1, -1],  # 2 tokens, starts from column 0 (-1: zeros); token 0 not stored
                              [9, 0, 4, 1]],    # 4 tokens, starts from column 3 (slot 1), overwrites it
                             dtype=torch.int32)
    num_accepted = torch.tensor([2, 1, 4], dtype=torch.int32) if with_accepted else None
    run_case(backend, 1, 2, 16, 24, seqlens=(3, 2, 4), slots=11, per_token=per_token, num_accepted=num_accepted,
             seed=6)


@pytest.mark.parametrize("seqlens", [(1, 1, 1, 1), (2, 0, 1, 1), (0, 2, 0, 2)],
                         ids=["one-each", "two-zero-one-one", "zero-two-zero-two"])
def test_as_many_tokens_as_sequences(seqlens):
    """Decode through a varlen call (as many tokens as sequences), with and without one token
    in each sequence."""
    run_case("triton", 1, 2, 16, 24, seqlens=seqlens, slots=7, slot_list=[4, 0, -1, 6], seed=12)


def test_as_many_tokens_as_sequences_per_token_slots():
    per_token = torch.tensor([[2, -1], [3, 5], [-1, -1]], dtype=torch.int32)
    run_case("triton", 1, 2, 16, 24, seqlens=(1, 2, 0), slots=7, per_token=per_token,
             num_accepted=torch.tensor([1, 2, 1], dtype=torch.int32), seed=13)
    run_case("triton", 1, 2, 16, 24, seqlens=(1, 1), slots=7, per_token=per_token[:2, :1], seed=14)


# ----------------------------------------------------------------------------
# Against fla-core's naive recurrence (independent of kdakit.reference)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lower_bound", [None, -3.0], ids=["default-gate", "safe-gate"])
def test_against_fla_naive_varlen(backend, lower_bound):
    gen = torch.Generator().manual_seed(7)
    H, HV, K, V = 1, 2, 16, 24
    seqlens = [2, 3, 1]
    x, T = make_inputs(H, HV, K, V, seqlens, gen=gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    cu = cu_from(seqlens)
    state = random_pool(6, HV, V, K, torch.float32, generator=gen)
    before = state.clone()
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    g_log = fla_log_gate(x["g"], A_log, dt_bias, lower_bound)
    init = [before[s].transpose(-1, -2) if s >= 0 else None for s in idx.tolist()]
    o_fla, ts_fla, finals = fla_varlen(x["q"], x["k"], x["v"], g_log, torch.sigmoid(x["beta"]), cu, init,
                                       use_qk_l2norm=True)
    for n, s in enumerate(idx.tolist()):  # a padding row (slot < 0): zero outputs and states
        if s < 0:
            o_fla[:, int(cu[n]):int(cu[n + 1])] = 0
            ts_fla[int(cu[n]):int(cu[n + 1])] = 0
    token_states = torch.full((T, HV, V, K), POISON)
    out = recurrent_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, cu_seqlens=cu, A_log=A_log,
                            dt_bias=dt_bias, lower_bound=lower_bound, beta_is_logit=True,
                            token_states=token_states, backend=backend)
    assert_close(out, o_fla, 1e-5, "out vs fla naive")
    assert_close(token_states, ts_fla.transpose(-1, -2), 1e-5, "token states vs fla naive")
    for n, s in enumerate(idx.tolist()):
        if s >= 0:
            assert_close(state[s], finals[n].transpose(-1, -2), 1e-5, f"final state {n} vs fla naive")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_token", [False, True], ids=["1d-slots", "2d-slots"])
def test_padding_row_is_zero_and_touches_no_pool(backend, per_token):
    """SPEC: a sequence whose (starting) slot is < 0 writes zero outputs and token states and
    reads or writes no pool slot, even with other tokens' slots set (2-D indices)."""
    gen = torch.Generator().manual_seed(12)
    H, HV, K, V = 1, 2, 16, 16
    x, T = make_inputs(H, HV, K, V, [2, 2], gen=gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    state = random_pool(5, HV, V, K, torch.float32, generator=gen)
    before = state.clone()
    idx = (torch.tensor([[1, 3], [-1, 4]], dtype=torch.int32) if per_token
           else torch.tensor([1, -1], dtype=torch.int32))
    token_states = torch.full((T, HV, V, K), POISON)
    out = torch.full((1, T, HV, V), POISON)
    recurrent_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, cu_seqlens=cu_from([2, 2]),
                      A_log=A_log, dt_bias=dt_bias, beta_is_logit=True, token_states=token_states, out=out,
                      backend=backend)
    assert torch.equal(out[:, 2:], torch.zeros_like(out[:, 2:])), "padding outputs are zero"
    assert torch.equal(token_states[2:], torch.zeros_like(token_states[2:])), "padding token states are zero"
    assert torch.isfinite(out[:, :2]).all() and not torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    untouched = [0, 2, 4] if per_token else [0, 2, 3, 4]
    for s in untouched:
        assert torch.equal(state[s], before[s]), f"slot {s} must stay bitwise"


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_slots_against_fla_naive(backend):
    gen = torch.Generator().manual_seed(8)
    H, HV, K, V = 2, 4, 16, 16
    seqlens = [3, 2]
    x, T = make_inputs(H, HV, K, V, seqlens, gen=gen, raw_gate=False, beta_is_logit=False, use_qk_l2norm=False)
    cu = cu_from(seqlens)
    state = random_pool(8, HV, V, K, torch.float32, generator=gen)
    before = state.clone()
    per_token = torch.tensor([[1, 6, 2], [4, 0, 5]], dtype=torch.int64)
    num_accepted = torch.tensor([3, 1], dtype=torch.int64)  # seq 0 starts from slot 2, seq 1 from slot 4
    init = [before[2].transpose(-1, -2), before[4].transpose(-1, -2)]
    o_fla, ts_fla, _ = fla_varlen(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, init, use_qk_l2norm=False)
    out = recurrent_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], state, per_token, cu_seqlens=cu,
                            use_qk_l2norm=False, num_accepted_tokens=num_accepted, backend=backend)
    assert_close(out, o_fla, 1e-5, "out vs fla naive")
    for n, L in enumerate(seqlens):
        for i in range(L):
            t = int(cu[n]) + i
            assert_close(state[int(per_token[n, i])], ts_fla[t].transpose(-1, -2), 1e-5, f"seq {n} token {i}")
    for s in (3, 7):
        assert torch.equal(state[s], before[s])


# ----------------------------------------------------------------------------
# Dispatch, launch configs
# ----------------------------------------------------------------------------
def test_registered_backends_and_cpu_default():
    assert set(backends.available("recurrent_forward")) == {"reference", "triton"}
    name, _ = backends.select("recurrent_forward", torch.device("cpu"))
    assert name in ("reference", "triton")  # triton only when KDAKIT_BACKEND forces it


@pytest.mark.parametrize("config", sweep([(4, 1), (32, 2), (8, 1, 2), (4, 1, 3), (4, 1, 3, 0), (4, 1, 3, 1, 1), (8, 1, 1, 1, 1)], keep=[0, 3], unpack=False),
                         ids=["bv4", "bv32", "bv8-tiles2", "bv4-tiles3", "bv4-tiles3-no-prefetch", "bv4-tiles3-tiles-first",
                              "bv8-tiles-first"])
def test_triton_tile_configs(config):
    """Configs a benchmark sweep may pin compute the same thing."""
    gen = torch.Generator().manual_seed(9)
    H, HV, K, V = 1, 2, 16, 40
    x, T = make_inputs(H, HV, K, V, [2, 1], gen=gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    cu, idx = cu_from([2, 1]), torch.tensor([1, 2], dtype=torch.int32)
    state = random_pool(3, HV, V, K, torch.float32, generator=gen)
    ref_out, ref_pool, _ = run_reference64(x, state, idx, T, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias,
                                           beta_is_logit=True)
    out = torch.full((1, T, HV, V), POISON)
    recurrent_forward_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, out, cu_seqlens=cu,
                             scale=K ** -0.5, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=None,
                             beta_mode=1, num_accepted_tokens=None, token_states=None, write_final_state=True,
                             final_states=None, config=RecurrentForwardConfig(*config))
    assert_close(out, ref_out, 1e-5)
    assert_close(state, ref_pool, 1e-5)


# ----------------------------------------------------------------------------
# Contract: exact texts, clear errors, nothing written on error
# ----------------------------------------------------------------------------
def error_case():
    gen = torch.Generator().manual_seed(10)
    H, HV, K, V = 1, 2, 16, 24
    x, T = make_inputs(H, HV, K, V, [2, 1], gen=gen, raw_gate=False, beta_is_logit=False)
    state = random_pool(4, HV, V, K, torch.float32, generator=gen)
    return x, state, torch.tensor([0, 2], dtype=torch.int32), cu_from([2, 1]), T


def call(x, state, idx, **kw):
    return recurrent_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_error_texts_exact_and_nothing_written(backend):
    x, state, idx, cu, T = error_case()
    before = state.clone()
    out = torch.full_like(x["v"], POISON)
    batched = {n: torch.cat([t, t]) for n, t in x.items()}
    msg = ("The batch size is expected to be 1 rather than 2 when using `cu_seqlens`."
           "Please flatten variable-length inputs before processing.")
    with pytest.raises(ValueError) as e:
        call(batched, state, idx, cu_seqlens=cu, out=torch.cat([out, out]), backend=backend)
    assert str(e.value) == msg
    for wrong in (torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([[0], [1], [2]], dtype=torch.int32)):
        with pytest.raises(ValueError) as e:
            call(x, state, wrong, cu_seqlens=cu, out=out, backend=backend)
        assert str(e.value) == ("The number of initial states is expected to be equal to the number of input "
                                "sequences, i.e., 2 rather than 3.")
    assert torch.equal(state, before) and (out == POISON).all()


BAD_CALLS = {
    "q-3d": (lambda x, s, i, c: (dict(x, q=x["q"][0]), s, i, dict(cu_seqlens=c)), "`q` must be a 4D tensor"),
    "no-cu-batch-2": (lambda x, s, i, c: ({n: torch.cat([t, t]) for n, t in x.items()}, s, i[:1], {}),
                      "one flattened batch"),
    "k-major-pool": (lambda x, s, i, c: (x, s.transpose(-1, -2).contiguous(), i, dict(cu_seqlens=c)),
                     "`state` must have shape [slots, HV, V, K]"),
    "pool-not-contiguous": (lambda x, s, i, c: (x, s.transpose(-1, -2).contiguous().transpose(-1, -2), i,
                                                dict(cu_seqlens=c)), "contiguous inner dims"),
    "g-shape": (lambda x, s, i, c: (dict(x, g=x["g"][..., :8]), s, i, dict(cu_seqlens=c)), "`g` must have shape"),
    "q-int": (lambda x, s, i, c: (dict(x, q=x["q"].long(), k=x["k"].long()), s, i, dict(cu_seqlens=c)),
              "`q` must have a floating dtype"),
    "slots-float": (lambda x, s, i, c: (x, s, i.float(), dict(cu_seqlens=c)), "`slot_indices` must be an int32"),
    "accepted-with-1d": (lambda x, s, i, c: (x, s, i, dict(cu_seqlens=c, num_accepted_tokens=i)),
                         "`num_accepted_tokens` needs 2D"),
    "lower-bound-without-A": (lambda x, s, i, c: (x, s, i, dict(cu_seqlens=c, lower_bound=-1.0)),
                              "belong to the gate in kernel"),
    "token-states-shape": (lambda x, s, i, c: (x, s, i, dict(cu_seqlens=c, token_states=s)),
                           "`token_states` must have shape"),
    "v-not-last-contiguous": (lambda x, s, i, c: (dict(x, v=x["v"].transpose(-1, -2).contiguous().transpose(-1, -2)),
                                                  s, i, dict(cu_seqlens=c)), "`v` must be contiguous in the last"),
    "out-of-range-slot": (lambda x, s, i, c: (x, s, torch.tensor([0, 4], dtype=torch.int32),
                                              dict(cu_seqlens=c, full_checks=True)), "out of range"),
    "duplicate-slot": (lambda x, s, i, c: (x, s, torch.tensor([1, 1], dtype=torch.int32),
                                           dict(cu_seqlens=c, full_checks=True)), "same live slot"),
    "bad-cu-seqlens": (lambda x, s, i, c: (x, s, i, dict(cu_seqlens=torch.tensor([0, 3, 2]), full_checks=True)),
                       "`cu_seqlens` must rise"),
    "2d-too-narrow": (lambda x, s, i, c: (x, s, i[:, None], dict(cu_seqlens=c, full_checks=True)),
                      "columns but a sequence has 2 tokens"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_clear_errors_leave_buffers_untouched(backend, case):
    x, state, idx, cu, T = error_case()
    make, text = BAD_CALLS[case]
    x2, state2, idx2, kw = make(x, state, idx, cu)
    before = state2.clone()
    out = torch.full_like(x2["v"], POISON)
    with pytest.raises(ValueError, match=None) as e:
        call(x2, state2, idx2, out=out, backend=backend, **kw)
    assert text in str(e.value), str(e.value)
    assert torch.equal(state2, before) and (out == POISON).all()


@pytest.mark.parametrize("bad_offsets", [[0, 3, 13], [0, 9, 4], [-4, 3, 8]], ids=["past-T", "decreasing", "negative"])
def test_offsets_outside_the_tokens_touch_nothing_outside(bad_offsets):
    """cu_seqlens are data (checked only with full checks): the kernel clamps them into
    [0, T], so offsets past T, decreasing or negative never reach a row outside the token
    buffers, which here are views into larger poisoned ones."""
    T, H, HV, K, V, slots = 8, 1, 2, 16, 32, 4
    gen = torch.Generator().manual_seed(3)

    def view(*inner):  # rows [4, 4 + T) of a poisoned [1, T + 8, ...] buffer
        flat = torch.full((1, T + 8, *inner), POISON)
        flat[:, 4:4 + T] = torch.randn(1, T, *inner, generator=gen)
        return flat, flat[:, 4:4 + T]
    (qb, q), (kb, k), (vb, v) = view(H, K), view(H, K), view(HV, V)
    (gb, g), (bb, beta) = view(HV, K), view(HV)
    g.copy_(-torch.rand(1, T, HV, K, generator=gen))
    outb, out = view(HV, V)
    before = [x.clone() for x in (qb, kb, vb, gb, bb, outb)]
    state = random_pool(slots, HV, V, K, torch.float32, generator=gen)
    idx = torch.tensor([1, 3], dtype=torch.int32)
    cu = torch.tensor(bad_offsets, dtype=torch.int32)
    recurrent_forward_triton(q, k, v, g, beta, state, idx, out, cu_seqlens=cu, scale=K ** -0.5, use_qk_l2norm=True,
                             A_log=None, dt_bias=None, lower_bound=None, beta_mode=0, num_accepted_tokens=None,
                             token_states=None, write_final_state=True, final_states=None, padding_rows=True)
    for buf, old in zip((qb, kb, vb, gb, bb, outb), before):
        assert torch.equal(buf[:, :4], old[:, :4]) and torch.equal(buf[:, 4 + T:], old[:, 4 + T:])
    assert torch.isfinite(state).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("bad_offsets", [[0, 3, 13], [0, 9, 4], [-4, 3, 8]], ids=["past-T", "decreasing", "negative"])
def test_offsets_outside_the_tokens_both_backends_agree(bad_offsets):
    """The reference reads out-of-range offsets as the kernel does (clamped into [0, T])."""
    T, H, HV, K, V, slots = 8, 1, 2, 16, 32, 4
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v, beta = torch.randn(1, T, HV, V, generator=gen), torch.rand(1, T, HV, generator=gen)
    g = -torch.rand(1, T, HV, K, generator=gen)
    pool = random_pool(slots, HV, V, K, torch.float32, generator=gen)
    idx, cu = torch.tensor([1, 3], dtype=torch.int32), torch.tensor(bad_offsets, dtype=torch.int32)
    results = []
    for backend in ("reference", "triton"):
        state, out = pool.clone(), torch.zeros(1, T, HV, V)
        recurrent_forward(q, k, v, g, beta, state, idx, cu_seqlens=cu, out=out, backend=backend)
        results.append((out, state))
    assert_close(results[1][0], results[0][0], 1e-5, "out")
    assert_close(results[1][1], results[0][1], 1e-5, "state")
