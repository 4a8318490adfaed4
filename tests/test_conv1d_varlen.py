"""causal_conv1d_varlen: both backends against the reference run in float64, and against a chain of
one-token causal_conv1d_update calls; unequal sequences (length 1, shorter than W-1, across token
tiles), initial-state mixes, padding and out-of-range slots, transposed x and pools; poisoned
outputs and unused slots; validation errors leave every buffer untouched."""
import pytest
import torch

import kdakit
from kdakit import reference
from kdakit.ops.conv1d_varlen import Conv1dVarlenConfig, causal_conv1d_varlen, causal_conv1d_varlen_triton

from helpers import POISON, assert_close, setter, sweep

BACKENDS = ["reference", "triton"]
F32, BF16 = torch.float32, torch.bfloat16
SMALL_TILES = Conv1dVarlenConfig(block_t=8, block_c=16, num_warps=1)  # several token tiles and channel blocks at test sizes

# Lengths with a 1, some shorter than W-1, none a multiple of the tiles; T = 35. With 8-token
# tiles the 9-token sequence starts on the first tile's last token: its next W-2 tokens spill.
MIXED = [5, 1, 1, 9, 3, 12, 4]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def make_case(lengths, C, W, *, act_dtype=F32, pool_dtype=None, x_layout="rows", pool_layout="contiguous",
              bias=True, init="mixed", padding=(1,), out_of_range=(), extra_slots=3, seed=0):
    """Tensors of one call. ``padding``/``out_of_range``: sequences whose slot is -1 / past the pool."""
    gen = torch.Generator().manual_seed(seed)
    pool_dtype = pool_dtype or act_dtype
    N, T = len(lengths), sum(lengths)
    slots = N + extra_slots
    if x_layout == "transposed":  # the [C, T] buffer engines hold, passed as its [T, C] view
        x = torch.randn(C, T, generator=gen).to(act_dtype).t()
    else:
        x = torch.randn(T, C, generator=gen).to(act_dtype)
    if pool_layout == "transposed":  # sglang's [slots, W-1, C], passed as a [slots, C, W-1] view
        conv = torch.randn(slots, W - 1, C, generator=gen).to(pool_dtype).transpose(1, 2)
    else:
        conv = torch.randn(slots, C, W - 1, generator=gen).to(pool_dtype)
    idx = torch.randperm(slots, generator=gen)[:N].to(torch.int32)
    for n in padding:
        idx[n] = -1
    for n in out_of_range:
        idx[n] = slots + 2 + n
    for s in unused_slots(slots, idx):
        conv[s] = float("nan")
    if init == "mixed":
        has_init = torch.rand(N, generator=gen) < 0.5
        has_init[0], has_init[-1] = True, False
    elif init == "all":
        has_init = torch.ones(N, dtype=torch.bool)
    elif init == "none":
        has_init = torch.zeros(N, dtype=torch.bool)
    else:
        has_init = None
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32 if seed % 2 else torch.int64)
    return {
        "x": x, "conv_state": conv, "weight": torch.randn(C, W, generator=gen) * 0.5, "cu_seqlens": cu,
        "slot_indices": idx, "has_initial_state": has_init,
        "bias": torch.randn(C, generator=gen) * 0.1 if bias else None,
    }


def unused_slots(num_slots, idx):
    used = set(int(s) for s in idx if 0 <= int(s) < num_slots)
    return [s for s in range(num_slots) if s not in used]


def f64_reference(t, activation=True):
    """The reference run in float64 on copies: (out, pool)."""
    ref_conv = t["conv_state"].double()
    ref_out = torch.empty(t["x"].shape, dtype=torch.float64)
    reference.causal_conv1d_varlen(t["x"].double(), ref_conv, t["weight"].double(), t["cu_seqlens"], t["slot_indices"],
                                   ref_out, has_initial_state=t["has_initial_state"],
                                   bias=None if t["bias"] is None else t["bias"].double(), activation=activation,
                                   compute_dtype=torch.float64)
    return ref_out, ref_conv


def run(t, backend, config=None, activation="silu", out=None):
    if config is None:
        return causal_conv1d_varlen(t["x"], t["conv_state"], t["weight"], t["cu_seqlens"], t["slot_indices"],
                                    has_initial_state=t["has_initial_state"], bias=t["bias"], activation=activation,
                                    out=out, backend=backend)
    assert backend == "triton"
    causal_conv1d_varlen_triton(t["x"], t["conv_state"], t["weight"], t["cu_seqlens"], t["slot_indices"], out,
                                has_initial_state=t["has_initial_state"], bias=t["bias"],
                                activation=activation is not None, config=config)
    return out


def check_case(backend, t, config=None, activation="silu"):
    x, conv, idx = t["x"], t["conv_state"], t["slot_indices"]
    before = conv.clone()
    ref_out, ref_conv = f64_reference(t, activation=activation is not None)
    out = torch.full(x.shape, POISON).to(x.dtype)
    assert run(t, backend, config, activation, out=out) is out
    tol = 1e-6 if x.dtype == F32 else 1e-2
    assert_close(out, ref_out, tol, "out")  # every token, padding sequences included (they start from zeros)
    live = [int(s) for s in idx if 0 <= int(s) < conv.shape[0]]
    if live:
        if conv.dtype == x.dtype or conv.dtype == F32:  # windows hold raw inputs: bitwise
            assert torch.equal(conv[live], ref_conv[live].to(conv.dtype)), "windows"
        else:  # the interpreter casts float32 -> bf16 by truncation
            assert_close(conv[live], ref_conv[live], 1e-2, "windows")
    for s in unused_slots(conv.shape[0], idx):
        assert torch.equal(bits(conv[s]), bits(before[s])), f"slot {s} must stay bitwise"
    return out


# ----------------------------------------------------------------------------
# Against the float64 reference
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W", sweep([2, 3, 4], keep=[0, 2]), ids=lambda w: f"W{w}")
@pytest.mark.parametrize("act_dtype", sweep([F32, BF16]), ids=["f32", "bf16"])
def test_mixed_lengths_against_float64(backend, W, act_dtype):
    t = make_case(MIXED, 32, W, act_dtype=act_dtype, padding=(1,), out_of_range=(4,), bias=W != 3, seed=W)
    check_case(backend, t, config=SMALL_TILES if backend == "triton" else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x_layout", ["rows", "transposed"], ids=["x-TC", "x-CT-view"])
@pytest.mark.parametrize("pool_layout", ["contiguous", "transposed"], ids=["pool-CW", "pool-WC-view"])
def test_layouts(backend, x_layout, pool_layout):
    t = make_case(MIXED, 24, 4, act_dtype=BF16, x_layout=x_layout, pool_layout=pool_layout, seed=3)
    check_case(backend, t, config=SMALL_TILES if backend == "triton" else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("init", ["flags-none-given", "all", "none", "mixed"])
@pytest.mark.parametrize("bias", sweep([True, False]), ids=["bias", "no-bias"])
def test_initial_states_and_bias(backend, init, bias):
    t = make_case([2, 7, 1, 3, 6], 16, 4, init=None if init == "flags-none-given" else init, bias=bias,
                  padding=(2,), seed=11)
    check_case(backend, t, config=SMALL_TILES if backend == "triton" else None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_launch_config(backend):
    check_case(backend, make_case(MIXED, 40, 4, act_dtype=BF16, x_layout="transposed", seed=5))
    check_case(backend, make_case(MIXED, 40, 4, seed=6))


@pytest.mark.parametrize("lengths,config", [
    ([3, 1, 1, 2, 7, 4, 1, 5, 2, 1, 3], Conv1dVarlenConfig(4, 16, 1)),  # tiles of W-1+1 tokens: starts on every tile edge
    ([1] * 12, Conv1dVarlenConfig(4, 16, 1)),                           # one token per sequence (a decode-like batch)
    ([7, 5, 6, 1, 3, 10], Conv1dVarlenConfig(8, 32, 2)),                # first tokens just before a tile's end: spill
    ([0, 4, 0, 0, 9, 0], Conv1dVarlenConfig(4, 16, 1)),                 # empty sequences (nothing written for them)
], ids=["tile-edges", "all-length-1", "spill", "empty-sequences"])
@pytest.mark.parametrize("W", sweep([3, 4]), ids=lambda w: f"W{w}")
def test_tile_boundaries(lengths, config, W):
    t = make_case(lengths, 20, W, padding=(), seed=len(lengths) + W)
    check_case("triton", t, config=config)
    check_case("reference", make_case(lengths, 20, W, padding=(), seed=len(lengths) + W))


# Tiles of vectors of 1, 2, 4 and 8 tokens (taps from one to seven vectors back), one or several
# vectors a tile, programs in token or channel order.
TILE_SHAPES = [Conv1dVarlenConfig(1, 16, 1), Conv1dVarlenConfig(2, 16, 1, token_major=True),
               Conv1dVarlenConfig(4, 8, 1), Conv1dVarlenConfig(16, 16, 2, token_major=True),
               Conv1dVarlenConfig(32, 16, 1)]


@pytest.mark.parametrize("W", sweep([4, 8]), ids=lambda w: f"W{w}")
@pytest.mark.parametrize("x_layout", sweep(["rows", "transposed"]), ids=["x-TC", "x-CT-view"])
def test_tile_shapes_agree_bitwise(W, x_layout):
    """Every tile shape gives the float64 reference's numbers and the same bits as every other:
    sequences of length 0, shorter than W-1, starting in every position of a vector and running
    across tiles, a run of one-token sequences (a tile full of starts)."""
    lengths = [5, 1, 0, 2, 9, 1, 1, 1, 3, 0, 6]
    first = None
    for config in TILE_SHAPES:
        t = make_case(lengths, 16, W, act_dtype=BF16, x_layout=x_layout, pool_layout="transposed", padding=(2, 6),
                      out_of_range=(8,), seed=60 + W)
        got = (check_case("triton", t, config=config), t["conv_state"])
        first = first or got
        assert torch.equal(bits(got[0]), bits(first[0])) and torch.equal(bits(got[1]), bits(first[1])), config


def test_tile_sizes_must_be_powers_of_two():
    t = make_case([4, 5], 16, 4, seed=61)
    for config in (Conv1dVarlenConfig(6, 16, 1), Conv1dVarlenConfig(8, 24, 1)):
        with pytest.raises(ValueError, match="powers of two"):
            run(t, "triton", config=config, out=torch.empty_like(t["x"]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_off(backend):
    check_case(backend, make_case(MIXED, 16, 4, seed=12), activation=None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_and_out_of_range_slots(backend):
    """Slot -1 and a slot past the pool: the sequence starts from zeros and no pool byte moves."""
    t = make_case([4, 2, 5], 16, 4, init="all", padding=(0,), out_of_range=(2,), extra_slots=1, seed=13)
    pool_before = t["conv_state"].clone()
    out = check_case(backend, t)
    zero_start = dict(t, conv_state=torch.zeros(1, 16, 3), slot_indices=torch.tensor([0, -1, 0], dtype=torch.int32),
                      has_initial_state=torch.tensor([False, False, False]))
    expected = run(zero_start, backend, out=torch.empty_like(t["x"]))
    assert torch.equal(out[:4], expected[:4]) and torch.equal(out[6:], expected[6:])
    live = int(t["slot_indices"][1])
    for s in range(t["conv_state"].shape[0]):
        if s != live:
            assert torch.equal(bits(t["conv_state"][s]), bits(pool_before[s]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_single_sequence_and_no_tokens(backend):
    check_case(backend, make_case([5, 3], 16, 4, padding=(0, 1), seed=14))
    check_case(backend, make_case([13], 16, 4, padding=(), seed=15))
    t = make_case([0, 0], 16, 4, padding=(), seed=16)
    before = t["conv_state"].clone()
    out = run(t, backend)
    assert out.shape == (0, 16) and torch.equal(bits(t["conv_state"]), bits(before))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_allocated_like_x(backend):
    t = make_case(MIXED, 16, 4, act_dtype=BF16, x_layout="transposed", seed=17)
    out = run(t, backend)
    assert out.dtype == BF16 and out.stride() == t["x"].stride()
    assert kdakit.causal_conv1d_varlen is causal_conv1d_varlen


# ----------------------------------------------------------------------------
# An independent oracle: one-token updates chained over each sequence
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W", sweep([2, 3, 4], keep=[2]), ids=lambda w: f"W{w}")
@pytest.mark.parametrize("act_dtype", sweep([F32, BF16]), ids=["f32", "bf16"])
def test_equals_chained_one_token_updates(backend, W, act_dtype):
    t = make_case(MIXED, 24, W, act_dtype=act_dtype, pool_layout="transposed", padding=(2,), seed=20 + W)
    x, conv, idx, init = t["x"], t["conv_state"], t["slot_indices"], t["has_initial_state"]
    C, slots = x.shape[1], conv.shape[0]
    # The chain runs on its own pool plus one scratch slot (index `slots`) for padding sequences;
    # a sequence without an initial state starts from a zeroed window.
    chain_pool = torch.cat([conv.clone(), torch.zeros(1, C, W - 1, dtype=conv.dtype)])
    chain_out = torch.empty_like(x)
    bounds = t["cu_seqlens"].tolist()
    for n in range(len(idx)):
        slot = int(idx[n]) if int(idx[n]) >= 0 else slots
        if slot == slots or not bool(init[n]):
            chain_pool[slot] = 0
        for tok in range(bounds[n], bounds[n + 1]):
            kdakit.causal_conv1d_update(x[tok:tok + 1], chain_pool, t["weight"],
                                        torch.tensor([slot], dtype=torch.int32), bias=t["bias"],
                                        out=chain_out[tok:tok + 1], backend=backend)
    out = run(t, backend, config=SMALL_TILES if backend == "triton" else None, out=torch.full_like(x, POISON))
    assert torch.equal(out, chain_out), "outputs must equal the one-token chain bitwise"
    live = [int(s) for s in idx if int(s) >= 0]
    assert torch.equal(conv[live], chain_pool[live]), "final windows must equal the chain's bitwise"


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------
T_, C_, W_ = 9, 24, 4


def valid_call():
    t = make_case([4, 1, 4], C_, W_, extra_slots=2, padding=(), seed=30)
    t["out"] = torch.full((T_, C_), POISON)
    return t


BREAKERS = [
    ("x-1d", setter("x", lambda x: x.flatten()), ["`x`", "2D", "ndim=1"]),
    ("x-float64", setter("x", lambda x: x.double()), ["`x`", "torch.float64"]),
    ("weight-channels", setter("weight", lambda w: torch.randn(C_ + 1, W_)), ["`weight`", f"C={C_}"]),
    ("weight-W1", setter("weight", lambda w: torch.randn(C_, 1)), ["`weight`", "W=1"]),
    ("weight-bf16", setter("weight", lambda w: w.bfloat16()), ["`weight`", "float32"]),
    ("bias-shape", setter("bias", lambda b: torch.zeros(C_ + 1)), ["`bias`", f"({C_},)"]),
    ("conv_state-2d", setter("conv_state", lambda c: c[0]), ["`conv_state`", "3D"]),
    ("conv_state-taps", setter("conv_state", lambda c: torch.zeros(5, C_, W_)), ["`conv_state`", f"W-1={W_ - 1}"]),
    ("conv_state-overlap", setter("conv_state", lambda c: c[:1].expand(5, C_, W_ - 1)),
     ["`conv_state`", "overlapping"]),
    ("cu_seqlens-2d", setter("cu_seqlens", lambda c: c[None]), ["`cu_seqlens`", "1D", "(1, 4)"]),
    ("cu_seqlens-float", setter("cu_seqlens", lambda c: c.float()), ["`cu_seqlens`", "torch.float32"]),
    ("cu_seqlens-one-offset", setter("cu_seqlens", lambda c: c[:1]), ["`cu_seqlens`", "at least 2", "T=9"]),
    ("slots-len", setter("slot_indices", lambda i: i[:2]), ["`slot_indices`", "(3,)", "(2,)"]),
    ("slots-2d", setter("slot_indices", lambda i: i[:, None]), ["`slot_indices`", "[N]"]),
    ("slots-int16", setter("slot_indices", lambda i: i.to(torch.int16)), ["`slot_indices`", "torch.int16"]),
    ("init-len", setter("has_initial_state", lambda h: h[:2]), ["`has_initial_state`", "(3,)", "(2,)"]),
    ("init-int", setter("has_initial_state", lambda h: h.int()), ["`has_initial_state`", "bool", "torch.int32"]),
    ("out-shape", setter("out", lambda o: torch.full((T_, C_ + 1), POISON)), ["`out`", f"({T_}, {C_})"]),
    ("out-dtype", setter("out", lambda o: o.bfloat16()), ["`out`", "torch.bfloat16", "x's dtype"]),
    ("out-overlap", setter("out", lambda o: o[:1].expand(T_, C_)), ["`out`", "overlapping"]),
    ("out-is-x", lambda t: t.update(out=t["x"]), ["`out`", "shares memory with `x`"]),
    ("activation", lambda t: t.update(activation="gelu"), ["`activation`", "'gelu'"]),
    ("other-device", setter("out", lambda o: torch.empty(o.shape, device="meta")), ["same device"]),
]


def call(t, **kw):
    return causal_conv1d_varlen(t["x"], t["conv_state"], t["weight"], t["cu_seqlens"], t["slot_indices"],
                                has_initial_state=t["has_initial_state"], bias=t["bias"], out=t["out"],
                                activation=t.get("activation", "silu"), **kw)


def snapshot(t):
    return {n: bits(v).clone() for n, v in t.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}


def assert_untouched(t, snap):
    for n, before in snap.items():
        assert torch.equal(bits(t[n]), before), f"`{n}` changed although the call raised"


@pytest.mark.parametrize("breaker,parts", [pytest.param(b, p, id=i) for i, b, p in BREAKERS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_errors_leave_buffers_untouched(breaker, parts, backend):
    t = valid_call()
    breaker(t)
    snap = snapshot(t)
    with pytest.raises(ValueError) as excinfo:
        call(t, backend=backend)
    for part in parts:
        assert part in str(excinfo.value), f"{part!r} not in {str(excinfo.value)!r}"
    assert_untouched(t, snap)


@pytest.mark.parametrize("case,parts", [
    ("cu-not-from-0", ["`cu_seqlens`", "from 0", "[1, 5, 5, 9]"]),
    ("cu-decreasing", ["`cu_seqlens`", "without decreasing", "[0, 5, 4, 9]"]),
    ("cu-not-ending-at-T", ["`cu_seqlens`", "T=9", "[0, 4, 5, 8]"]),
    ("slot-out-of-range", ["`slot_indices`", "out of range", "5 slots"]),
    ("duplicate-slot", ["`slot_indices`", "same live slot"]),
    ("weight-nan", ["`weight`", "non-finite"]),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_checks(case, parts, backend):
    t = valid_call()
    if case == "cu-not-from-0":
        t["cu_seqlens"] = torch.tensor([1, 5, 5, 9])
    elif case == "cu-decreasing":
        t["cu_seqlens"] = torch.tensor([0, 5, 4, 9], dtype=torch.int32)
    elif case == "cu-not-ending-at-T":
        t["cu_seqlens"] = torch.tensor([0, 4, 5, 8])
    elif case == "slot-out-of-range":
        t["slot_indices"] = torch.tensor([1, -1, 7], dtype=torch.int32)
    elif case == "duplicate-slot":
        t["slot_indices"] = torch.tensor([2, -1, 2], dtype=torch.int64)
    else:
        t["weight"][3, 1] = float("nan")
    snap = snapshot(t)
    with pytest.raises(ValueError) as excinfo:
        call(t, backend=backend, full_checks=True)
    for part in parts:
        assert part in str(excinfo.value), f"{part!r} not in {str(excinfo.value)!r}"
    assert_untouched(t, snap)
    if case == "slot-out-of-range":  # by default (no data checks) the slot is padding instead
        call(t, backend=backend)
        assert torch.equal(bits(t["conv_state"][[0, 2, 3, 4]]), snap["conv_state"].view(5, -1)[[0, 2, 3, 4]].flatten())


# ----------------------------------------------------------------------------
# The sglang drop-in (kdakit.compat.sglang.causal_conv1d_fn)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_causal_conv1d_fn(backend, monkeypatch):
    from kdakit.compat.sglang import causal_conv1d_fn
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    C, W, PAD = 24, 4, 99
    t = make_case(MIXED, C, W, act_dtype=BF16, x_layout="transposed", pool_layout="transposed", padding=(1,),
                  seed=40)
    x_cf = t["x"].t()                                   # [dim, cu_seq_len], as sglang passes it
    cache_indices = torch.where(t["slot_indices"] < 0, PAD, t["slot_indices"])
    expected_pool = t["conv_state"].clone()
    expected = causal_conv1d_varlen(t["x"], expected_pool, t["weight"], t["cu_seqlens"], t["slot_indices"],
                                    has_initial_state=t["has_initial_state"], bias=t["bias"])
    x_before = x_cf.clone()
    got = causal_conv1d_fn(x_cf, t["weight"], t["bias"], query_start_loc=t["cu_seqlens"],
                           cache_indices=cache_indices, has_initial_state=t["has_initial_state"],
                           conv_states=t["conv_state"], activation="silu", pad_slot_id=PAD,
                           seq_lens_cpu=[5, 1, 1, 9, 3, 12, 4])
    assert got.shape == x_cf.shape and got.stride() == x_cf.stride(), "a new [dim, T] tensor laid out like x"
    assert torch.equal(got.t(), expected) and torch.equal(bits(t["conv_state"]), bits(expected_pool))
    assert torch.equal(x_cf, x_before), "x is not written"
    # sglang's defaults: no has_initial_state -> every sequence starts from zeros; bf16 weights are cast.
    pool = expected_pool.clone()
    got = causal_conv1d_fn(x_cf, t["weight"].bfloat16(), None, query_start_loc=t["cu_seqlens"],
                           cache_indices=t["slot_indices"], conv_states=pool, activation=True, seq_lens_cpu=None)
    zeros_pool = expected_pool.clone()
    ref = causal_conv1d_varlen(t["x"], zeros_pool, t["weight"].bfloat16().float(), t["cu_seqlens"], t["slot_indices"],
                               has_initial_state=torch.zeros(len(MIXED), dtype=torch.bool))
    assert torch.equal(got.t(), ref) and torch.equal(bits(pool), bits(zeros_pool))
    # No pool, no activation: one sequence from zeros; sglang's Triton positional order
    # (x, weight, bias, conv_states, query_start_loc, seq_lens_cpu, cache_indices, ...).
    T = x_cf.shape[1]
    got = causal_conv1d_fn(x_cf, t["weight"], t["bias"], None, torch.tensor([0, T], dtype=torch.int32), [T],
                           None, None, None)
    ref = causal_conv1d_varlen(t["x"], torch.zeros(1, C, W - 1, dtype=BF16), t["weight"],
                               torch.tensor([0, x_cf.shape[1]]), torch.tensor([-1]), bias=t["bias"], activation=None)
    assert torch.equal(got.t(), ref)
    with pytest.raises(NotImplementedError, match="activation must be None, silu, or swish"):
        causal_conv1d_fn(x_cf, t["weight"], None, None, None, None, activation="gelu")
    # sglang's CUDA-graph launch plan decides which blocks run: refused, never ignored.
    with pytest.raises(ValueError, match="does not support `block_table`"):
        causal_conv1d_fn(x_cf, t["weight"], t["bias"], t["conv_state"], t["cu_seqlens"], None,
                         block_table=torch.zeros(4, 2, dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu", [[0, 7, 3, 9], [0, 4, 30, 9], [-6, 2, 5, 9], [0, 2, 5, 6]],
                         ids=["decreasing", "past-T", "negative", "ending-early"])
def test_bad_offsets_stay_inside_the_buffers(backend, cu):
    """Unchecked offsets (no full checks) may give wrong numbers but never touch memory outside
    the buffers: the bytes around a pool view, the unused slots, x, all stay as they were."""
    t = valid_call()
    C, W = C_, W_
    big = torch.randn(7, C + 4, W - 1)                    # the pool is a view inside a larger buffer
    t["conv_state"] = big[1:6, 2:2 + C]
    t["slot_indices"] = torch.tensor([0, 3, 4], dtype=torch.int32)
    t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    big_before, x_before = big.clone(), t["x"].clone()
    call(t, backend=backend)
    assert torch.equal(t["x"], x_before)
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[1:6, 2:2 + C] = True
    assert torch.equal(bits(big[~inside]), bits(big_before[~inside])), "bytes outside the pool view"
    for s in (1, 2):
        assert torch.equal(bits(t["conv_state"][s]), bits(big_before[1:6, 2:2 + C][s]))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("offsets", [[0, 5, 4, 9], [0, 3, 20, 9], [-3, 2, 9, 9]], ids=["decreasing", "past-T", "negative"])
def test_offsets_outside_the_tokens_stay_inside_the_buffers(backend, offsets):
    """cu_seqlens are data (checked only with full checks): offsets that decrease, pass T or go
    negative are clamped into [0, T]; x and the windows of slots not in the batch stay bitwise,
    and every output and window is finite (x and the pool sit inside NaN-poisoned buffers, so a
    tap read from outside them would show)."""
    T, C, W, slots = 9, 16, 4, 6
    gen = torch.Generator().manual_seed(8)
    x_buf = torch.full((T + 8, C), float("nan"))
    x_buf[4:4 + T] = torch.randn(T, C, generator=gen)
    x = x_buf[4:4 + T]
    weight = torch.randn(C, W, generator=gen) * 0.5
    pool_buf = torch.full((slots + 2, C, W - 1), float("nan"))
    pool_buf[1:1 + slots] = torch.randn(slots, C, W - 1, generator=gen)
    conv = pool_buf[1:1 + slots]
    before_x, before_pool = x_buf.clone(), pool_buf.clone()
    idx = torch.tensor([1, -1, 4], dtype=torch.int32)
    out = torch.zeros(T, C)
    kdakit.causal_conv1d_varlen(x, conv, weight, torch.tensor(offsets, dtype=torch.int32), idx, out=out,
                                backend=backend)
    assert torch.equal(x_buf.nan_to_num(7.0), before_x.nan_to_num(7.0))
    assert torch.equal(pool_buf[[0, 1, 3, 4, 6, 7]].nan_to_num(7.0), before_pool[[0, 1, 3, 4, 6, 7]].nan_to_num(7.0))
    assert torch.isfinite(out).all() and torch.isfinite(conv).all()


ROWS_FORMS = [Conv1dVarlenConfig(1, 16, 1, form="rows"), Conv1dVarlenConfig(4, 16, 1, form="rows"),
              Conv1dVarlenConfig(8, 32, 1, form="rows"), Conv1dVarlenConfig(32, 8, 2, form="rows")]


@pytest.mark.parametrize("config", sweep(ROWS_FORMS, keep=[1, 3]), ids=lambda c: f"rows-t{c.block_t}-c{c.block_c}")
@pytest.mark.parametrize("W", sweep([2, 4, 8], keep=[1]), ids=lambda w: f"W{w}")
@pytest.mark.parametrize("x_layout", sweep(["rows", "transposed"], keep=[0]), ids=["x-TC", "x-CT-view"])
def test_rows_form_equals_the_tile_form_bitwise(config, W, x_layout):
    """The "rows" form (a program streams its tokens a row at a time) gives the float64
    reference's numbers and the tile form's bits, windows included: sequences of length 0,
    shorter than W-1, starting anywhere in a tile, spilling into the next, one-token runs,
    padding and out-of-range slots, some starting from zeros."""
    lengths = [5, 1, 0, 2, 9, 1, 1, 1, 3, 0, 6, 2]
    got = {}
    for name, cfg in (("tile", Conv1dVarlenConfig(8, 16, 1)), ("rows", config)):
        t = make_case(lengths, 24, W, act_dtype=BF16, x_layout=x_layout, pool_layout="transposed", padding=(2, 6),
                      out_of_range=(8,), seed=90 + W)
        got[name] = (check_case("triton", t, config=cfg), t["conv_state"])
    for a, b in zip(got["tile"], got["rows"]):
        assert torch.equal(bits(a), bits(b))


def test_conv_config_form_is_checked():
    with pytest.raises(ValueError, match="form must be 'tile' or 'rows'"):
        Conv1dVarlenConfig(8, 16, 1, form="row")
