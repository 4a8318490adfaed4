"""causal_conv1d_update: both backends against the float64 reference, pools with any strides,
poisoned outputs and unused slots; validation errors leave every buffer untouched."""
import pytest
import torch

from kdakit import reference
from kdakit.ops.conv1d_update import Conv1dUpdateConfig, causal_conv1d_update, causal_conv1d_update_triton

from helpers import POISON, assert_close, pick_slots, untouched_slots, noncontig_last, setter, sweep

BACKENDS = ["reference", "triton"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def make_case(B, C, W, *, slots=6, num_padding=1, act_dtype=torch.float32, pool_dtype=None, layout="transposed",
              bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool_dtype = pool_dtype or act_dtype
    if layout == "transposed":  # stored [slots, W-1, C], passed as a [slots, C, W-1] view
        conv = torch.randn(slots, W - 1, C, generator=gen).to(pool_dtype).transpose(1, 2)
    elif layout == "interleaved":  # every slot padded (another layer's window between slots)
        conv = torch.randn(slots, C + 5, W - 1, generator=gen).to(pool_dtype)[:, 3:3 + C]
    else:
        conv = torch.randn(slots, C, W - 1, generator=gen).to(pool_dtype)
    idx = pick_slots(slots, B, num_padding, generator=gen)
    for s in untouched_slots(slots, idx):
        conv[s] = float("nan")
    return {
        "x": torch.randn(B, C, generator=gen).to(act_dtype),
        "conv_state": conv,
        "weight": torch.randn(C, W, generator=gen) * 0.5,
        "slot_indices": idx,
        "bias": torch.randn(C, generator=gen) * 0.1 if bias else None,
    }


def run_case(backend, B, C, W, config=None, **case):
    t = make_case(B, C, W, **case)
    x, conv, idx = t["x"], t["conv_state"], t["slot_indices"]
    before = conv.clone()
    storage = torch.as_strided(conv, (conv.untyped_storage().nbytes() // conv.element_size(),), (1,), 0)
    storage_before = storage.clone()
    ref_conv = conv.double()
    ref_out = torch.empty(B, C, dtype=torch.float64)
    reference.causal_conv1d_update(x.double(), ref_conv, t["weight"].double(), idx, ref_out,
                                   bias=None if t["bias"] is None else t["bias"].double(),
                                   compute_dtype=torch.float64)
    out = torch.full((B, C), POISON).to(x.dtype)
    if config is None:
        result = causal_conv1d_update(x, conv, t["weight"], idx, bias=t["bias"], out=out, backend=backend)
    else:
        result = causal_conv1d_update_triton(x, conv, t["weight"], idx, out, bias=t["bias"], config=config)
    assert result is out
    # The reference rounds y to x's dtype too: compare with the rounding it implies.
    tol = 1e-6 if x.dtype == torch.float32 else 1e-2
    assert_close(out, ref_out, tol, "out")
    live = idx[idx >= 0].long()
    if len(live):
        expected = ref_conv[live].to(conv.dtype)
        if conv.dtype == x.dtype or conv.dtype == torch.float32:
            assert torch.equal(conv[live], expected), "windows hold raw inputs: bitwise"
        else:  # the interpreter casts float32 -> bf16 by truncation; compiled Triton rounds to nearest
            assert_close(conv[live], ref_conv[live], 1e-2, "windows")
    pad = (idx < 0).nonzero().flatten()
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padding rows must be zero"
    for s in untouched_slots(conv.shape[0], idx):
        assert torch.equal(bits(conv[s]), bits(before[s])), f"slot {s} must stay bitwise"
    # Bytes outside the [slots, C, W-1] view (other layers) are never written.
    inside = torch.zeros(storage.shape[0], dtype=torch.bool)
    offs = torch.as_strided(torch.arange(storage.shape[0]), conv.shape, conv.stride(), conv.storage_offset())
    inside[offs.flatten()] = True
    assert torch.equal(bits(storage[~inside]), bits(storage_before[~inside])), "bytes outside the pool view"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,C,W", sweep([(4, 40, 4), (3, 96, 2), (2, 300, 3), (5, 17, 5)], keep=[0, 2]),
                         ids=["C40-W4", "C96-W2", "C300-W3-two-blocks", "C17-W5"])
@pytest.mark.parametrize("layout", ["transposed", "contiguous", "interleaved"])
def test_shapes_and_layouts(backend, B, C, W, layout):
    run_case(backend, B, C, W, layout=layout, bias=C != 96, seed=C + W)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act_dtype,pool_dtype", sweep([
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16), (torch.float16, torch.float16)], keep=2), ids=lambda d: str(d).replace("torch.", ""))
def test_dtypes(backend, act_dtype, pool_dtype):
    run_case(backend, 4, 48, 4, act_dtype=act_dtype, pool_dtype=pool_dtype, seed=7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_and_no_padding(backend):
    run_case(backend, 3, 32, 4, num_padding=3, seed=8)
    run_case(backend, 3, 32, 4, num_padding=0, seed=9)


def test_small_block_config_covers_every_channel():
    run_case("triton", 3, 70, 4, config=Conv1dUpdateConfig(block_c=16, num_warps=1), seed=10)


def test_bf16_post_conv_rounding_matches_reference_float32_path():
    """Output is the float32 SiLU rounded to bf16 once (the same as reference.conv_step)."""
    t = make_case(4, 64, 4, act_dtype=torch.bfloat16, seed=11)
    conv_ref = t["conv_state"].clone()
    out_ref = torch.empty(4, 64, dtype=torch.bfloat16)
    reference.causal_conv1d_update(t["x"], conv_ref, t["weight"], t["slot_indices"], out_ref, bias=t["bias"])
    out = causal_conv1d_update(t["x"], t["conv_state"], t["weight"], t["slot_indices"], bias=t["bias"],
                               backend="triton")
    assert out.dtype == torch.bfloat16
    # bf16 outputs of the same float32 math: at most 1 bf16 ulp apart (interpreter casts by truncation)
    assert ((out.float() - out_ref.float()).abs() <= out_ref.float().abs() * 2 ** -7 + 1e-30).all()
    assert torch.equal(bits(t["conv_state"]), bits(conv_ref))


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------
B_, C_, W_ = 3, 24, 4


def valid_call():
    t = make_case(B_, C_, W_, slots=5)
    t["out"] = torch.full((B_, C_), POISON)
    return t


BREAKERS = [
    ("x-1d", setter("x", lambda x: x.flatten()), ["`x`", "2D", "ndim=1"]),
    ("x-noncontig", setter("x", noncontig_last), ["`x`", "contiguous in the last dim"]),
    ("x-float64", setter("x", lambda x: x.double()), ["`x`", "torch.float64"]),
    ("weight-1d", setter("weight", lambda w: w[:, 0].contiguous()), ["`weight`", "2D"]),
    ("weight-channels", setter("weight", lambda w: torch.randn(C_ + 1, W_)), ["`weight`", f"C={C_}"]),
    ("weight-W1", setter("weight", lambda w: torch.randn(C_, 1)), ["`weight`", "W=1"]),
    ("weight-W9", setter("weight", lambda w: torch.randn(C_, 9)), ["`weight`", "W=9"]),
    ("weight-bf16", setter("weight", lambda w: w.bfloat16()), ["`weight`", "float32"]),
    ("weight-noncontig", setter("weight", lambda w: w.t().contiguous().t()), ["`weight`", "contiguous"]),
    ("bias-shape", setter("bias", lambda b: torch.zeros(C_, 1)), ["`bias`", f"({C_},)"]),
    ("bias-fp16", setter("bias", lambda b: b.half()), ["`bias`", "float32"]),
    ("conv_state-2d", setter("conv_state", lambda c: c[0]), ["`conv_state`", "3D"]),
    ("conv_state-taps", setter("conv_state", lambda c: torch.zeros(5, C_, W_)), ["`conv_state`", f"W-1={W_ - 1}"]),
    ("conv_state-channels", setter("conv_state", lambda c: torch.zeros(5, C_ + 1, W_ - 1)), ["`conv_state`", f"C={C_}"]),
    ("conv_state-float64", setter("conv_state", lambda c: c.double()), ["`conv_state`", "torch.float64"]),
    ("conv_state-overlap", setter("conv_state", lambda c: c[:1].expand(5, C_, W_ - 1)), ["`conv_state`", "overlapping"]),
    ("indices-len", setter("slot_indices", lambda i: i[:2]), ["`slot_indices`", "(2,)", f"({B_},)"]),
    ("indices-2d", setter("slot_indices", lambda i: i[:, None]), ["`slot_indices`", "[B]"]),
    ("indices-int16", setter("slot_indices", lambda i: i.to(torch.int16)), ["`slot_indices`", "torch.int16"]),
    ("out-shape", setter("out", lambda o: torch.full((B_, C_ + 1), POISON)), ["`out`", f"({B_}, {C_})"]),
    ("out-dtype", setter("out", lambda o: o.bfloat16()), ["`out`", "torch.bfloat16", "x's dtype"]),
    ("out-noncontig", setter("out", noncontig_last), ["`out`", "contiguous"]),
    ("out-other-device", setter("out", lambda o: torch.empty(o.shape, device="meta")), ["same device"]),
]


@pytest.mark.parametrize("breaker,parts", [pytest.param(b, p, id=i) for i, b, p in BREAKERS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_errors_leave_buffers_untouched(breaker, parts, backend):
    t = valid_call()
    breaker(t)
    snap = {n: bits(x).clone() for n, x in t.items() if isinstance(x, torch.Tensor) and x.device.type != "meta"}
    with pytest.raises(ValueError) as excinfo:
        causal_conv1d_update(t["x"], t["conv_state"], t["weight"], t["slot_indices"], bias=t["bias"], out=t["out"],
                             backend=backend)
    for part in parts:
        assert part in str(excinfo.value), f"{part!r} not in {str(excinfo.value)!r}"
    for n, before in snap.items():
        assert torch.equal(bits(t[n]), before), f"`{n}` changed although the call raised"


@pytest.mark.parametrize("case,parts", [
    ("duplicate-slot", ["`slot_indices`", "same live slot"]),
    ("slot-out-of-range", ["`slot_indices`", "out of range"]),
    ("weight-nan", ["`weight`", "non-finite"]),
    ("bias-inf", ["`bias`", "non-finite"]),
])
def test_full_checks(case, parts):
    t = valid_call()
    if case == "duplicate-slot":
        t["slot_indices"] = torch.tensor([1, -1, 1], dtype=torch.int32)
    elif case == "slot-out-of-range":
        t["slot_indices"] = torch.tensor([1, -1, 5], dtype=torch.int64)
    elif case == "weight-nan":
        t["weight"][2, 3] = float("nan")
    else:
        t["bias"][0] = float("-inf")
    snap = {n: bits(x).clone() for n, x in t.items() if isinstance(x, torch.Tensor)}
    with pytest.raises(ValueError) as excinfo:
        causal_conv1d_update(t["x"], t["conv_state"], t["weight"], t["slot_indices"], bias=t["bias"], out=t["out"],
                             backend="triton", full_checks=True)
    for part in parts:
        assert part in str(excinfo.value)
    for n, before in snap.items():
        assert torch.equal(bits(t[n]), before)
