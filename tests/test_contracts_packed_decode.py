"""Packed decode: the public error contract (check_packed_decode in kdakit/ops/packed_decode.py), exact texts and order,
through the native API and the sglang compat API; extra checks; full-check mode; backend selection.

Every failing call must leave every buffer (state pool, out, inputs) bitwise unchanged.
"""
import re

import pytest
import torch

import kdakit
from kdakit import backends
from kdakit.compat.sglang import fused_recurrent_kda_packed_decode
from kdakit.ops.packed_decode import check_packed_decode

from helpers import POISON

# Small shapes with K != V (a transposed layout must not pass silently).
B, H, HV, K, V, SLOTS = 3, 2, 4, 16, 8, 6
ARGS = ("mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "slot_indices", "out")


def make_inputs(*, B=B, H=H, HV=HV, K=K, V=V, slots=SLOTS, seed=0):
    """A valid packed-decode call (dict of the native arguments, in order)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "mixed_qkv": torch.randn(B, 2 * H * K + HV * V, generator=gen),
        "a": torch.randn(B, HV * K, generator=gen),
        "b": torch.randn(B, HV, generator=gen),
        "A_log": torch.rand(HV, generator=gen) * 2 - 1,
        "dt_bias": torch.randn(HV * K, generator=gen) * 0.5,
        "state": torch.randn(slots, HV, V, K, generator=gen) * 0.5,
        "slot_indices": torch.tensor([4, -1, 1, 0, 2, 3][:B], dtype=torch.int32),
        "out": torch.full((B, 1, HV, V), POISON),
    }


def call_native(t, **kw):
    return kdakit.packed_decode(*(t[n] for n in ARGS), **kw)


def call_sglang(t, **kw):
    return fused_recurrent_kda_packed_decode(
        t["mixed_qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], None, t["state"], t["out"],
        t["slot_indices"], **kw)


APIS = [pytest.param(call_native, id="native"), pytest.param(call_sglang, id="sglang")]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage (gaps between interleaved slots included)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t, (n,), (1,), 0).clone().view(torch.uint8)


def snapshot(t: dict) -> dict:
    return {n: _storage_bytes(x) for n, x in t.items()
            if isinstance(x, torch.Tensor) and x.device.type != "meta"}


def assert_unchanged(t: dict, snap: dict) -> None:
    for n, before in snap.items():
        assert torch.equal(_storage_bytes(t[n]), before), f"`{n}` changed although the call raised"


def expect_error(api, t, expected, *, exact=True, **kw):
    """``api`` raises ValueError (exact text, or all substrings) and touches no buffer."""
    snap = snapshot(t)
    with pytest.raises(ValueError) as excinfo:
        api(t, **kw)
    msg = str(excinfo.value)
    if exact:
        assert msg == expected
    else:
        for part in expected:
            assert part in msg, f"{part!r} not in {msg!r}"
    assert_unchanged(t, snap)
    return msg


# ----------------------------------------------------------------------------
# Breakers: each changes exactly one thing of a valid call.
# ----------------------------------------------------------------------------
def noncontig_last(x: torch.Tensor) -> torch.Tensor:
    """Same shape and values, stride(-1) == 2."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def set_(name, fn):
    def brk(t):
        t[name] = fn(t[name])
    return brk


def mixed_1d(t):
    t["mixed_qkv"] = t["mixed_qkv"].flatten()


def mixed_noncontig(t):
    t["mixed_qkv"] = noncontig_last(t["mixed_qkv"])


def a_3d(t):
    t["a"] = t["a"].unsqueeze(1)


def b_1d(t):
    t["b"] = t["b"].flatten()


def a_noncontig(t):
    t["a"] = noncontig_last(t["a"])


def b_noncontig(t):
    t["b"] = noncontig_last(t["b"])


def alog_2d(t):
    t["A_log"] = t["A_log"].unsqueeze(0)


def dtbias_2d(t):
    t["dt_bias"] = t["dt_bias"].view(HV, K)


def alog_noncontig(t):
    t["A_log"] = noncontig_last(t["A_log"])


def dtbias_noncontig(t):
    t["dt_bias"] = noncontig_last(t["dt_bias"])


def idx_2d(t):
    t["slot_indices"] = t["slot_indices"].unsqueeze(1)


def out_noncontig(t):
    t["out"] = noncontig_last(t["out"])


def out_meta(t):
    t["out"] = torch.empty(t["out"].shape, device="meta")


def a_batch(t):
    t["a"] = torch.cat([t["a"], t["a"][:1]])


def b_batch(t):
    t["b"] = t["b"][:2]


def idx_len(t):
    t["slot_indices"] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)


def state_3d(t):
    t["state"] = t["state"][0]


def state_noncontig(t):
    # [slots, HV, V, K] view of a [slots, HV, K, V] buffer: the K != V transposed layout.
    t["state"] = t["state"].transpose(-1, -2).contiguous().transpose(-1, -2)


def a_width(t):
    t["a"] = torch.randn(B, HV * K + 1)


def b_width(t):
    t["b"] = torch.randn(B, HV + 1)


def alog_len(t):
    t["A_log"] = torch.zeros(HV + 1)


def dtbias_len(t):
    t["dt_bias"] = torch.zeros(HV * K - 1)


def out_shape(t):
    t["out"] = torch.full((B, HV, V), POISON)


def out_shape_kv(t):  # the transposed out a K/V mix-up would produce
    t["out"] = torch.full((B, 1, HV, K), POISON)


def mixed_odd(t):
    t["mixed_qkv"] = torch.randn(B, 2 * H * K + HV * V + 1)


def mixed_no_qk(t):
    t["mixed_qkv"] = torch.randn(B, HV * V)


def mixed_q_size(t):
    t["mixed_qkv"] = torch.randn(B, 2 * (H * K + 4) + HV * V)


def mixed_heads(t):  # H = 3 does not divide HV = 4
    t["mixed_qkv"] = torch.randn(B, 2 * 3 * K + HV * V)


def both(*fns):
    def brk(t):
        for fn in fns:
            fn(t)
    return brk


Q_SIZE_MSG = ("Invalid packed Q size {q}: must be divisible by K={K}. KDA packed decode requires "
              "num_q_heads == num_k_heads and head_q_dim == head_k_dim.")

# (id, breaker, exact expected message), in SPEC order.
SPEC_CASES = [
    ("mixed_qkv-1d", mixed_1d, "`mixed_qkv` must be a 2D tensor (got ndim=1)."),
    ("mixed_qkv-3d", set_("mixed_qkv", lambda x: x.unsqueeze(0)), "`mixed_qkv` must be a 2D tensor (got ndim=3)."),
    ("mixed_qkv-noncontig", mixed_noncontig, "`mixed_qkv` must be contiguous in the last dim."),
    ("a-3d", a_3d, "`a` and `b` must be 2D tensors (got a.ndim=3, b.ndim=2)."),
    ("b-1d", b_1d, "`a` and `b` must be 2D tensors (got a.ndim=2, b.ndim=1)."),
    ("a-noncontig", a_noncontig, "`a`/`b` must be contiguous in the last dim."),
    ("b-noncontig", b_noncontig, "`a`/`b` must be contiguous in the last dim."),
    ("A_log-2d", alog_2d, "`A_log`/`dt_bias` must be 1D tensors."),
    ("dt_bias-2d", dtbias_2d, "`A_log`/`dt_bias` must be 1D tensors."),
    ("A_log-noncontig", alog_noncontig, "`A_log`/`dt_bias` must be contiguous."),
    ("dt_bias-noncontig", dtbias_noncontig, "`A_log`/`dt_bias` must be contiguous."),
    ("indices-2d", idx_2d, "`ssm_state_indices` must be 1D for packed decode (got ndim=2)."),
    ("out-noncontig", out_noncontig, "`out` must be contiguous."),
    ("out-other-device", out_meta, "All inputs must be on the same device."),
    ("a-batch", a_batch, f"Mismatched batch sizes: mixed_qkv.shape[0]={B}, a.shape[0]={B + 1}, b.shape[0]={B}."),
    ("b-batch", b_batch, f"Mismatched batch sizes: mixed_qkv.shape[0]={B}, a.shape[0]={B}, b.shape[0]=2."),
    ("indices-len", idx_len, f"`ssm_state_indices` must have shape [B] (got (4,); expected ({B},))."),
    ("state-3d", state_3d, "`initial_state` must be a 4D tensor (got ndim=3)."),
    ("state-noncontig", state_noncontig, "`initial_state` must be contiguous in the last dim."),
    ("a-shape", a_width, f"`a` must have shape [B, HV*K] with HV={HV}, K={K} (got a.shape=({B}, {HV * K + 1}))."),
    ("b-shape", b_width, f"`b` must have shape [B, HV] with HV={HV} (got b.shape=({B}, {HV + 1}))."),
    ("A_log-numel", alog_len, f"`A_log` must have {HV} elements (got {HV + 1})."),
    ("dt_bias-numel", dtbias_len, f"`dt_bias` must have {HV * K} elements (got {HV * K - 1})."),
    ("out-3d", out_shape, f"`out` must have shape ({B}, 1, {HV}, {V}) (got out.shape=({B}, {HV}, {V}))."),
    ("out-K-for-V", out_shape_kv, f"`out` must have shape ({B}, 1, {HV}, {V}) (got out.shape=({B}, 1, {HV}, {K}))."),
    ("mixed_qkv-odd-width", mixed_odd, f"Invalid packed `mixed_qkv` last dim={2 * H * K + HV * V + 1} for HV={HV}, V={V}."),
    ("mixed_qkv-no-qk", mixed_no_qk, f"Invalid packed `mixed_qkv` last dim={HV * V} for HV={HV}, V={V}."),
    ("mixed_qkv-q-size", mixed_q_size, Q_SIZE_MSG.format(q=H * K + 4, K=K)),
    ("mixed_qkv-head-config", mixed_heads, f"Invalid head config inferred from mixed_qkv: H=3, HV={HV}."),
]

# Two faults at once: the earlier check in SPEC order wins.
ORDER_CASES = [
    ("mixed_qkv-1d+a-3d", both(a_3d, mixed_1d), "`mixed_qkv` must be a 2D tensor (got ndim=1)."),
    ("mixed_qkv-noncontig+b-1d", both(b_1d, mixed_noncontig), "`mixed_qkv` must be contiguous in the last dim."),
    ("a-3d+a-noncontig-b", both(b_noncontig, a_3d), "`a` and `b` must be 2D tensors (got a.ndim=3, b.ndim=2)."),
    ("a-noncontig+A_log-2d", both(alog_2d, a_noncontig), "`a`/`b` must be contiguous in the last dim."),
    ("dt_bias-2d+A_log-noncontig", both(alog_noncontig, dtbias_2d), "`A_log`/`dt_bias` must be 1D tensors."),
    ("A_log-noncontig+indices-2d", both(idx_2d, alog_noncontig), "`A_log`/`dt_bias` must be contiguous."),
    ("indices-2d+out-noncontig", both(out_noncontig, idx_2d), "`ssm_state_indices` must be 1D for packed decode (got ndim=2)."),
    ("out-noncontig+a-batch", both(a_batch, out_noncontig), "`out` must be contiguous."),
    ("other-device+a-batch", both(a_batch, out_meta), "All inputs must be on the same device."),
    ("a-batch+indices-len", both(idx_len, a_batch), f"Mismatched batch sizes: mixed_qkv.shape[0]={B}, a.shape[0]={B + 1}, b.shape[0]={B}."),
    ("indices-len+state-3d", both(state_3d, idx_len), f"`ssm_state_indices` must have shape [B] (got (4,); expected ({B},))."),
    ("state-3d+a-shape", both(a_width, state_3d), "`initial_state` must be a 4D tensor (got ndim=3)."),
    ("state-noncontig+a-shape", both(a_width, state_noncontig), "`initial_state` must be contiguous in the last dim."),
    ("a-shape+b-shape", both(b_width, a_width), f"`a` must have shape [B, HV*K] with HV={HV}, K={K} (got a.shape=({B}, {HV * K + 1}))."),
    ("b-shape+A_log-numel", both(alog_len, b_width), f"`b` must have shape [B, HV] with HV={HV} (got b.shape=({B}, {HV + 1}))."),
    ("A_log-numel+dt_bias-numel", both(dtbias_len, alog_len), f"`A_log` must have {HV} elements (got {HV + 1})."),
    ("dt_bias-numel+out-shape", both(out_shape, dtbias_len), f"`dt_bias` must have {HV * K} elements (got {HV * K - 1})."),
    ("out-shape+mixed_qkv-width", both(mixed_odd, out_shape), f"`out` must have shape ({B}, 1, {HV}, {V}) (got out.shape=({B}, {HV}, {V}))."),
]


def _params(cases):
    return [pytest.param(brk, msg, id=cid) for cid, brk, msg in cases]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("breaker,expected", _params(SPEC_CASES))
def test_spec_error_text(api, breaker, expected):
    t = make_inputs()
    breaker(t)
    expect_error(api, t, expected)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("breaker,expected", _params(ORDER_CASES))
def test_spec_error_order(api, breaker, expected):
    t = make_inputs()
    breaker(t)
    expect_error(api, t, expected)


@pytest.mark.parametrize("api", APIS)
def test_valid_call_runs(api):
    """The base call of every case is valid: it runs and writes out and the live slots."""
    t = make_inputs()
    before = t["state"].clone()
    api(t)
    assert torch.isfinite(t["out"]).all() and (t["out"].abs() < 1e29).all()
    assert torch.equal(t["out"][1], torch.zeros_like(t["out"][1])), "padding row must be zero"
    assert not torch.equal(t["state"][4], before[4])
    assert torch.equal(t["state"][[3, 5]], before[[3, 5]])


def test_native_default_out_error_text():
    """Native call without ``out``: the same texts (out is allocated only after a valid layout)."""
    t = make_inputs()
    mixed_1d(t)
    del t["out"]
    snap = snapshot(t)
    with pytest.raises(ValueError) as excinfo:
        kdakit.packed_decode(*(t[n] for n in ARGS[:-1]))
    assert str(excinfo.value) == "`mixed_qkv` must be a 2D tensor (got ndim=1)."
    assert_unchanged(t, snap)


@pytest.mark.parametrize("K_,V_,ok", [
    pytest.param(24, 8, False, id="K24-nonpow2"),
    pytest.param(16, 40, False, id="V40-nonpow2"),
    pytest.param(16, 8, True, id="K16-V8-pow2"),
])
def test_helion_pow2_check(K_, V_, ok):
    t = make_inputs(K=K_, V=V_)
    args = (t["mixed_qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], t["state"], t["out"], t["slot_indices"])
    if ok:
        assert check_packed_decode(*args, helion=True) == H
        return
    with pytest.raises(ValueError) as excinfo:
        check_packed_decode(*args, helion=True)
    assert str(excinfo.value) == ("Helion KDA decode requires power-of-two key and value head dimensions "
                                  f"(got K={K_}, V={V_}).")
    # Helion's check sits after the state-pool checks and before the `a` shape check.
    a_width(t)
    with pytest.raises(ValueError, match=r"^Helion KDA decode requires power-of-two"):
        check_packed_decode(t["mixed_qkv"], t["a"], *args[2:], helion=True)
    state_3d(t)
    with pytest.raises(ValueError, match=r"^`initial_state` must be a 4D tensor"):
        check_packed_decode(t["mixed_qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], t["state"],
                            t["out"], t["slot_indices"], helion=True)


# ----------------------------------------------------------------------------
# Checks beyond SPEC's list: clear ValueError, buffers untouched.
# ----------------------------------------------------------------------------
def dtype_breaker(name, dtype):
    def brk(t):
        t[name] = t[name].to(dtype)
    return brk


def state_inner_permuted(t):
    # HV and V swapped in memory: last dim contiguous, inner dims not.
    t["state"] = t["state"].transpose(1, 2).contiguous().transpose(1, 2)


def state_slot_stride_zero(t):
    t["state"] = t["state"][:1].expand(SLOTS, HV, V, K)


def state_slot_stride_small(t):
    flat = torch.randn(SLOTS * HV * V * K)
    t["state"] = flat.as_strided((SLOTS, HV, V, K), (HV * V * K - K, V * K, K, 1))


EXTRA_CASES = [
    ("mixed_qkv-int32", dtype_breaker("mixed_qkv", torch.int32), ["`mixed_qkv`", "torch.int32"]),
    ("mixed_qkv-float64", dtype_breaker("mixed_qkv", torch.float64), ["`mixed_qkv`", "torch.float64"]),
    ("a-int64", dtype_breaker("a", torch.int64), ["`a`", "torch.int64"]),
    ("b-float64", dtype_breaker("b", torch.float64), ["`b`", "torch.float64"]),
    ("out-int32", dtype_breaker("out", torch.int32), ["`out`", "torch.int32"]),
    ("A_log-int32", dtype_breaker("A_log", torch.int32), ["`A_log`", "torch.int32"]),
    ("dt_bias-float64", dtype_breaker("dt_bias", torch.float64), ["`dt_bias`", "torch.float64"]),
    ("state-float64", dtype_breaker("state", torch.float64), ["`initial_state`", "torch.float64"]),
    ("state-int32", dtype_breaker("state", torch.int32), ["`initial_state`", "torch.int32"]),
    ("indices-float32", dtype_breaker("slot_indices", torch.float32), ["`ssm_state_indices`", "torch.float32"]),
    ("indices-int16", dtype_breaker("slot_indices", torch.int16), ["`ssm_state_indices`", "torch.int16"]),
    ("state-inner-permuted", state_inner_permuted, ["`initial_state`", "contiguous inner dims", f"{(SLOTS, HV, V, K)}"]),
    ("state-slot-stride-0", state_slot_stride_zero, ["`initial_state`", "slot stride", f"(0, {V * K}, {K}, 1)"]),
    ("state-slot-stride-small", state_slot_stride_small, ["`initial_state`", "slot stride", f"({HV * V * K - K}, "]),
]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("breaker,parts", _params(EXTRA_CASES))
def test_extra_checks(api, breaker, parts):
    t = make_inputs()
    breaker(t)
    expect_error(api, t, parts, exact=False)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("K_,V_", [pytest.param(264, 8, id="K264"), pytest.param(16, 260, id="V260")])
def test_head_dims_over_256(api, K_, V_):
    t = make_inputs(H=1, HV=1, K=K_, V=V_, slots=4)
    expect_error(api, t, ["head dims", "256", f"K={K_}", f"V={V_}"], exact=False)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("lb", [0.0, 0.5, -5.01, -6.0, float("nan")], ids=lambda x: f"lb={x}")
def test_lower_bound_out_of_range(api, lb):
    t = make_inputs()
    expect_error(api, t, ["`lower_bound`", "[-5, 0)", f"got {lb}"], exact=False, lower_bound=lb)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("lb", [-5.0, -1.0, -1e-3])
def test_lower_bound_in_range_runs(api, lb):
    t = make_inputs()
    api(t, lower_bound=lb)
    assert torch.isfinite(t["out"]).all() and (t["out"].abs() < 1e29).all()


@pytest.mark.parametrize("api", APIS)
def test_interleaved_pool_accepted(api):
    """A slot stride > HV*V*K (layers interleaved) passes the pool checks; the gaps stay bitwise."""
    inner = HV * V * K
    t = make_inputs()
    flat = torch.randn(SLOTS * 2 * inner)
    t["state"] = flat.as_strided((SLOTS, HV, V, K), (2 * inner, V * K, K, 1))
    flat_before = flat.clone()
    api(t)
    gap = torch.ones(SLOTS * 2 * inner, dtype=torch.bool)
    for s in range(SLOTS):
        gap[s * 2 * inner: s * 2 * inner + inner] = False
    assert torch.equal(flat[gap], flat_before[gap]), "bytes between slots must stay bitwise"
    assert not torch.equal(flat, flat_before), "live slots must be updated"


def test_spec_error_wins_over_extra_check():
    """A SPEC-listed fault is reported even when an extra check (dtype) would also fail."""
    t = make_inputs()
    dtype_breaker("a", torch.int64)(t)
    b_width(t)
    expect_error(call_sglang, t, f"`b` must have shape [B, HV] with HV={HV} (got b.shape=({B}, {HV + 1})).")


# ----------------------------------------------------------------------------
# Full-check mode: data checks (one sync), off by default.
# ----------------------------------------------------------------------------
def slots_(*vals):
    def brk(t):
        t["slot_indices"] = torch.tensor(vals, dtype=t["slot_indices"].dtype)
    return brk


def nonfinite(name, pos, val):
    def brk(t):
        t[name][pos] = val
    return brk


FULL_CASES = [
    ("slot-out-of-range", slots_(0, SLOTS, 2), ["`ssm_state_indices`", f"slot {SLOTS}", f"{SLOTS} slots"]),
    ("slot-far-out-of-range", slots_(-1, 1, 1000), ["`ssm_state_indices`", "slot 1000", f"{SLOTS} slots"]),
    ("slot-duplicate", slots_(2, 5, 2), ["`ssm_state_indices`", "same live slot twice"]),
    ("A_log-nan", nonfinite("A_log", 1, float("nan")), ["`A_log`", "non-finite"]),
    ("A_log-inf", nonfinite("A_log", 0, float("inf")), ["`A_log`", "non-finite"]),
    ("dt_bias-nan", nonfinite("dt_bias", 7, float("nan")), ["`dt_bias`", "non-finite"]),
    ("dt_bias-neg-inf", nonfinite("dt_bias", 3, float("-inf")), ["`dt_bias`", "non-finite"]),
]


def _full_arg(t, **kw):
    return call_native(t, full_checks=True, **kw)


def _full_env_native(t, **kw):
    return call_native(t, **kw)


def _full_env_sglang(t, **kw):
    return call_sglang(t, **kw)


@pytest.mark.parametrize("breaker,parts", _params(FULL_CASES))
def test_full_checks_argument(breaker, parts, monkeypatch):
    monkeypatch.delenv("KDAKIT_CHECKS", raising=False)
    t = make_inputs()
    breaker(t)
    expect_error(_full_arg, t, parts, exact=False)


@pytest.mark.parametrize("api", [pytest.param(_full_env_native, id="native"),
                                 pytest.param(_full_env_sglang, id="sglang")])
@pytest.mark.parametrize("breaker,parts", _params(FULL_CASES))
def test_full_checks_env(api, breaker, parts, monkeypatch):
    monkeypatch.setenv("KDAKIT_CHECKS", "full")
    t = make_inputs()
    breaker(t)
    expect_error(api, t, parts, exact=False)


def test_full_checks_shape_error_first(monkeypatch):
    """Data checks run after the shape checks: a shape fault is reported, not the bad slot."""
    monkeypatch.setenv("KDAKIT_CHECKS", "full")
    t = make_inputs()
    slots_(0, SLOTS, 2)(t)
    b_width(t)
    expect_error(call_sglang, t, f"`b` must have shape [B, HV] with HV={HV} (got b.shape=({B}, {HV + 1})).")


@pytest.mark.parametrize("mode", ["arg", "env"])
def test_full_checks_accept_valid_and_padding(mode, monkeypatch):
    """Repeated padding rows (-1) are not live slots; a valid call passes full checks."""
    if mode == "env":
        monkeypatch.setenv("KDAKIT_CHECKS", "full")
    else:
        monkeypatch.delenv("KDAKIT_CHECKS", raising=False)
    t = make_inputs()
    slots_(-1, 5, -1)(t)
    call_native(t, full_checks=True if mode == "arg" else None)
    assert torch.equal(t["out"][[0, 2]], torch.zeros_like(t["out"][[0, 2]]))


@pytest.mark.parametrize("api", APIS)
def test_duplicate_slot_not_checked_by_default(api, monkeypatch):
    """Default mode skips only the data checks: a duplicate live slot does not raise."""
    monkeypatch.delenv("KDAKIT_CHECKS", raising=False)
    t = make_inputs()
    slots_(2, 5, 2)(t)
    api(t)
    assert (t["out"].abs() < 1e29).all()


def test_full_checks_false_overrides_env(monkeypatch):
    monkeypatch.setenv("KDAKIT_CHECKS", "full")
    t = make_inputs()
    slots_(2, 5, 2)(t)
    call_native(t, full_checks=False)


def test_non_finite_not_checked_by_default(monkeypatch):
    monkeypatch.delenv("KDAKIT_CHECKS", raising=False)
    t = make_inputs()
    t["A_log"][0] = float("nan")
    call_native(t)  # no ValueError: the data check is off


# ----------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cpu_defaults_to_reference(monkeypatch):
    monkeypatch.delenv("KDAKIT_BACKEND", raising=False)
    name, impl = backends.select("packed_decode", CPU)
    assert name == "reference"
    assert impl is backends._IMPLS["packed_decode"]["reference"]


def test_cuda_defaults_to_triton(monkeypatch):
    monkeypatch.delenv("KDAKIT_BACKEND", raising=False)
    assert backends.select("packed_decode", CUDA)[0] == "triton"


@pytest.mark.parametrize("value", ["reference", "REFERENCE", " reference "])
@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
def test_env_forces_reference(value, device, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", value)
    assert backends.select("packed_decode", device)[0] == "reference"


def test_env_forces_triton_on_interpreted_cpu(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.select("packed_decode", CPU)[0] == "triton"


def test_env_unknown_backend(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "cutlass")
    with pytest.raises(ValueError, match=re.escape("KDAKIT_BACKEND='cutlass' is not a kdakit backend")):
        backends.select("packed_decode", CPU)
    # Through the op: ValueError, and nothing written.
    t = make_inputs()
    expect_error(call_native, t, ["KDAKIT_BACKEND", "cutlass"], exact=False)


def test_helion_registered_but_needs_cuda_or_helion_interpret(monkeypatch):
    """The helion backend (issue 6) is registered; plain CPU tensors are refused, and
    TRITON_INTERPRET=1 does not enable it (HELION_INTERPRET=1 does)."""
    monkeypatch.delenv("KDAKIT_BACKEND", raising=False)
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "helion" in backends.available("packed_decode")
    assert backends.select("packed_decode", CUDA, "helion")[0] == "helion"
    with pytest.raises(ValueError, match=r"needs CUDA tensors, or CPU tensors with HELION_INTERPRET=1"):
        backends.select("packed_decode", CPU, "helion")
    t = make_inputs()
    expect_error(call_native, t, ["needs CUDA tensors", "HELION_INTERPRET=1"], exact=False, backend="helion")


def test_unknown_backend_argument(monkeypatch):
    monkeypatch.delenv("KDAKIT_BACKEND", raising=False)
    with pytest.raises(ValueError):
        backends.select("packed_decode", CPU, "cutlass")


def test_triton_on_plain_cpu_refused(monkeypatch):
    monkeypatch.delenv("KDAKIT_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        backends.select("packed_decode", CPU, "triton")


def test_reference_backend_argument_runs(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")  # the argument wins over the env
    assert backends.select("packed_decode", CPU, "reference")[0] == "reference"
