"""Chunked varlen prefill: the Triton kernels (interpreter) and the reference backend
against the float64 token-by-token recurrence and fla-core's naive recurrence, on varlen
batches (length 1, lengths off the chunk grid), GVA, K != V, both gates and the
log-decay input, a steep unbounded gate, float32 and bf16 pools, has_initial_state mixes,
padding and out-of-range slots, poisoned pools and outputs, chunk-boundary states; the
contract's errors with buffers untouched; the custom op under torch.compile."""
import itertools

import pytest
import torch

import kdakit
from kdakit import reference
from kdakit.ops.chunk_prefill import (BETA_SIGMOID, ChunkConfig, chunk_plan, chunk_prefill_triton,
                                      max_chunks_for)

from fla_oracle import fla_log_gate, fla_varlen
from helpers import POISON, assert_close, kda_params, nan_filled, rel_err, sweep

F64 = torch.float64
IEEE16 = ChunkConfig(chunk=16, block_v=16, dot_precision="ieee")
IEEE32 = ChunkConfig(chunk=32, block_v=16, dot_precision="ieee")
IEEE32S = ChunkConfig(chunk=32, block_v=16, dot_precision="ieee", split_prep=True)  # the prep over three launches
IEEE16C3 = ChunkConfig(chunk=16, block_v=16, dot_precision="ieee", chain_pieces=3)  # the chain in 3 pieces
IEEE16W = ChunkConfig(chunk=16, block_v=32, dot_precision="ieee")  # a wider V tile
IEEE16A = ChunkConfig(chunk=16, block_v=16, dot_precision="ieee", outputs="after_chain", output_block_v=16)
ERRORS = {}  # measured relative errors, printed by the last test (pytest -s)


def cu_from(seqlens):
    return torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32)


def make_case(H, HV, K, V, seqlens, *, seed=0, act=torch.float32, state_dtype=torch.float32, slots=6,
              raw_gate=True, steep=False, extra_tokens=0, slot_stride=None):
    gen = torch.Generator().manual_seed(seed)
    T = sum(seqlens) + extra_tokens
    x = {"q": torch.randn(1, T, H, K, generator=gen), "k": torch.randn(1, T, H, K, generator=gen),
         "v": torch.randn(1, T, HV, V, generator=gen), "beta": torch.randn(1, T, HV, generator=gen)}
    if raw_gate:
        x["g"] = torch.randn(1, T, HV, K, generator=gen)
        A_log, dt_bias = kda_params(HV, K, generator=gen)
        if steep:  # log-decay about -20 a token in a quarter of the channels
            A_log = torch.zeros(HV)
            x["g"][..., : K // 4] = 20.0 + torch.rand(1, T, HV, K // 4, generator=gen)
            dt_bias = dt_bias.view(HV, K)
            dt_bias[:, : K // 4] = 0.0
            dt_bias = dt_bias.reshape(-1)
    else:
        x["g"] = -torch.rand(1, T, HV, K, generator=gen) * 2.0
        A_log = dt_bias = None
    x = {n: t.to(act) for n, t in x.items()}
    inner = HV * V * K
    stride = slot_stride or inner
    flat = (torch.randn(slots * stride, generator=gen) * 0.5).to(state_dtype)
    state = flat.as_strided((slots, HV, V, K), (stride, V * K, K, 1))
    return x, A_log, dt_bias, cu_from(seqlens), state, T


def ref64(x, A_log, dt_bias, cu, state, idx, *, lower_bound=None, has_initial_state=None, chunk_states=None,
          chunk_state_indices=None, chunk_size=64):
    pool = state.double()
    T, HV, V = x["v"].shape[1:]
    out = torch.full((1, T, HV, V), POISON, dtype=F64)
    cs = chunk_states.double() if chunk_states is not None else None
    reference.chunk_prefill(*(x[n].double() for n in ("q", "k", "v", "g", "beta")), pool, idx, out, cu_seqlens=cu,
                            A_log=None if A_log is None else A_log.double(),
                            dt_bias=None if dt_bias is None else dt_bias.double(), lower_bound=lower_bound,
                            beta_is_logit=True, has_initial_state=has_initial_state, chunk_states=cs,
                            chunk_state_indices=chunk_state_indices, chunk_size=chunk_size, compute_dtype=F64)
    return out, pool, cs


def poison_workspaces(monkeypatch):
    """Every floating tensor ``torch.empty`` makes while the test runs starts as NaN."""
    monkeypatch.setattr(torch, "empty", nan_filled(torch.empty))


def run_triton(x, A_log, dt_bias, cu, state, idx, out, config, *, lower_bound=None, has_initial_state=None,
               chunk_states=None, chunk_state_indices=None, interval=None):
    K = x["q"].shape[-1]
    return chunk_prefill_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, out, cu_seqlens=cu,
                                scale=K ** -0.5, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias,
                                lower_bound=lower_bound, beta_mode=BETA_SIGMOID, has_initial_state=has_initial_state,
                                chunk_states=chunk_states, chunk_state_indices=chunk_state_indices, config=config,
                                chunk_state_interval=interval or config.chunk)


def storage(state):
    return torch.as_strided(state, (state.shape[0] * state.stride(0),), (1,))


def check_pool(state, before, ref_pool, written, tol, what):
    """Written slots match the reference; every other byte of the storage is bitwise unchanged."""
    for s in written:
        assert_close(state[s], ref_pool[s], tol, f"{what}: slot {s}")
    keep = torch.ones(storage(state).numel(), dtype=torch.bool)
    inner = state[0].numel()
    for s in written:
        keep[s * state.stride(0): s * state.stride(0) + inner] = False
    assert torch.equal(storage(state)[keep], storage(before)[keep]), f"{what}: untouched bytes changed"


# ----------------------------------------------------------------------------
# Against the float64 recurrence
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("H,HV,K,V", sweep([(1, 1, 16, 32), (2, 4, 32, 16)]), ids=["H1-HV1-K16-V32", "H2-HV4-K32-V16"])
@pytest.mark.parametrize("gate", ["softplus", "safe", "log-decay"])
@pytest.mark.parametrize("config", sweep([IEEE16, IEEE32, IEEE32S, IEEE16C3], keep=2),
                         ids=["chunk16", "chunk32", "chunk32-split-prep", "chunk16-chain-3-pieces"])
def test_varlen_against_float64(H, HV, K, V, gate, config):
    seqlens = [1, 36, 63]  # cu_seqlens [0, 1, 37, 100]: length 1, lengths off the chunk grid
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, seqlens, raw_gate=gate != "log-decay", seed=1,
                                                extra_tokens=2)
    lb = -5.0 if gate == "safe" else None
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    before = state.clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=lb)
    out = torch.full((1, T, HV, V), POISON)
    run_triton(x, A_log, dt_bias, cu, state, idx, out, config, lower_bound=lb)
    e_out = rel_err(out[:, :100], ref_out[:, :100])
    ERRORS[f"varlen {gate} {H},{HV},{K},{V} C{config.chunk}{' split' if config.split_prep else ''}"
           f"{f' pieces {config.chain_pieces}' if config.chain_pieces > 1 else ''}"] = e_out
    assert e_out < 1e-5, e_out
    assert (out[:, 100:] == POISON).all(), "rows outside cu_seqlens must not be written"
    check_pool(state, before, ref_pool, [4, 0, 2], 1e-5, "pool")


def test_public_entry_default_chunk_and_fla_naive_oracle():
    """The public call (chunk 64, TF32 dots: exact float32 in the interpreter) against float64
    and fla-core's naive recurrence (K-major states)."""
    H, HV, K, V = 1, 2, 32, 16
    seqlens = [70, 1, 129]
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, seqlens, seed=2)
    idx = torch.tensor([5, 1, 3], dtype=torch.int32)
    initial = [state[int(s)].transpose(-1, -2).clone() for s in idx]
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx)
    out = kdakit.chunk_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, cu_seqlens=cu, A_log=A_log,
                               dt_bias=dt_bias, beta_is_logit=True, backend="triton")
    assert_close(out, ref_out, 1e-5, "out vs float64")
    ERRORS["public chunk64 vs float64"] = rel_err(out, ref_out)
    g_log = fla_log_gate(x["g"], A_log, dt_bias, None)
    fla_out, _, fla_finals = fla_varlen(x["q"], x["k"], x["v"], g_log, torch.sigmoid(x["beta"]), cu, initial,
                                        use_qk_l2norm=True)
    assert_close(out, fla_out, 1e-5, "out vs fla naive")
    ERRORS["public chunk64 vs fla naive"] = rel_err(out, fla_out)
    for n, s in enumerate(idx.tolist()):
        assert_close(state[s], ref_pool[s], 1e-5, f"slot {s} vs float64")
        assert_close(state[s], fla_finals[n].transpose(-1, -2), 1e-5, f"slot {s} vs fla naive")


@pytest.mark.exhaustive
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "safe-at-bound"])
def test_steep_gate_stays_finite_and_accurate(lower_bound):
    """Softplus gate: log-decay about -20 a token in some channels over a few hundred tokens
    (forming exp(-Γ) over a chunk would overflow: e^1280); every exponent formed is <= 0.
    Safe gate at its bound (g ~ -5 in those channels): sub-blocks whose spread passes
    ``factor_spread_max`` take exact decays, the others one factored product."""
    H, HV, K, V = 1, 1, 16, 16
    seqlens = [260, 45]
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, seqlens, seed=3, steep=True)
    g_log = reference.kda_gate(x["g"][0].double(), A_log.double(), dt_bias.double().view(HV, K), lower_bound)
    assert float(g_log.min()) < (-19.0 if lower_bound is None else -4.99)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=lower_bound)
    out = torch.full((1, T, HV, V), POISON)
    run_triton(x, A_log, dt_bias, cu, state, idx, out, ChunkConfig(chunk=64, block_v=16),
               lower_bound=lower_bound)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    ERRORS[f"steep gate {lower_bound} chunk64"] = rel_err(out, ref_out)
    assert_close(out, ref_out, 1e-5, "out")
    for s in (1, 2):
        assert_close(state[s], ref_pool[s], 1e-5, f"slot {s}")


@pytest.mark.exhaustive
@pytest.mark.parametrize("spread_max", [-1.0, 60.0], ids=["exact-everywhere", "factored-where-bounded"])
def test_in_sub_block_factoring_per_sub_block(spread_max):
    """Steep and mild sub-blocks in one chunk: a quarter of the channels decay by 20 a token
    over tokens 20..51 only (spread ~320 in those sub-blocks: exact decays), the rest mildly
    (spread <= 32: one factored product), so both paths of the in-sub-block pairs run side by
    side; ``factor_spread_max = -1`` takes exact decays everywhere. Both match float64."""
    H, HV, K, V = 1, 2, 16, 16
    seqlens = [100, 40]
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, seqlens, seed=21, raw_gate=False)
    x["g"][0, 20:52, :, : K // 4] = -20.0
    idx = torch.tensor([3, 0], dtype=torch.int32)
    ref_out, ref_pool, _ = ref64(x, None, None, cu, state, idx)
    out = torch.full((1, T, HV, V), POISON)
    run_triton(x, None, None, cu, state, idx, out,
               ChunkConfig(chunk=64, block_v=16, dot_precision="ieee", factor_spread_max=spread_max))
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    ERRORS[f"steep and mild sub-blocks, spread max {spread_max}"] = rel_err(out, ref_out)
    assert_close(out, ref_out, 1e-5, "out")
    for s in (3, 0):
        assert_close(state[s], ref_pool[s], 1e-5, f"slot {s}")


@pytest.mark.parametrize("state_dtype,act", sweep([(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.bfloat16)]), ids=str)
def test_bf16_pools_and_inputs(state_dtype, act):
    H, HV, K, V = 1, 2, 16, 32
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [20, 13], seed=4, act=act, state_dtype=state_dtype)
    idx = torch.tensor([3, 0], dtype=torch.int32)
    before = state.clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=-2.0)
    out = torch.full((1, T, HV, V), POISON).to(act)
    run_triton(x, A_log, dt_bias, cu, state, idx, out, IEEE16, lower_bound=-2.0)
    assert_close(out, ref_out, 2e-2, "out")
    check_pool(state, before, ref_pool, [3, 0], 2e-2, "pool")


@pytest.mark.parametrize("config", sweep([IEEE16W, IEEE16C3, IEEE16A], keep=2),
                         ids=["whole-chain", "chain-3-pieces", "outputs-after-chain"])
def test_padding_out_of_range_slots_initial_state_mix_interleaved_pool(config):
    """Slot -1 and slot >= slots are padding rows (zero outputs, no pool access); a sequence
    without an initial state starts from zeros and still writes its final state; the pool's
    gaps between slots (interleaved layers) and every other slot stay bitwise."""
    H, HV, K, V = 1, 2, 16, 16
    seqlens = [5, 17, 0, 9, 3, 33]
    slots = 7
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, seqlens, seed=5, slots=slots,
                                                slot_stride=HV * V * K + 24, extra_tokens=3)
    storage(state)[:] = storage(state) + 0  # materialise
    storage(state).view(slots, -1)[:, HV * V * K:] = POISON  # the gaps
    idx = torch.tensor([2, -1, 4, slots + 3, 6, 0], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True, False, True])
    before = state.clone()
    before_storage = storage(state).clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, has_initial_state=has_init)
    out = torch.full((1, T, HV, V), POISON)
    run_triton(x, A_log, dt_bias, cu, state, idx, out, config, has_initial_state=has_init)
    covered = int(cu[-1])
    assert_close(out[:, :covered], ref_out[:, :covered], 1e-5, "out")
    assert (out[0, int(cu[1]):int(cu[2])] == 0).all(), "padding rows are zero"
    assert (out[0, int(cu[3]):int(cu[4])] == 0).all(), "out-of-range slots are padding rows"
    assert (out[:, covered:] == POISON).all()
    # slot 4 (empty sequence, no initial state) holds zeros; slot 6 starts from zeros
    assert (state[4] == 0).all()
    written = [2, 4, 6, 0]
    for s in written:
        assert_close(state[s], ref_pool[s], 1e-5, f"slot {s}")
    keep = torch.ones(before_storage.numel(), dtype=torch.bool)
    for s in written:
        keep[s * state.stride(0): s * state.stride(0) + HV * V * K] = False
    assert torch.equal(storage(state)[keep], before_storage[keep])
    assert torch.equal(state[[1, 3, 5]], before[[1, 3, 5]])


@pytest.mark.parametrize("config", sweep([IEEE16W, IEEE16C3, IEEE16A]),
                         ids=["whole-chain", "chain-3-pieces", "outputs-after-chain"])
def test_chunk_boundary_states(config):
    """The state after every CHUNK tokens goes to its scratch row (prefix caching); rows
    < 0 or out of range are skipped, the rest of the scratch stays bitwise."""
    H, HV, K, V = 1, 1, 16, 16
    seqlens = [40, 16, 5, 50]
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, seqlens, seed=6, slots=5)
    idx = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    scratch = torch.full((6, HV, V, K), POISON)
    rows = torch.tensor([[0, 3, 5], [4, -1, -1], [1, 2, -1], [5, 5, 5]], dtype=torch.int32)
    rows[0, 1] = 17  # out of range: skipped
    before = scratch.clone()
    _, ref_pool, ref_scratch = ref64(x, A_log, dt_bias, cu, state, idx, chunk_states=scratch,
                                     chunk_state_indices=rows, chunk_size=16)
    out = torch.zeros(1, T, HV, V)
    run_triton(x, A_log, dt_bias, cu, state, idx, out, config, chunk_states=scratch, chunk_state_indices=rows)
    # Every 32 tokens from 16-token chunks: only the state after token 32 of sequence 0.
    scratch32 = torch.full((6, HV, V, K), POISON)
    rows32 = torch.tensor([[2, 3], [-1, -1], [-1, -1], [5, 5]], dtype=torch.int32)
    state32 = state.clone()
    _, _, ref32 = ref64(x, A_log, dt_bias, cu, state32, idx, chunk_states=scratch32, chunk_state_indices=rows32,
                        chunk_size=32)
    run_triton(x, A_log, dt_bias, cu, state32, idx, out, IEEE16, chunk_states=scratch32, chunk_state_indices=rows32,
               interval=32)
    assert_close(scratch32[2], ref32[2], 1e-5, "every 32 tokens: row 2")
    assert torch.equal(scratch32[[0, 1, 3, 4, 5]], torch.full((5, HV, V, K), POISON)), "only row 2 is a boundary"
    # seq 0 (40 tokens): boundaries after 16 -> row 0, after 32 -> row 17 (skipped); seq 1 (16): row 4
    # (its final state); seq 2 (5 tokens): none; seq 3 is a padding row: nothing.
    for r in (0, 4):
        assert_close(scratch[r], ref_scratch[r], 1e-5, f"scratch row {r}")
    assert_close(scratch[4], ref_pool[1], 1e-5, "a boundary at the end is the final state")
    for r in (1, 2, 3, 5):
        assert torch.equal(scratch[r], before[r]), f"scratch row {r} must not be written"


def test_reference_backend_and_plan():
    H, HV, K, V = 1, 2, 16, 16
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [3, 0, 8], seed=7)
    idx = torch.tensor([1, 2, 3], dtype=torch.int32)
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=-1.0)
    out = kdakit.chunk_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, cu_seqlens=cu, A_log=A_log,
                               dt_bias=dt_bias, lower_bound=-1.0, beta_is_logit=True, backend="reference")
    assert_close(out, ref_out, 1e-5, "out")
    for s in (1, 2, 3):
        assert_close(state[s], ref_pool[s], 1e-5, f"slot {s}")
    first, seq = chunk_plan(torch.tensor([0, 1, 37, 37, 100]), 16, max_chunks_for(100, 4, 16))
    assert first.tolist() == [0, 1, 4, 4, 8]
    assert seq.tolist() == [0, 1, 1, 1, 3, 3, 3, 3] + [4] * (len(seq) - 8)


@pytest.mark.parametrize("case", ["ragged", "empty-and-unsorted", "out-of-range", "many-sequences", "int64-no-T"])
def test_chunk_plan_kernel_equals_the_torch_ops(case):
    """The plan kernel (one launch) and the torch ops it replaces give the same plan bit for bit:
    ragged lengths, empty and decreasing offsets, offsets past [0, T], more sequences and chunk
    ids than one pass of the kernel's program covers, int64 offsets without a T."""
    from kdakit.ops.chunk_prefill.plan import chunk_plan_torch
    g = torch.Generator().manual_seed(len(case))
    C, T, dtype = 16, 1000, torch.int32
    if case == "ragged":
        cu = torch.cat([torch.zeros(1), torch.randint(0, 70, (9,), generator=g).float().cumsum(0)])
        T = int(cu[-1])
    elif case == "empty-and-unsorted":
        cu = torch.tensor([0, 0, 37, 37, 20, 300, 300, 1000])
    elif case == "out-of-range":
        cu = torch.tensor([-50, 10, 2000, 900, -3, 1000])
    elif case == "many-sequences":  # two passes over the sequences and over the chunk ids
        cu = torch.cat([torch.zeros(1), torch.randint(0, 40, (1500,), generator=g).float().cumsum(0)])
        T, C = int(cu[-1]), 8
    else:
        cu, T, dtype = torch.tensor([0, 5, 5, 64, 65, 200]), None, torch.int64
    cu = cu.to(dtype)
    N = cu.numel() - 1
    max_chunks = max_chunks_for(T if T is not None else 200, N, C)
    first, seq = chunk_plan(cu, C, max_chunks, T)
    want_first, want_seq = chunk_plan_torch(cu, C, max_chunks, T)
    assert torch.equal(first, want_first) and torch.equal(seq, want_seq)
    if case == "many-sequences":
        assert N > 1024 and max_chunks > 1024 and int(first[-1]) > 1024


# ----------------------------------------------------------------------------
# The contract
# ----------------------------------------------------------------------------
def _inputs():
    x, A_log, dt_bias, cu, state, T = make_case(1, 2, 16, 16, [3, 4], seed=8, slots=4)
    return dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], state=state,
                slot_indices=torch.tensor([0, 1], dtype=torch.int32)), dict(cu_seqlens=cu, A_log=A_log,
                                                                             dt_bias=dt_bias)


@pytest.mark.parametrize("breaker,match", [
    (lambda a, kw: a.update(slot_indices=torch.zeros(2, 3, dtype=torch.int32)), "must be 1D"),
    (lambda a, kw: a.update(slot_indices=torch.zeros(3, dtype=torch.int32)), "number of initial states"),
    (lambda a, kw: kw.update(has_initial_state=torch.ones(3, dtype=torch.bool)), "has_initial_state"),
    (lambda a, kw: kw.update(has_initial_state=torch.ones(2)), "has_initial_state"),
    (lambda a, kw: kw.update(chunk_states=torch.zeros(2, 2, 16, 16)), "go together"),
    (lambda a, kw: kw.update(chunk_states=torch.zeros(2, 2, 16, 8), chunk_state_indices=torch.zeros(2, 1).int()),
     "chunk_states"),
    (lambda a, kw: kw.update(chunk_states=torch.zeros(2, 2, 16, 16), chunk_state_indices=torch.zeros(3, 1).int()),
     "chunk_state_indices"),
    (lambda a, kw: a.update(q=a["q"][:, :, :, :8]), "`k` must have the shape"),
    (lambda a, kw: kw.update(lower_bound=-7.0), "lower_bound"),
    (lambda a, kw: a.update(state=a["state"].transpose(-1, -2)), "state"),
    (lambda a, kw: a.update(slot_indices=torch.tensor([0, 9], dtype=torch.int32)) or kw.update(full_checks=True),
     "out of range"),
    (lambda a, kw: kw.update(cu_seqlens=torch.tensor([0, 5, 4], dtype=torch.int32), full_checks=True),
     "cu_seqlens"),
])
def test_contract_errors_leave_buffers_untouched(breaker, match):
    args, kw = _inputs()
    breaker(args, kw)
    before = args["state"].clone()
    out = torch.full_like(args["v"], 3.0)
    with pytest.raises(ValueError, match=match):
        kdakit.chunk_prefill(args["q"], args["k"], args["v"], args["g"], args["beta"], args["state"],
                             args["slot_indices"], out=out, beta_is_logit=True, backend="triton", **kw)
    assert torch.equal(args["state"], before) and (out == 3.0).all()


def test_custom_op_under_compile_matches_eager():
    torch._dynamo.reset()
    args, kw = _inputs()
    eager_state = args["state"].clone()
    eager_out = kdakit.chunk_prefill(*(args[n] for n in ("q", "k", "v", "g", "beta")), eager_state,
                                     args["slot_indices"], beta_is_logit=True, backend="reference", **kw)

    def fn(q, k, v, g, beta, state, idx, cu, A_log, dt_bias):
        out = kdakit.chunk_prefill(q, k, v, g, beta, state, idx, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias,
                                   beta_is_logit=True, backend="reference")
        return out, out.sum()

    state = args["state"].clone()
    out, _ = torch.compile(fn, fullgraph=True, backend="aot_eager")(
        *(args[n] for n in ("q", "k", "v", "g", "beta")), state, args["slot_indices"], kw["cu_seqlens"],
        kw["A_log"], kw["dt_bias"])
    assert torch.equal(out, eager_out) and torch.equal(state, eager_state)
    torch._dynamo.reset()
    K = args["q"].shape[-1]
    torch.library.opcheck(torch.ops.kdakit.chunk_prefill.default,
                          (*(args[n] for n in ("q", "k", "v", "g", "beta")), args["state"].clone(),
                           args["slot_indices"], torch.zeros_like(args["v"]), kw["cu_seqlens"], K ** -0.5, True,
                           kw["A_log"], kw["dt_bias"], None, BETA_SIGMOID, None, None, None, "reference"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# ----------------------------------------------------------------------------
# kdakit.compat.fla.chunk_kda (fla-core 0.6.0's signature)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["k-major", "v-first"])
def test_compat_chunk_kda_against_fla_naive(layout, monkeypatch):
    from kdakit.compat.fla import chunk_kda
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    H, HV, K, V = 1, 2, 16, 32
    seqlens = [3, 70]
    x, A_log, dt_bias, cu, _, T = make_case(H, HV, K, V, seqlens, seed=9)
    gen = torch.Generator().manual_seed(10)
    h0 = torch.randn(len(seqlens), HV, K, V, generator=gen) * 0.5  # K-major, fla's default
    init = h0 if layout == "k-major" else h0.transpose(-1, -2).contiguous()
    init_before = init.clone()
    lb = -3.0 if layout == "v-first" else None
    o, ht = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=init, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      safe_gate=lb is not None, lower_bound=lb, state_v_first=layout == "v-first",
                      cu_seqlens=cu.long(), A_log=A_log, dt_bias=dt_bias)
    assert torch.equal(init, init_before), "fla's chunk_kda never writes initial_state"
    g_log = fla_log_gate(x["g"], A_log, dt_bias, lb)
    ref_out, _, finals = fla_varlen(x["q"], x["k"], x["v"], g_log, torch.sigmoid(x["beta"]), cu, list(h0),
                                    use_qk_l2norm=True)
    assert_close(o, ref_out, 1e-5, "o")
    for n in range(len(seqlens)):
        got = ht[n] if layout == "k-major" else ht[n].transpose(-1, -2)
        assert_close(got, finals[n], 1e-5, f"final state {n}")


def test_compat_chunk_kda_equal_length_batch_no_initial_state(monkeypatch):
    from kdakit.compat.fla import chunk_kda
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    H, HV, K, V = 1, 1, 16, 16
    x, _, _, _, _, T = make_case(H, HV, K, V, [40], seed=11, raw_gate=False)  # log-decay g, beta in (0, 1)
    x = {n: t.reshape(2, 20, *t.shape[2:]) for n, t in x.items()}
    beta = torch.sigmoid(x["beta"])
    o, ht = chunk_kda(x["q"], x["k"], x["v"], x["g"], beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    flat = {n: t.reshape(1, 40, *t.shape[2:]) for n, t in x.items()}
    ref_out, _, finals = fla_varlen(flat["q"], flat["k"], flat["v"], flat["g"], beta.reshape(1, 40, HV),
                                    torch.tensor([0, 20, 40]), [None, None], use_qk_l2norm=True)
    assert_close(o.reshape(1, 40, HV, V), ref_out, 1e-5, "o")
    for n in range(2):
        assert_close(ht[n], finals[n], 1e-5, f"final state {n}")
    with pytest.raises(ValueError, match="A_log` must be provided"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], beta, cu_seqlens=torch.tensor([0, 20]))


def test_offsets_past_the_inputs_read_nothing_outside():
    """Default checks do not read cu_seqlens; offsets beyond T (or falling) must still keep
    every access inside the buffers: the inputs here are views into NaN-padded storage, so
    a read past token T would show up as NaN."""
    H, HV, K, V = 1, 1, 16, 16
    x, A_log, dt_bias, _, state, T = make_case(H, HV, K, V, [40], seed=12, slots=3)
    padded = {}
    for n, t in x.items():
        big = torch.full((1, T + 40, *t.shape[2:]), float("nan"))
        big[:, :T] = t
        padded[n] = big[:, :T]
    cu = torch.tensor([0, 30, 10, 500], dtype=torch.int32)  # falls, then runs past T = 40
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.zeros(1, T + 40, HV, V)[:, :T]
    run_triton(padded, A_log, dt_bias, cu, state, idx, out, IEEE16)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    storage_out = torch.as_strided(out, (T + 40, HV * V), (HV * V, 1))
    assert (storage_out[T:] == 0).all(), "nothing written past token T"


@pytest.mark.parametrize("K,V", sweep([(128, 64), (64, 128)]))
def test_real_head_dims_default_config(K, V):
    """The public call's own launch config (chunk 64, tf32x3, V tiles from the shapes) at
    real head dims, K != V."""
    x, A_log, dt_bias, cu, state, T = make_case(1, 1, K, V, [5, 66], seed=13, slots=3)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    before = state.clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx)
    out = kdakit.chunk_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state, idx, cu_seqlens=cu, A_log=A_log,
                               dt_bias=dt_bias, beta_is_logit=True, backend="triton")
    ERRORS[f"public K{K} V{V}"] = rel_err(out, ref_out)
    assert_close(out, ref_out, 1e-5, "out")
    check_pool(state, before, ref_pool, [2, 0], 1e-5, "pool")


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus-steep", "safe-at-bound"])
def test_chunk_form_algebra_in_float64(lower_bound):
    """The chunk form the kernels implement (tests/chunk_oracle.py) equals the recurrence
    to float64 rounding, steep gates included: the algebra, independent of any kernel."""
    from chunk_oracle import chunk_form
    H, HV, K, V = 1, 1, 16, 8
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [150], seed=14, steep=True, slots=1)
    idx = torch.tensor([0], dtype=torch.int32)
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=lower_bound)
    qh, kh = reference.prepare_qk(x["q"][0].double(), x["k"][0].double(), HV, K ** -0.5)
    g = reference.kda_gate(x["g"][0].double(), A_log.double(), dt_bias.double().view(HV, K), lower_bound)
    for chunk in (16, 64):
        o, S = chunk_form(qh[:, 0], kh[:, 0], x["v"][0, :, 0], g[:, 0], torch.sigmoid(x["beta"][0, :, 0].double()),
                          state[0, 0], chunk)
        assert rel_err(o, ref_out[0, :, 0]) < 1e-12 and rel_err(S, ref_pool[0, 0]) < 1e-12


@pytest.mark.exhaustive
@pytest.mark.parametrize("split_prep", [False, True], ids=["one-launch", "split-prep"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_qk_from_input_equals_the_workspace_bitwise(split_prep, l2norm):
    """``ChunkConfig.qk_from_input``: the later prep phases read q and k from the inputs and
    divide by the kept row norms; outputs and states bit for bit the workspace path's. Steep
    and mild sub-blocks (both in-sub-block paths, a steep one in a chunk's last, partial
    sub-block too), GVA, K below its power-of-two tile, bf16 inputs, a sequence of one token
    and one off the chunk grid."""
    H, HV, K, V = 1, 2, 24, 16
    x, _, _, cu, state, T = make_case(H, HV, K, V, [70, 1, 23], seed=8, raw_gate=False, act=torch.bfloat16,
                                      extra_tokens=3)
    x["g"][0, 10:40, :, : K // 4] = -20.0
    x["g"][0, 64:70, :, : K // 4] = -20.0  # sequence 0's last chunk holds 6 tokens
    idx = torch.tensor([3, 0, 5], dtype=torch.int32)
    got = []
    for from_input in (False, True):
        pool = state.clone()
        out = torch.full((1, T, HV, V), POISON).to(torch.bfloat16)
        cfg = ChunkConfig(chunk=32, block_v=16, dot_precision="ieee", split_prep=split_prep,
                          qk_from_input=from_input)
        chunk_prefill_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx, out, cu_seqlens=cu,
                             scale=K ** -0.5, use_qk_l2norm=l2norm, A_log=None, dt_bias=None, lower_bound=None,
                             beta_mode=BETA_SIGMOID, has_initial_state=None, chunk_states=None,
                             chunk_state_indices=None, config=cfg)
        got.append((out, pool))
    assert torch.isfinite(got[0][0].float()[:, :94]).all()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert (got[1][0][:, 94:] == POISON).all()


def run_recording_prep_launches(monkeypatch, case, idx, configs):
    """Each config's (out, pool) on ``case``, and the PHASES of its prep launches in order."""
    from kdakit.ops.chunk_prefill import run as module
    x, A_log, dt_bias, cu, state, T = case
    HV, V = x["v"].shape[2:]
    got, phases = [], []
    prep = module._chunk_prep

    def counting_prep(grid, args, constexprs, **kw):
        phases[-1].append(constexprs["PHASES"])
        return prep(grid, args, constexprs, **kw)
    monkeypatch.setattr(module, "_chunk_prep", counting_prep)
    for config in configs:
        pool = state.clone()
        out = torch.full((1, T, HV, V), POISON)
        phases.append([])
        run_triton(x, A_log, dt_bias, cu, pool, idx, out, config)
        got.append((out, pool))
    return got, phases


@pytest.mark.exhaustive
def test_split_rest_equals_one_rest_launch_bitwise(monkeypatch):
    """``ChunkConfig.split_rest``: the prep's last launch as three (products, inverse, w and u)
    gives the same bits as one; GVA, a steep sub-block, sequences off the chunk grid."""
    H, HV, K, V = 1, 2, 32, 16
    case = make_case(H, HV, K, V, [45, 1, 30], seed=9, extra_tokens=2)
    case[0]["g"][0, 5:20, :, : K // 4] = 30.0  # a steep sub-block under the default gate
    got, phases = run_recording_prep_launches(
        monkeypatch, case, torch.tensor([2, 5, 0], dtype=torch.int32),
        [ChunkConfig(chunk=32, block_v=16, dot_precision="ieee", split_prep=True, split_rest=split_rest)
         for split_rest in (False, True)])
    assert phases == [[1, 2, 28], [1, 2, 4, 8, 16]], phases
    assert torch.isfinite(got[0][0][:, :76]).all()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@pytest.mark.exhaustive
@pytest.mark.parametrize("chain_dots,K", [("float32", 32), ("bfloat16", 32), ("bfloat16", 40)],
                         ids=["float32-products-K32", "bf16-products-K32", "bf16-products-K40"])
def test_outputs_after_chain_equal_in_chain_bitwise(monkeypatch, chain_dots, K):
    """``ChunkConfig.outputs="after_chain"``: the chain stores each chunk's start state and U
    (bf16 with bf16 products), a token-parallel launch makes the outputs: the same bits as
    outputs inside the chain. Padding and out-of-range slots (zero outputs), a sequence with
    no initial state, an empty one, lengths off the chunk grid, GVA, K != V, K and V below
    their tiles, output tiles narrower than V; tokens past the last sequence stay poisoned, and
    the workspaces start as NaN (the output launch reads only what the chain wrote)."""
    H, HV, V = 1, 2, 24
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [40, 7, 0, 33, 1], seed=13, act=torch.bfloat16,
                                                extra_tokens=3)
    poison_workspaces(monkeypatch)
    idx = torch.tensor([3, -1, 0, 5, 9], dtype=torch.int32)
    has_init = torch.tensor([True, True, True, False, True])
    got = []
    for outputs in ("in_chain", "after_chain"):
        pool = state.clone()
        out = torch.full((1, T, HV, V), POISON).to(torch.bfloat16)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out,
                   ChunkConfig(chunk=16, block_v=32, dot_precision="ieee", outputs=outputs, output_block_v=16,
                               factor_dtype="bfloat16", chain_dot_dtype=chain_dots),
                   has_initial_state=has_init)
        got.append((out, pool))
    n = T - 3
    assert torch.isfinite(got[0][0][:, :n].float()).all() and (got[1][0][:, n:] == POISON).all()
    assert (got[1][0][0, 40:47] == 0).all(), "a padding sequence's outputs are zero"
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    ref_out, _, _ = ref64(x, A_log, dt_bias, cu, state, idx, has_initial_state=has_init, chunk_size=16)
    assert_close(got[1][0][:, :n], ref_out[:, :n], 2e-2, "outputs after the chain")


@pytest.mark.exhaustive
@pytest.mark.parametrize("outputs,products", [("in_chain", "block_programs"), ("after_chain", "by_slice")])
def test_bf16_qk_pairs_equal_float32_ones_bitwise(outputs, products):
    """``ChunkConfig.qk_pairs_dtype="bfloat16"``: P stored rounded as the bf16 chain products
    take it gives the bits of float32 P (the products round it the same way); steep and mild
    sub-blocks (both of P's store paths), padding, GVA, K != V, lengths off the chunk grid.
    With float32 chain products it is refused."""
    H, HV, K, V = 1, 2, 32, 24
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [40, 7, 33, 1], seed=23, act=torch.bfloat16,
                                                extra_tokens=3)
    x["g"][0, 2:12, :, : K // 4] = 30.0  # a steep sub-block under the default gate
    idx = torch.tensor([3, -1, 5, 0], dtype=torch.int32)
    got = []
    for pairs in ("float32", "bfloat16"):
        pool = state.clone()
        out = torch.full((1, T, HV, V), POISON).to(torch.bfloat16)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out,
                   ChunkConfig(chunk=32, block_v=32, dot_precision="ieee", split_prep=True, split_rest=True,
                               qk_from_input=True, outputs=outputs, output_block_v=16, factor_dtype="bfloat16",
                               chain_dot_dtype="bfloat16", qk_pairs_dtype=pairs, inverse="doubling",
                               diagonal_programs=True, products=products, factor_programs=True))
        got.append((out, pool))
    n = T - 3
    assert torch.isfinite(got[0][0][:, :n].float()).all() and (got[1][0][:, n:] == POISON).all()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    with pytest.raises(ValueError, match="qk_pairs_dtype='bfloat16' needs chain_dot_dtype='bfloat16'"):
        ChunkConfig(qk_pairs_dtype="bfloat16")
    with pytest.raises(ValueError, match="lower_block_warps must be a power of two"):
        ChunkConfig(lower_block_warps=3)


@pytest.mark.exhaustive
@pytest.mark.parametrize("chunk,from_input,K,V", [(64, True, 40, 16), (32, False, 40, 16), (32, True, 16, 40)],
                         ids=["chunk64-qk-from-input-K40-V16", "chunk32-workspace-qk-K40-V16",
                              "chunk32-qk-from-input-K16-V40"])
def test_block_and_slice_programs_equal_the_loops(monkeypatch, chunk, from_input, K, V):
    """``factor_programs`` (a program per K and V slice) gives the bits of the loop over the
    slices; ``products="block_programs"`` (a program per column block, in two launches: the
    lower blocks on the lower half of the rows) the same products on fewer rows, equal to
    float32 rounding (the interpreter's matrix products round by shape) and to float64. Steep
    and mild sub-blocks, K != V both ways (some programs make no u, or no w), GVA, sequences of
    one token and off the chunk grid; with the inverse's diagonal programs and doubling, as
    picked, and the workspaces starting as NaN. The programs need the split launches."""
    from kdakit.ops.chunk_prefill import run as module
    H, HV = 1, 2
    for fields in (dict(products="block_programs"), dict(factor_programs=True)):
        with pytest.raises(ValueError, match="need split_prep and split_rest"):
            ChunkConfig(**fields)
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [2 * chunk + 5, 1, chunk - 3], seed=21,
                                                extra_tokens=2)
    x["g"][0, 3:9, :, : K // 4] = 30.0
    x["g"][0, chunk - 12: chunk, :, K // 2:] = 30.0
    idx = torch.tensor([4, 1, 0], dtype=torch.int32)
    base = dict(chunk=chunk, block_v=16, dot_precision="ieee", split_prep=True, split_rest=True,
                qk_from_input=from_input, slice_k=16, inverse="doubling", diagonal_programs=True)
    poison_workspaces(monkeypatch)
    parts = []
    prep = module._chunk_prep
    monkeypatch.setattr(module, "_chunk_prep", lambda grid, args, constexprs, **kw: (
        parts.append((constexprs["PHASES"], constexprs["PARTS"], constexprs["BLOCK_LAUNCH"])),
        prep(grid, args, constexprs, **kw))[1])
    got = []
    for products, factor_programs in (("by_block", False), ("by_block", True), ("block_programs", True)):
        pool = state.clone()
        out = torch.full((1, T, HV, V), POISON)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out,
                   ChunkConfig(**base, products=products, factor_programs=factor_programs))
        got.append((out, pool))
    # two launches of a program per column block (the upper blocks, the lower ones); four 16-column slices
    assert parts[-4:] == [(4, chunk // 32, 1), (4, chunk // 32, 2), (8, 1, 0), (16, 64 // 16, 0)], parts
    n = T - 2
    assert torch.isfinite(got[0][0][:, :n]).all() and (got[2][0][:, n:] == POISON).all()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert_close(got[2][0][:, :n], got[0][0][:, :n], 1e-6, "block programs' outputs")
    assert_close(got[2][1], got[0][1], 1e-6, "block programs' pool")
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, chunk_size=chunk)
    assert_close(got[2][0][:, :n], ref_out[:, :n], 1e-4, "block programs' outputs against float64")
    for s in (4, 1, 0):
        assert_close(got[2][1][s], ref_pool[s], 1e-4, f"block programs' slot {s}")


@pytest.mark.exhaustive
@pytest.mark.parametrize("chunk,from_input", [(64, True), (32, False), (16, True)],
                         ids=["chunk64-qk-from-input", "chunk32-workspace-qk", "chunk16-qk-from-input"])
def test_products_by_slice_equal_by_block_bitwise(chunk, from_input):
    """``ChunkConfig.products="by_slice"``: every column block's products accumulated per K
    slice give the by-block bits (the same products summed in the same order), steep and mild
    sub-blocks mixed (a steep last sub-block, which covers no rows), GVA, K below its tile,
    sequences of one token and off the chunk grid; both against float64 too."""
    H, HV, K, V = 1, 2, 40, 16
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [2 * chunk + 5, 1, chunk - 3], seed=12,
                                                extra_tokens=2)
    x["g"][0, 3:9, :, : K // 4] = 30.0  # steep sub-blocks under the default gate
    x["g"][0, chunk - 12: chunk, :, K // 2:] = 30.0
    idx = torch.tensor([4, 1, 0], dtype=torch.int32)
    got = []
    for products in ("by_block", "by_slice"):
        pool = state.clone()
        out = torch.full((1, T, HV, V), POISON)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out,
                   ChunkConfig(chunk=chunk, block_v=16, dot_precision="ieee", split_prep=True, split_rest=True,
                               qk_from_input=from_input, products=products, slice_k=16))
        got.append((out, pool))
    n = T - 2
    assert torch.isfinite(got[0][0][:, :n]).all() and (got[1][0][:, n:] == POISON).all()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, chunk_size=chunk)
    assert_close(got[1][0][:, :n], ref_out[:, :n], 1e-4, "by_slice outputs")
    for s in (4, 1, 0):
        assert_close(got[1][1][s], ref_pool[s], 1e-4, f"by_slice slot {s}")


STEEP_CASES = [  # (chunk, qk from the inputs, activations: bf16 with the picked forms and bf16 P)
    pytest.param(64, True, torch.bfloat16, id="chunk64-qk-from-input-bf16-picked-forms"),
    pytest.param(32, False, torch.float32, id="chunk32-workspace-qk-f32"),
    pytest.param(16, True, torch.float32, id="chunk16-qk-from-input-f32"),
]


@pytest.mark.exhaustive
@pytest.mark.parametrize("chunk,from_input,act", STEEP_CASES)
def test_steep_pairs_by_slice_equal_by_column_bitwise(chunk, from_input, act):
    """``ChunkConfig.steep_pairs="by_slice"``: a steep sub-block's exact pairs with the K slices
    outermost give the column-at-a-time bits (each column's sum built in the same order): steep
    sub-blocks at the chunk's start, middle and end (one covering no rows below it), a steep
    block cut by a sequence's end, GVA, K off its tile; against float64 too."""
    H, HV, K, V = 1, 2, 40, 32 if act == torch.bfloat16 else 16  # bf16 chain products need 32-row tiles
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [2 * chunk + 5, 1, chunk - 3], seed=31, act=act,
                                                extra_tokens=2)
    x["g"][0, 0:9, :, : K // 4] = 30.0  # steep sub-blocks under the default gate
    x["g"][0, chunk - 12: chunk + 20, :, K // 2:] = 30.0
    x["g"][0, 2 * chunk: 2 * chunk + 5, 1, :] = 30.0
    idx = torch.tensor([4, 1, 0], dtype=torch.int32)
    bf16 = act == torch.bfloat16
    got = []
    for steep in ("by_column", "by_slice"):
        pool = state.clone()
        out = torch.full((1, T, HV, V), POISON).to(act)
        extra = dict(factor_dtype="bfloat16", chain_dot_dtype="bfloat16", qk_pairs_dtype="bfloat16",
                     block_v=32, inverse="doubling", diagonal_programs=True, products="block_programs",
                     factor_programs=True) if bf16 else dict(block_v=16, slice_k=16)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out,
                   ChunkConfig(chunk=chunk, dot_precision="ieee", split_prep=True, split_rest=True,
                               qk_from_input=from_input, steep_pairs=steep, **extra))
        got.append((out, pool))
    n = T - 2
    poison = torch.tensor(POISON).to(act)
    assert torch.isfinite(got[0][0][:, :n].float()).all() and (got[1][0][:, n:] == poison).all()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, chunk_size=chunk)
    tol = 2e-2 if bf16 else 1e-4
    assert_close(got[1][0][:, :n], ref_out[:, :n], tol, "by_slice outputs")
    for s in (4, 1, 0):
        assert_close(got[1][1][s], ref_pool[s], tol, f"by_slice slot {s}")
    with pytest.raises(ValueError, match="steep_pairs must be one of"):
        ChunkConfig(steep_pairs="by_row")


@pytest.mark.parametrize("from_input", sweep([False, True]), ids=["workspace-qk", "qk-from-input"])
@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_bf16_factors_against_float64(from_input, gate):
    """``ChunkConfig.factor_dtype="bfloat16"``: the chain's factors stored in bf16 (one
    rounding each, math in float32), and with ``chain_dot_dtype="bfloat16"`` the chain's
    products on bf16 operands too, stay within bf16-level error of float64; the pool's other
    slots and the rows outside cu_seqlens are untouched."""
    H, HV, K, V = 1, 2, 32, 32
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [40, 1, 25], seed=10, extra_tokens=2)
    lb = -5.0 if gate == "safe" else None
    idx = torch.tensor([4, 1, 3], dtype=torch.int32)
    before = state.clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=lb)
    errs = []
    for dtype, dots in (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")):
        pool = before.clone()
        out = torch.full((1, T, HV, V), POISON)
        cfg = ChunkConfig(chunk=32, block_v=32, dot_precision="ieee", split_prep=True, qk_from_input=from_input,
                          factor_dtype=dtype, chain_dot_dtype=dots)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out, cfg, lower_bound=lb)
        assert (out[:, 66:] == POISON).all(), "rows outside cu_seqlens must not be written"
        check_pool(pool, before, ref_pool, [4, 1, 3], 3e-2 if dtype == "bfloat16" else 1e-5, dtype)
        errs.append(rel_err(out[:, :66], ref_out[:, :66]))
    ERRORS[f"bf16 factors {gate}{' qk from input' if from_input else ''}"] = errs[1]
    ERRORS[f"bf16 factors and chain products {gate}{' qk from input' if from_input else ''}"] = errs[2]
    assert errs[0] < 1e-5, errs
    assert 1e-5 < errs[1] < 2e-2 and 1e-5 < errs[2] < 2e-2, errs  # a bf16 rounding shows, and stays at its level
    assert errs[2] != errs[1], "the bf16 chain products must change the results"


def long_memory_case(H, HV, K, V, seqlens, *, seed, slots=6):
    """bf16 inputs with Kimi Linear's gate initialisation (``A_log = log U(1, 16)``, ``dt_bias`` the
    inverse softplus of ``U(0.001, 0.1)``, raw gate ``0.5 N(0, 1)``): log-decays of about -0.002
    to -0.5 a token, so the state carries across many chunks and the chain's roundings add up
    (the default inputs forget within a few tokens, which hides them)."""
    x, _, _, cu, state, T = make_case(H, HV, K, V, seqlens, seed=seed, act=torch.bfloat16, slots=slots)
    gen = torch.Generator().manual_seed(seed + 1)
    A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen))
    dt = 0.001 + 0.099 * torch.rand(HV * K, generator=gen)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
    x["g"] = (0.5 * torch.randn(1, T, HV, K, generator=gen)).to(torch.bfloat16)
    return x, A_log, dt_bias, cu, state, T


@pytest.mark.parametrize("gate", sweep(["softplus", "safe"]))
def test_float32_update_factors_keep_a_long_memory_state_at_float32(gate):
    """``ChunkConfig.update_factor_dtype="float32"`` with bf16 activations: w, u and
    k̂ ⊙ e^(Γ_C - Γ) stored in float32 (q̂ ⊙ e^Γ in bf16) keep the final state at float32 accuracy
    over a long-memory sequence of many chunks, where bf16 update factors lose about 1e-3 or
    more; the outputs get closer too."""
    H, HV, K, V = 1, 2, 32, 32
    x, A_log, dt_bias, cu, state, T = long_memory_case(H, HV, K, V, [200, 40], seed=21)
    lb = -5.0 if gate == "safe" else None
    idx = torch.tensor([4, 1], dtype=torch.int32)
    before = state.clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=lb, chunk_size=32)
    got = {}
    for update in ("bfloat16", "float32"):
        pool = before.clone()
        out = torch.full((1, T, HV, V), POISON).to(torch.bfloat16)
        cfg = ChunkConfig(chunk=32, block_v=16, split_prep=True, split_rest=True, qk_from_input=True,
                          factor_dtype="bfloat16", update_factor_dtype=update)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out, cfg, lower_bound=lb)
        got[update] = (rel_err(out, ref_out), max(rel_err(pool[s], ref_pool[s]) for s in (4, 1)))
        check_pool(pool, before, ref_pool, [4, 1], 2e-2, f"{update} update factors")
    for update, (out_err, state_err) in got.items():
        ERRORS[f"long memory, {update} update factors {gate}: outputs"] = out_err
        ERRORS[f"long memory, {update} update factors {gate}: state"] = state_err
    assert got["float32"][1] < 1e-5 < 1e-3 < got["bfloat16"][1], got
    assert got["float32"][0] < got["bfloat16"][0] < 2e-2, got


def test_chain_dot_split_is_gone():
    """``chain_dot_split`` (bf16 chain products on hi + lo bf16 parts of each float32 operand) was
    removed: at engine size on an H100 it died with an illegal memory access, and the picked form
    is already closer to float64 than fla's and sglang's chunk_kda. A config naming it is refused."""
    with pytest.raises(TypeError):
        ChunkConfig(chain_dot_split=True)


@pytest.mark.exhaustive
@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_chain_pieces_with_bf16_chain_products_against_float64(gate):
    """The picked form for one long sequence with few heads: the chain in pieces on 32-row V
    tiles with bf16 chain products (the transitions' ``[V + K]`` rows through the same bf16
    products). Within bf16-level error of float64 and about as close as the whole chain with
    the same products; padding and the pool's other slots untouched."""
    H, HV, K, V = 1, 2, 32, 32
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [100, 1, 45], seed=12, extra_tokens=2)
    lb = -5.0 if gate == "safe" else None
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    before = state.clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=lb, chunk_size=16)
    errs = []
    for pieces, dots in ((1, "bfloat16"), (3, "bfloat16"), (3, "float32")):
        pool = before.clone()
        out = torch.full((1, T, HV, V), POISON)
        cfg = ChunkConfig(chunk=16, block_v=32, dot_precision="ieee", split_prep=True, split_rest=True,
                          qk_from_input=True, factor_dtype="bfloat16", chain_dot_dtype=dots,
                          qk_pairs_dtype=dots, chain_pieces=pieces)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out, cfg, lower_bound=lb)
        assert (out[:, 146:] == POISON).all(), "rows outside cu_seqlens must not be written"
        assert (out[0, 100] == 0).all(), "a padding sequence's outputs are zero"
        check_pool(pool, before, ref_pool, [4, 1], 3e-2, f"{pieces} pieces, {dots} products")
        errs.append(rel_err(out[:, :146], ref_out[:, :146]))
    ERRORS[f"bf16 chain products in 3 pieces {gate}"] = errs[1]
    assert 1e-5 < errs[1] < 2e-2 and errs[1] < 1.5 * errs[0], errs
    assert errs[1] != errs[2], "the pieces must take the bf16 chain products"


def test_bf16_chain_products_refuse_16_row_tiles_and_configs_check_their_strings():
    x, A_log, dt_bias, cu, state, T = make_case(1, 2, 32, 16, [20], seed=11)
    before = state.clone()
    out = torch.full((1, T, 2, 16), POISON)
    with pytest.raises(ValueError, match="needs V tiles of at least 32 rows"):  # V = 16: a 16-row tile
        run_triton(x, A_log, dt_bias, cu, state, torch.tensor([1], dtype=torch.int32), out,
                   ChunkConfig(chunk=32, block_v=32, factor_dtype="bfloat16", chain_dot_dtype="bfloat16"))
    assert torch.equal(state, before) and (out == POISON).all()
    for field, bad in (("factor_dtype", "bf16"), ("chain_dot_dtype", "bf16"), ("dot_precision", "fp32"),
                       ("inverse", "newton"), ("products", "by_row"), ("outputs", "after")):
        with pytest.raises(ValueError, match=f"ChunkConfig.{field} must be one of"):
            ChunkConfig(**{field: bad})


def test_picked_config_follows_the_activations():
    """bf16 activations: bf16 factors, and bf16 chain products only from 32-row V tiles (16-row
    tiles keep float32 ones); float32 activations: float32 factors and products."""
    from kdakit.ops.chunk_prefill import chunk_config
    many = chunk_config(8, 32, 128, 128, act_dtype=torch.bfloat16)
    one = chunk_config(1, 32, 128, 128, act_dtype=torch.bfloat16)
    few_heads = chunk_config(1, 8, 128, 128, act_dtype=torch.bfloat16)
    f32 = chunk_config(8, 32, 128, 128, act_dtype=torch.float32)
    assert (many.block_v, many.factor_dtype, many.chain_dot_dtype) == (64, "bfloat16", "bfloat16")
    assert (one.block_v, one.chain_dot_dtype, one.pipeline_stages) == (32, "bfloat16", 2)
    assert (few_heads.block_v, few_heads.factor_dtype, few_heads.chain_dot_dtype) == (16, "bfloat16", "float32")
    # about one 64-row program an SM (8 sequences at H = 8): the 64-row tile; 32 sequences at
    # H = 1 are 64 such programs and keep the 32-row tile
    assert chunk_config(8, 8, 128, 128, act_dtype=torch.bfloat16).block_v == 64
    assert chunk_config(32, 1, 128, 128, act_dtype=torch.bfloat16).block_v == 32
    assert chunk_config(8, 8, 128, 128, act_dtype=torch.float32).block_v == 16  # float32 products
    assert (f32.factor_dtype, f32.chain_dot_dtype) == ("float32", "float32")
    # float32 inputs: float32-level products (three TF32 passes); bf16 / fp16 inputs: one pass
    assert f32.dot_precision == "tf32x3"
    assert chunk_config(1, 8, 128, 128, act_dtype=torch.float32, T=8192).dot_precision == "tf32x3"
    assert all(c.dot_precision == "tf32" for c in (many, one, few_heads))
    assert chunk_config(8, 32, 128, 128, act_dtype=torch.float16).dot_precision == "tf32"
    assert all(c.qk_from_input and c.split_prep and c.split_rest for c in (many, one, few_heads, f32))
    assert all(c.inverse == "doubling" and c.diagonal_programs for c in (many, one, few_heads, f32))
    assert all(c.products == "block_programs" and c.factor_programs and c.outputs == "in_chain"
               for c in (many, one, few_heads, f32))
    # outputs after the chain: few chain programs (<= 64), each at least 4096 tokens long
    long_few = chunk_config(1, 8, 128, 128, act_dtype=torch.bfloat16, T=8191)
    assert (long_few.outputs, long_few.block_v) == ("after_chain", 16)
    assert chunk_config(1, 8, 128, 128, act_dtype=torch.bfloat16, T=4095).outputs == "in_chain"
    assert chunk_config(1, 32, 128, 128, act_dtype=torch.bfloat16, T=8192).outputs == "in_chain"  # 128 chains
    assert chunk_config(2, 4, 128, 128, act_dtype=torch.bfloat16, T=8192).outputs == "after_chain"
    assert long_few.chain_pieces == 1 and chunk_config(1, 32, 128, 128, act_dtype=torch.bfloat16).chain_pieces == 1
    # from 8192 tokens a sequence those few chains are cut into 4 pieces (outputs in the chain)
    # (on 32-row V tiles with bf16 chain products: the pieces' programs fill the GPU)
    for N, HV, T in ((1, 8, 32768), (1, 8, 8192), (2, 4, 16384)):
        cut = chunk_config(N, HV, 128, 128, act_dtype=torch.bfloat16, T=T)
        assert (cut.chain_pieces, cut.outputs, cut.block_v, cut.chain_dot_dtype) == (4, "in_chain", 32, "bfloat16")
    cut = chunk_config(1, 8, 128, 128, act_dtype=torch.float32, T=8192)
    assert (cut.chain_pieces, cut.block_v, cut.chain_dot_dtype) == (4, 16, "float32")
    assert chunk_config(1, 8, 128, 128, act_dtype=torch.bfloat16, T=8191).chain_pieces == 1
    assert chunk_config(1, 32, 128, 128, act_dtype=torch.bfloat16, T=32768).chain_pieces == 1  # 128 chains
    # head dims above 128: no pieces (the start-state walk's [K, K] map would not fit)
    for K, V in ((256, 128), (128, 256), (256, 256)):
        assert chunk_config(1, 8, K, V, act_dtype=torch.bfloat16, T=32768).chain_pieces == 1, (K, V)
    assert chunk_config(1, 8, 256, 128, act_dtype=torch.bfloat16, T=32768).outputs == "after_chain"  # 64 chains


def test_zz_print_errors():
    for name, err in ERRORS.items():
        print(f"{name}: rel err {err:.2e}")


@pytest.mark.parametrize("chunk", [32, 64], ids=["chunk32-one-level", "chunk64-two-levels"])
@pytest.mark.parametrize("gate", sweep(["softplus", "safe"]))
def test_inverse_by_doubling_against_float64(chunk, gate, monkeypatch):
    """``ChunkConfig.inverse="doubling"``: the inverse below the diagonal blocks by doubling
    (16 -> 32 -> 64) gives the float64 results, and those of the block-row substitution up to
    float32 rounding; sequences that end inside a chunk, the pool's other slots untouched."""
    from kdakit.ops.chunk_prefill import run as module
    prep, flags = module._chunk_prep, []

    def noting_prep(grid, args, constexprs, **kw):
        flags.append(constexprs["INVERSE_BY_DOUBLING"])
        return prep(grid, args, constexprs, **kw)
    monkeypatch.setattr(module, "_chunk_prep", noting_prep)
    H, HV, K, V = 1, 2, 16, 16
    lower_bound = None if gate == "softplus" else -3.0
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [150, 37, 1], seed=31)
    idx = torch.tensor([4, 1, 2], dtype=torch.int32)
    before = state.clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=lower_bound)
    got = {}
    for inverse in ("substitution", "doubling"):
        pool, out = state.clone(), torch.full((1, T, HV, V), POISON)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out,
                   ChunkConfig(chunk=chunk, block_v=16, dot_precision="ieee", inverse=inverse),
                   lower_bound=lower_bound)
        got[inverse] = (out, pool)
    assert flags == [False, True], flags  # one launch each (the prep unsplit), the flag as configured
    out, pool = got["doubling"]
    assert_close(out, ref_out, 1e-5, "out")
    for s in idx.tolist():
        assert_close(pool[s], ref_pool[s], 1e-5, f"slot {s}")
    assert_close(out, got["substitution"][0], 1e-6, "out vs substitution")
    untouched = [s for s in range(state.shape[0]) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("chunk,gate,from_input", sweep([(64, "softplus-steep", True), (64, "safe", False),
                                                   (32, "softplus-steep", False), (16, "log-decay", True)], keep=2),
                         ids=["chunk64-softplus-steep-qk-from-input", "chunk64-safe-workspace-qk",
                              "chunk32-softplus-steep-workspace-qk", "chunk16-log-decay-qk-from-input"])
def test_diagonal_programs_against_float64(chunk, gate, from_input, monkeypatch):
    """``ChunkConfig.diagonal_programs`` (chunk_prefill/inverse.py: the inverse's 16 x 16 diagonal
    blocks as one-warp programs of their own, the prep's inverse launch told they are done),
    with either inverse below them: the float64 results, and those of the diagonal inverted in
    the prep up to float32 rounding, with steep and mild sub-blocks side by side (a steep one
    in a chunk's last, partial sub-block too), GVA, K below its power-of-two tile; the
    launches are the ones configured and the pool's other slots untouched."""
    from kdakit.ops.chunk_prefill import run as module
    launched = []
    prep, diagonal = module._chunk_prep, module.diagonal_inverse

    def noting_prep(grid, args, constexprs, **kw):
        launched.append((constexprs["PHASES"], constexprs["DIAGONAL_INVERTED"]))
        return prep(grid, args, constexprs, **kw)

    def noting_diagonal(grid, args, constexprs, **kw):
        launched.append(("diagonal", grid[2]))
        return diagonal(grid, args, constexprs, **kw)
    monkeypatch.setattr(module, "_chunk_prep", noting_prep)
    monkeypatch.setattr(module, "diagonal_inverse", noting_diagonal)
    H, HV, K, V = 1, 2, 24, 16
    x, A_log, dt_bias, cu, state, T = make_case(H, HV, K, V, [70, 1, 23], seed=41, raw_gate=gate != "log-decay",
                                                extra_tokens=2)
    lb = -5.0 if gate == "safe" else None
    if gate == "softplus-steep":  # softplus(x) ~ x: about -20 a token in a quarter of the channels
        x["g"][0, 10:40, :, : K // 4] = 20.0
        x["g"][0, 64:70, :, : K // 4] = 20.0  # sequence 0's last chunk of 64 holds 6 tokens
    idx = torch.tensor([3, 0, 5], dtype=torch.int32)
    before = state.clone()
    ref_out, ref_pool, _ = ref64(x, A_log, dt_bias, cu, state, idx, lower_bound=lb)
    got = {}
    for inverse, diagonal_programs in (("substitution", False), ("substitution", True), ("doubling", True)):
        pool, out = state.clone(), torch.full((1, T, HV, V), POISON)
        run_triton(x, A_log, dt_bias, cu, pool, idx, out,
                   ChunkConfig(chunk=chunk, block_v=16, dot_precision="ieee", split_prep=True, split_rest=True,
                               qk_from_input=from_input, inverse=inverse, diagonal_programs=diagonal_programs),
                   lower_bound=lb)
        got[inverse, diagonal_programs] = (out, pool)
    in_prep = [(1, False), (2, False), (4, False), (8, False), (16, False)]
    own_programs = [(1, True), (2, True), (4, True), ("diagonal", chunk // 16), (8, True), (16, True)]
    assert launched == in_prep + own_programs * 2, launched
    first = got["substitution", False][0]
    assert torch.isfinite(first[:, :94]).all()
    for key, (out, pool) in got.items():
        ERRORS[f"diagonal programs {key} {gate} C{chunk}{' qk from input' if from_input else ''}"] = rel_err(
            out[:, :94], ref_out[:, :94])
        assert_close(out[:, :94], ref_out[:, :94], 1e-5, f"{key} out")
        assert (out[:, 94:] == POISON).all(), "rows outside cu_seqlens must not be written"
        check_pool(pool, before, ref_pool, [3, 0, 5], 1e-5, f"{key} pool")
        assert_close(out, first, 1e-6, f"{key} vs the diagonal inverted in the prep")
