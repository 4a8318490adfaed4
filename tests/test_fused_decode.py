"""Fused decode: both backends against the float64 reference, with poisoned outputs and pools;
fused == the unfused triton chain; validation errors leave every buffer untouched."""
import functools

import pytest
import torch

from kdakit import reference
from kdakit.ops.conv1d_update import causal_conv1d_update
from kdakit.ops.fused_decode import FusedDecodeConfig, fused_decode, fused_decode_triton
from kdakit.ops.gated_rmsnorm import gated_rmsnorm
from kdakit.ops.packed_decode import packed_decode

from helpers import POISON, assert_close, kda_params, pick_slots, random_pool, tol_for, untouched_slots, noncontig_last, setter, sweep

BACKENDS = ["reference", "triton"]

# (H, HV, K, V): GVA, K != V and non-power-of-two dims; tiny for the interpreter.
SHAPES = [
    pytest.param(2, 2, 16, 16, id="H2-HV2-K16-V16"),
    pytest.param(1, 4, 16, 32, id="gva-H1-HV4-K16-V32"),
    pytest.param(2, 4, 32, 16, id="gva-H2-HV4-K32-V16"),
    pytest.param(1, 2, 24, 40, id="nonpow2-K24-V40"),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t`` (NaN poison compares equal to itself)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def conv_pool(slots, C, W, dtype, *, transposed, generator):
    """``[slots, C, W-1]``; transposed: stored ``[slots, W-1, C]`` and passed as a ``.transpose(1, 2)`` view."""
    if transposed:
        return torch.randn(slots, W - 1, C, generator=generator).to(dtype).transpose(1, 2)
    return torch.randn(slots, C, W - 1, generator=generator).to(dtype)


def make_case(H, HV, K, V, *, W=4, batch=4, slots=7, num_padding=1, act_dtype=torch.float32,
              state_dtype=torch.float32, conv_dtype=None, conv_bias=True, transposed=True, norm=True,
              slot_stride=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    C = 2 * H * K + HV * V
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    t = {
        "qkv": torch.randn(batch, C, generator=gen).to(act_dtype),
        "conv_weight": torch.randn(C, W, generator=gen) * 0.5,
        "conv_state": conv_pool(slots, C, W, conv_dtype or act_dtype, transposed=transposed, generator=gen),
        "a": torch.randn(batch, HV * K, generator=gen).to(act_dtype),
        "b": torch.randn(batch, HV, generator=gen).to(act_dtype),
        "A_log": A_log, "dt_bias": dt_bias,
        "state": random_pool(slots, HV, V, K, state_dtype, slot_stride=slot_stride, generator=gen),
        "slot_indices": pick_slots(slots, batch, num_padding, generator=gen),
    }
    kw = {"conv_bias": torch.randn(C, generator=gen) * 0.1 if conv_bias else None}
    if norm:
        kw["norm_gate"] = torch.randn(batch, HV * V, generator=gen).to(act_dtype)
        kw["norm_weight"] = torch.rand(V, generator=gen) + 0.5
    # Unused slots are poisoned: they must come back bitwise.
    for s in untouched_slots(slots, t["slot_indices"]):
        t["state"][s] = float("nan")
        t["conv_state"][s] = float("nan")
    return t, kw


ARGS = ("qkv", "conv_weight", "conv_state", "a", "b", "A_log", "dt_bias", "state", "slot_indices")


def ref_run(t, kw, **extra):
    """float64 oracle on copies: (out, state, conv_state)."""
    state, conv = t["state"].double(), t["conv_state"].double()
    out = torch.empty(t["qkv"].shape[0], 1, *t["state"].shape[1:3], dtype=torch.float64)
    d = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    reference.fused_decode(t["qkv"].double(), t["conv_weight"].double(), conv, t["a"].double(), t["b"].double(),
                           t["A_log"].double(), t["dt_bias"].double(), state, t["slot_indices"], out,
                           compute_dtype=torch.float64, **d, **extra)
    return out, state, conv


def check_windows(conv, ref_conv, act_dtype):
    """Windows hold raw inputs: bitwise unless the pool is narrower than the activations.

    Triton's interpreter casts float32 -> bfloat16 by truncation (compiled Triton and
    PyTorch round to nearest), so a downcasting pool is compared to 1 bf16 ulp.
    """
    expected = ref_conv.to(conv.dtype)
    if conv.dtype == act_dtype or conv.dtype == torch.float32:
        assert torch.equal(conv, expected), "conv windows must be bitwise"
    else:
        assert_close(conv, ref_conv, 1e-2, "conv windows")


def run_case(backend, H, HV, K, V, *, lower_bound=None, out_dtype=None, **case):
    t, kw = make_case(H, HV, K, V, **case)
    idx = t["slot_indices"]
    slots = t["state"].shape[0]
    state_before, conv_before = t["state"].clone(), t["conv_state"].clone()
    storage_len = t["state"].untyped_storage().nbytes() // t["state"].element_size()
    flat_before = torch.as_strided(t["state"], (storage_len,), (1,)).clone()
    ref_out, ref_state, ref_conv = ref_run(t, kw, lower_bound=lower_bound)
    out = torch.full((idx.shape[0], 1, HV, V), POISON).to(out_dtype or t["qkv"].dtype)
    result = fused_decode(*(t[n] for n in ARGS), **kw, lower_bound=lower_bound, out=out, backend=backend)
    assert result is out
    tol = tol_for(t["qkv"].dtype, t["state"].dtype, out.dtype)
    assert_close(out, ref_out, tol, "out")
    live = [int(s) for s in idx if s >= 0]
    if live:
        assert_close(t["state"][live], ref_state[live], tol, "state")
        check_windows(t["conv_state"][live], ref_conv[live], t["qkv"].dtype)
    pad = (idx < 0).nonzero().flatten()
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padding rows must be zero"
    for s in untouched_slots(slots, idx):
        assert torch.equal(bits(t["state"][s]), bits(state_before[s])), f"state slot {s} must stay bitwise"
        assert torch.equal(bits(t["conv_state"][s]), bits(conv_before[s])), f"conv slot {s} must stay bitwise"
    if case.get("slot_stride"):  # the gaps between slots belong to other layers
        stride = case["slot_stride"]
        flat_after = torch.as_strided(t["state"], (storage_len,), (1,))
        gap = torch.ones(storage_len, dtype=torch.bool)
        for s in range(slots):
            gap[s * stride: s * stride + HV * V * K] = False
        assert torch.equal(bits(flat_after[gap]), bits(flat_before[gap])), "bytes between slots must stay bitwise"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,HV,K,V", sweep(SHAPES, keep=2))
@pytest.mark.parametrize("norm", sweep([True, False]), ids=["norm", "no-norm"])
def test_shapes(backend, H, HV, K, V, norm):
    run_case(backend, H, HV, K, V, norm=norm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act_dtype,state_dtype,conv_dtype", sweep([
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16, torch.float32),
], keep=2), ids=lambda d: str(d).replace("torch.", ""))
def test_dtypes(backend, act_dtype, state_dtype, conv_dtype):
    run_case(backend, 1, 2, 16, 24, act_dtype=act_dtype, state_dtype=state_dtype, conv_dtype=conv_dtype, seed=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lower_bound", sweep([None, -5.0, -1.0], keep=2), ids=["default-gate", "safe-gate-5", "safe-gate-1"])
@pytest.mark.parametrize("norm", sweep([True, False]), ids=["norm", "no-norm"])
def test_gates(backend, lower_bound, norm):
    run_case(backend, 2, 2, 16, 16, lower_bound=lower_bound, norm=norm, seed=2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W,transposed", sweep([(2, True), (3, False), (4, True), (4, False), (5, True)], keep=2),
                         ids=["W2-pool-transposed", "W3-pool-contiguous", "W4-pool-transposed",
                              "W4-pool-contiguous", "W5-pool-transposed"])
def test_conv_widths_and_pool_layouts(backend, W, transposed):
    run_case(backend, 1, 2, 16, 16, W=W, transposed=transposed, conv_bias=W % 2 == 0, seed=3 + W)


@pytest.mark.parametrize("backend", BACKENDS)
def test_interleaved_pool_padding_and_out_dtype(backend):
    run_case(backend, 1, 2, 16, 16, slot_stride=3 * 2 * 16 * 16 + 8, seed=9)
    run_case(backend, 1, 2, 16, 16, batch=3, num_padding=3, seed=10)  # all padding
    run_case(backend, 1, 2, 16, 16, act_dtype=torch.bfloat16, out_dtype=torch.float32, seed=11)
    run_case(backend, 1, 2, 16, 16, batch=1, num_padding=0, seed=12)


@pytest.mark.parametrize("act_dtype,H,HV,K,V,norm", sweep([
    pytest.param(torch.float32, 1, 4, 16, 32, True, id="fp32-gva-norm"),
    pytest.param(torch.float32, 1, 2, 24, 40, False, id="fp32-nonpow2-no-norm"),
    pytest.param(torch.bfloat16, 2, 4, 32, 16, False, id="bf16-gva-no-norm"),
    pytest.param(torch.bfloat16, 1, 2, 24, 40, True, id="bf16-nonpow2-norm"),
], keep=[0, 2]))
def test_fused_equals_unfused_triton_chain(act_dtype, H, HV, K, V, norm):
    """causal_conv1d_update -> packed_decode -> gated_rmsnorm, all triton, sees the same numbers."""
    t, kw = make_case(H, HV, K, V, act_dtype=act_dtype, norm=norm, seed=13)
    B = t["qkv"].shape[0]
    chain_state, chain_conv = t["state"].clone(), t["conv_state"].clone()
    idx = t["slot_indices"]
    mixed = causal_conv1d_update(t["qkv"], chain_conv, t["conv_weight"], idx, bias=kw["conv_bias"],
                                 backend="triton")
    chain = packed_decode(mixed, t["a"], t["b"], t["A_log"], t["dt_bias"], chain_state, idx, lower_bound=-3.0,
                          backend="triton")
    if norm:
        chain = gated_rmsnorm(chain, kw["norm_gate"].view(B, 1, HV, V), kw["norm_weight"], backend="triton")
    out = fused_decode(*(t[n] for n in ARGS), **kw, lower_bound=-3.0, backend="triton")
    assert torch.equal(bits(t["conv_state"]), bits(chain_conv)), "conv windows must match the unfused conv bitwise"
    live = idx[idx >= 0].long()
    assert_close(t["state"][live], chain_state[live], 1e-6, "state vs unfused")
    # Both round o to out's dtype before the norm.
    assert_close(out, chain, 1e-6, "out vs unfused")


# (BLOCK_V, V_TILES, num_warps) and (H, HV, norm): one program per head streaming its tiles
# (V_TILES is clamped to the tiles that cover V; H == HV only), one program holding the
# whole row (the norm on registers), or V split over several programs per head, each with
# one or several tiles (the last to arrive shifts the q/k windows and norms).
SINGLE_CONFIGS = [(8, 16, 1), (4, 16, 2), (2, 16, 1)]
FULL_ROW_CONFIGS = [(32, 1, 1), (32, 1, 4)]
SPLIT_CONFIGS = [(4, 1, 1), (8, 1, 2), (2, 1, 1), (4, 2, 1), (2, 4, 1)]


def config_id(c):
    return "bv{}-tiles{}-warps{}".format(*c)


CONFIG_CASES = ([pytest.param(c, 2, 2, norm, id=config_id(c) + f"-H2-norm{int(norm)}")
                 for c in SINGLE_CONFIGS + FULL_ROW_CONFIGS + SPLIT_CONFIGS for norm in (True, False)]
                + [pytest.param(c, H, HV, True, id=config_id(c) + f"-gva-H{H}-HV{HV}")
                   for c in [(32, 1, 1)] + SPLIT_CONFIGS for H, HV in ((1, 4), (2, 4))])


@pytest.mark.parametrize("V", [16, 20], ids=["V16", "V20-partial-last-tile"])
@pytest.mark.parametrize("config,H,HV,norm", sweep(CONFIG_CASES, keep=[0, 6, 16, 21]))
def test_triton_configs(config, H, HV, norm, V):
    """Every split of V over programs and tiles computes the same thing, shifts each q/k
    window exactly once, leaves unused slots bitwise and the arrival counters at zero."""
    from kdakit.ops.launch import arrival_counters
    t, kw = make_case(H, HV, 16, V, norm=norm, batch=5, slots=9, num_padding=2, seed=14)
    before = {n: t[n].clone() for n in ("state", "conv_state")}
    ref_out, ref_state, ref_conv = ref_run(t, kw, scale=0.25)
    out = torch.full((5, 1, HV, V), POISON)
    fused_decode_triton(*(t[n] for n in ARGS), out, scale=0.25, lower_bound=None, norm_eps=1e-6,
                        config=FusedDecodeConfig(*config), **{"norm_gate": None, "norm_weight": None, **kw})
    live = t["slot_indices"][t["slot_indices"] >= 0].long()
    assert_close(out, ref_out, 1e-5)
    assert_close(t["state"][live], ref_state[live], 1e-5)
    assert torch.equal(t["conv_state"][live], ref_conv[live].float())
    for s in untouched_slots(9, t["slot_indices"]):
        for n in ("state", "conv_state"):
            assert torch.equal(bits(t[n][s]), bits(before[n][s])), f"{n} slot {s} must stay bitwise"
    assert not arrival_counters(out.device, 5 * H).any(), "arrival counters must be back at zero"


@pytest.mark.parametrize("H,HV,norm", sweep([(2, 2, True), (1, 4, True), (2, 2, False)], keep=2), ids=["H2-norm", "gva-norm", "H2"])
def test_large_batch_runs_the_unfused_chain(H, HV, norm, monkeypatch):
    """Past CHAIN_ABOVE_PAIRS (request, head) pairs the op runs conv update -> packed decode
    -> gated norm: same contract (float64 reference, windows, unused slots, padding zero)."""
    from kdakit.ops import fused_decode as fused_module
    monkeypatch.setattr(fused_module, "fused_decode_config",
                        functools.partial(fused_module.fused_decode_config, chain_above_pairs=0))
    t, kw = make_case(H, HV, 16, 16, norm=norm, batch=5, slots=9, num_padding=2, seed=21)
    if norm:  # a gate with a row stride: a view into a wider projection
        kw["norm_gate"] = torch.cat([kw["norm_gate"], torch.randn(5, 3)], dim=1)[:, :HV * 16]
    before = {n: t[n].clone() for n in ("state", "conv_state")}
    ref_out, ref_state, ref_conv = ref_run(t, kw, scale=0.25)
    out = torch.full((5, 1, HV, 16), POISON)
    fused_decode(*(t[n] for n in ARGS), **kw, scale=0.25, out=out, backend="triton")
    idx = t["slot_indices"]
    live = idx[idx >= 0].long()
    assert_close(out, ref_out, 1e-5)
    assert bool((out[idx < 0] == 0).all()), "padding rows are zero"
    assert_close(t["state"][live], ref_state[live], 1e-5)
    assert torch.equal(t["conv_state"][live], ref_conv[live].float())
    for s in untouched_slots(9, idx):
        for n in ("state", "conv_state"):
            assert torch.equal(bits(t[n][s]), bits(before[n][s])), f"{n} slot {s} must stay bitwise"


def test_plan_with_dependent_launches_is_the_chain():
    """Where kernels can be programmatic dependent launches the op runs the chain at every
    batch; elsewhere the one-kernel step up to CHAIN_ABOVE_PAIRS (request, head) pairs."""
    from kdakit.ops.fused_decode import CHAIN_ABOVE_PAIRS, chain_decode_config, fused_decode_config
    assert fused_decode_config(1, 32, 32, 128, 128, pdl=True).chain
    assert not fused_decode_config(1, 32, 32, 128, 128, pdl=False).chain
    assert fused_decode_config(CHAIN_ABOVE_PAIRS // 32 + 1, 32, 32, 128, 128, pdl=False).chain
    # the chain's decode config covers V whatever the batch (float32 and bfloat16 pools)
    for batch in (1, 8, 32, 512):
        for itemsize in (4, 2):
            decode = chain_decode_config(batch, 32, 128, 128, itemsize)
            block_v, tiles = decode.block_v, decode.v_tiles
            assert block_v * tiles <= 128 and 128 % (block_v * tiles) == 0


def test_default_scale_and_out_allocation():
    t, kw = make_case(1, 2, 16, 16, act_dtype=torch.bfloat16, seed=16)
    ref_out, _, _ = ref_run(t, kw, scale=0.7)
    out = fused_decode(*(t[n] for n in ARGS), **kw, scale=0.7, backend="triton")
    assert out.shape == (4, 1, 2, 16) and out.dtype == torch.bfloat16
    assert_close(out, ref_out, 2e-2)


# ----------------------------------------------------------------------------
# Validation: ValueError naming the argument; nothing written.
# ----------------------------------------------------------------------------
B_, H_, HV_, K_, V_, W_ = 3, 1, 2, 16, 8, 4
C_ = 2 * H_ * K_ + HV_ * V_


def valid_call(seed=0):
    t, kw = make_case(H_, HV_, K_, V_, W=W_, batch=B_, slots=5, seed=seed)
    t.update(kw)
    t["out"] = torch.full((B_, 1, HV_, V_), POISON)
    return t


def call(t, **extra):
    kw = {n: t[n] for n in ("conv_bias", "norm_gate", "norm_weight", "out") if n in t}
    return fused_decode(*(t[n] for n in ARGS), **kw, **extra)


BREAKERS = [
    ("qkv-1d", setter("qkv", lambda x: x.flatten()), ["`qkv`", "2D", "ndim=1"]),
    ("qkv-noncontig", setter("qkv", noncontig_last), ["`qkv`", "contiguous in the last dim"]),
    ("qkv-int32", setter("qkv", lambda x: x.to(torch.int32)), ["`qkv`", "torch.int32"]),
    ("qkv-width", setter("qkv", lambda x: torch.randn(B_, C_ + 2)), ["`qkv`", f"{C_ + 2}"]),
    ("qkv-heads", setter("qkv", lambda x: torch.randn(B_, 2 * 3 * K_ + HV_ * V_)), ["H=3", f"HV={HV_}"]),
    ("a-3d", setter("a", lambda x: x.unsqueeze(1)), ["`a`", "2D"]),
    ("a-shape", setter("a", lambda x: torch.randn(B_, HV_ * K_ + 1)), ["`a`", "HV*K"]),
    ("b-batch", setter("b", lambda x: x[:2]), ["Mismatched batch sizes", "b.shape[0]=2"]),
    ("A_log-numel", setter("A_log", lambda x: torch.zeros(HV_ + 1)), ["`A_log`", f"{HV_ + 1}"]),
    ("dt_bias-2d", setter("dt_bias", lambda x: x.view(HV_, K_)), ["`A_log`/`dt_bias`", "1D"]),
    ("state-transposed-KV", setter("state", lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2)),
     ["`state`", "contiguous"]),
    ("state-float64", setter("state", lambda x: x.double()), ["`state`", "torch.float64"]),
    ("indices-len", setter("slot_indices", lambda x: x[:2]), ["`slot_indices`", "(2,)", f"({B_},)"]),
    ("indices-float", setter("slot_indices", lambda x: x.float()), ["`slot_indices`", "torch.float32"]),
    ("conv_weight-width", setter("conv_weight", lambda x: torch.randn(C_, 1)), ["`conv_weight`", "W=1"]),
    ("conv_weight-channels", setter("conv_weight", lambda x: torch.randn(C_ - 1, W_)), ["`conv_weight`", f"C={C_}"]),
    ("conv_weight-bf16", setter("conv_weight", lambda x: x.bfloat16()), ["`conv_weight`", "float32"]),
    ("conv_weight-noncontig", setter("conv_weight", lambda x: x.t().contiguous().t()), ["`conv_weight`", "contiguous"]),
    ("conv_bias-shape", setter("conv_bias", lambda x: torch.zeros(C_ + 1)), ["`conv_bias`", f"({C_},)"]),
    ("conv_state-taps", setter("conv_state", lambda x: torch.zeros(5, C_, W_)), ["`conv_state`", f"W-1={W_ - 1}"]),
    ("conv_state-2d", setter("conv_state", lambda x: x[0]), ["`conv_state`", "3D"]),
    ("conv_state-int", setter("conv_state", lambda x: x.to(torch.int16)), ["`conv_state`", "torch.int16"]),
    ("conv_state-overlap", setter("conv_state", lambda x: x[:1].expand(5, C_, W_ - 1)), ["`conv_state`", "overlapping"]),
    ("out-shape-K-for-V", setter("out", lambda x: torch.full((B_, 1, HV_, K_), POISON)), ["`out`", f"{(B_, 1, HV_, V_)}"]),
    ("out-noncontig", setter("out", noncontig_last), ["`out`", "contiguous"]),
    ("out-other-device", setter("out", lambda x: torch.empty(x.shape, device="meta")), ["same device"]),
    ("norm_gate-alone", lambda t: t.pop("norm_weight"), ["`norm_gate`", "`norm_weight`"]),
    ("norm_gate-shape", setter("norm_gate", lambda x: torch.randn(B_, HV_ * K_)), ["`norm_gate`", f"({B_}, {HV_ * V_})"]),
    ("norm_weight-K", setter("norm_weight", lambda x: torch.ones(K_)), ["`norm_weight`", f"({V_},)"]),
    ("norm_weight-bf16", setter("norm_weight", lambda x: x.bfloat16()), ["`norm_weight`", "float32"]),
]


@pytest.mark.parametrize("breaker,parts", [pytest.param(b, p, id=i) for i, b, p in BREAKERS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_errors_leave_buffers_untouched(breaker, parts, backend):
    t = valid_call()
    breaker(t)
    snap = {n: bits(x).clone() for n, x in t.items() if isinstance(x, torch.Tensor) and x.device.type != "meta"}
    with pytest.raises(ValueError) as excinfo:
        call(t, backend=backend)
    for part in parts:
        assert part in str(excinfo.value), f"{part!r} not in {str(excinfo.value)!r}"
    for n, before in snap.items():
        assert torch.equal(bits(t[n]), before), f"`{n}` changed although the call raised"


@pytest.mark.parametrize("case,parts", [
    ("duplicate-slot", ["`slot_indices`", "same live slot"]),
    ("slot-out-of-range", ["`slot_indices`", "out of range"]),
    ("conv_weight-nan", ["`conv_weight`", "non-finite"]),
    ("norm_weight-inf", ["`norm_weight`", "non-finite"]),
    ("lower-bound", ["`lower_bound`", "[-5, 0)"]),
])
def test_full_checks(case, parts):
    t = valid_call(seed=1)
    extra = {}
    if case == "duplicate-slot":
        t["slot_indices"] = torch.tensor([2, 2, -1], dtype=torch.int32)
    elif case == "slot-out-of-range":
        t["slot_indices"] = torch.tensor([2, 5, -1], dtype=torch.int64)
    elif case == "conv_weight-nan":
        t["conv_weight"][3, 1] = float("nan")
    elif case == "norm_weight-inf":
        t["norm_weight"][0] = float("inf")
    else:
        extra["lower_bound"] = -6.0
    snap = {n: bits(x).clone() for n, x in t.items() if isinstance(x, torch.Tensor)}
    with pytest.raises(ValueError) as excinfo:
        call(t, backend="triton", full_checks=True, **extra)
    for part in parts:
        assert part in str(excinfo.value)
    for n, before in snap.items():
        assert torch.equal(bits(t[n]), before), f"`{n}` changed although the call raised"
