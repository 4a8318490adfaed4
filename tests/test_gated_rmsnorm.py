"""gated_rmsnorm: both backends against the float64 reference over strided row layouts and
dtypes; validation errors leave every buffer untouched."""
import pytest
import torch

from kdakit import reference
from kdakit.ops.gated_rmsnorm import gated_rmsnorm

from helpers import POISON, assert_close, noncontig_last, setter, sweep

BACKENDS = ["reference", "triton"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def ref(x, gate, weight, eps=1e-6):
    out = torch.empty(x.shape, dtype=torch.float64)
    return reference.gated_rmsnorm_op(x.double(), gate.double(), weight.double(), out, eps=eps,
                                      compute_dtype=torch.float64)


def sliced_rows(gen, T, HV, V, dtype, pad=5):
    """``[T, HV, V]`` view of a wider ``[T, HV*V + pad]`` projection: two row groups."""
    return torch.randn(T, HV * V + pad, generator=gen).to(dtype)[:, pad:].view(T, HV, V)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", sweep([(5, 24), (2, 1, 3, 40), (7, 128), (3, 100), (1, 1), (6, 2, 1, 17)], keep=3, unpack=False),
                         ids=str)
@pytest.mark.parametrize("dtype", sweep([torch.float32, torch.bfloat16, torch.float16], keep=2), ids=str)
def test_shapes_and_dtypes(backend, shape, dtype):
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(shape, generator=gen).to(dtype)
    gate = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.rand(shape[-1], generator=gen) + 0.5
    out = torch.full(shape, POISON).to(dtype)
    assert gated_rmsnorm(x, gate, weight, out=out, backend=backend) is out
    assert_close(out, ref(x, gate, weight), 1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_gate_from_wider_projection(backend):
    gen = torch.Generator().manual_seed(1)
    T, HV, V = 4, 3, 24
    x = torch.randn(T, 1, HV, V, generator=gen)[:, 0]          # contiguous [T, HV, V]
    gate = sliced_rows(gen, T, HV, V, torch.float32)             # row groups (T: HV*V+5, HV: V)
    weight = torch.rand(V, generator=gen) + 0.5
    wide_out = torch.full((T, HV, V + 3), POISON)
    out = wide_out[..., :V]                                      # rows V+3 apart: one group
    gated_rmsnorm(x, gate, weight, out=out, eps=1e-5, backend=backend)
    assert_close(out, ref(x, gate, weight, eps=1e-5), 1e-6)
    assert (wide_out[..., V:] == POISON).all(), "bytes outside `out` must stay"


@pytest.mark.parametrize("config", sweep([(1, 1), (2, 1), (4, 2), (8, 4)], keep=2, unpack=False), ids=lambda c: "rows{}-warps{}".format(*c))
@pytest.mark.parametrize("V", [24, 128])
def test_rows_per_program(config, V):
    """Several rows a program (a row count that no ROWS divides, rows over two strided
    groups, a strided out): every row normed on its own, nothing written past the rows."""
    from kdakit.ops.gated_rmsnorm import GatedRMSNormConfig, check_gated_rmsnorm, gated_rmsnorm_triton
    gen = torch.Generator().manual_seed(5)
    T, HV = 7, 3
    x = torch.randn(T, HV, V, generator=gen).bfloat16()
    gate = sliced_rows(gen, T, HV, V, torch.bfloat16)
    weight = torch.rand(V, generator=gen) + 0.5
    wide_out = torch.full((T, HV, V + 3), POISON)
    out = wide_out[..., :V]
    groups = check_gated_rmsnorm(x, gate, weight, out, eps=1e-6)
    gated_rmsnorm_triton(x, gate, weight, out, eps=1e-6, groups=groups, config=GatedRMSNormConfig(*config))
    assert_close(out, ref(x, gate, weight), 1e-6)
    assert (wide_out[..., V:] == POISON).all(), "bytes outside `out` must stay"


def test_rows_per_program_pin():
    from kdakit.ops.gated_rmsnorm import GatedRMSNormConfig, gated_rmsnorm_config
    assert gated_rmsnorm_config(128, 1024) == GatedRMSNormConfig(rows=1, num_warps=1)   # one row a program up to 2048 rows
    assert gated_rmsnorm_config(128, 4096) == GatedRMSNormConfig(rows=8, num_warps=4)   # then 8 rows on 4 warps
    assert gated_rmsnorm_config(4096, 4096) == GatedRMSNormConfig(rows=1, num_warps=8)  # wide rows stay one a program


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_dtype_and_default_allocation(backend):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 16, generator=gen).bfloat16()
    gate = torch.randn(3, 2, 16, generator=gen).bfloat16()
    weight = torch.rand(16, generator=gen) + 0.5
    y = gated_rmsnorm(x, gate, weight, backend=backend)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    out = torch.full((3, 2, 16), POISON)
    gated_rmsnorm(x, gate, weight, out=out, backend=backend)  # float32 out of bf16 inputs: no extra rounding
    assert_close(out, ref(x, gate, weight), 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows(backend):
    x = torch.empty(0, 16)
    assert gated_rmsnorm(x, x, torch.ones(16), backend=backend).shape == (0, 16)


def test_triton_matches_reference_float32_path_closely():
    gen = torch.Generator().manual_seed(3)
    x, gate = torch.randn(9, 64, generator=gen), torch.randn(9, 64, generator=gen)
    weight = torch.rand(64, generator=gen) + 0.5
    a = gated_rmsnorm(x, gate, weight, backend="triton")
    b = gated_rmsnorm(x, gate, weight, backend="reference")
    assert_close(a, b, 1e-6)


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------
def valid_call():
    gen = torch.Generator().manual_seed(4)
    return {"x": torch.randn(4, 2, 16, generator=gen), "gate": torch.randn(4, 2, 16, generator=gen),
            "weight": torch.rand(16, generator=gen) + 0.5, "out": torch.full((4, 2, 16), POISON)}


def three_row_groups(t):
    """Leading dims that collapse into three strided groups: no single (outer, inner) row split."""
    t["x"] = torch.randn(2, 2, 2, 16)
    t["out"] = torch.full((2, 2, 2, 16), POISON)
    t["gate"] = torch.randn(2, 3, 2, 3, 2, 17)[:, 0, :, 0, :, :16]


def gate_two_row_groups_is_fine():
    t = valid_call()
    t["gate"] = torch.randn(4, 3, 2, 17)[:, 1, :, :16]
    return t


BREAKERS = [
    ("x-0d", setter("x", lambda x: x[0, 0, 0]), ["`x`", "ndim=0"]),
    ("x-int", setter("x", lambda x: x.to(torch.int32)), ["`x`", "torch.int32"]),
    ("gate-float64", setter("gate", lambda g: g.double()), ["`gate`", "torch.float64"]),
    ("out-int", setter("out", lambda o: o.to(torch.int64)), ["`out`", "torch.int64"]),
    ("gate-shape", setter("gate", lambda g: g[:3]), ["`gate`", "(4, 2, 16)", "(3, 2, 16)"]),
    ("out-shape", setter("out", lambda o: o[:, :1]), ["`out`", "(4, 2, 16)", "(4, 1, 16)"]),
    ("weight-shape", setter("weight", lambda w: torch.ones(8)), ["`weight`", "(16,)", "(8,)"]),
    ("weight-bf16", setter("weight", lambda w: w.bfloat16()), ["`weight`", "float32"]),
    ("weight-noncontig", setter("weight", noncontig_last), ["`weight`", "contiguous"]),
    ("x-noncontig-last", setter("x", noncontig_last), ["`x`", "contiguous in the last dim"]),
    ("out-noncontig-last", setter("out", noncontig_last), ["`out`", "contiguous in the last dim"]),
    ("out-overlapping", setter("out", lambda o: o[:1].expand(4, 2, 16)), ["`out`", "overlapping"]),
    ("gate-three-row-groups", three_row_groups, ["row groups"]),
    ("out-other-device", setter("out", lambda o: torch.empty(o.shape, device="meta")), ["same device"]),
]


@pytest.mark.parametrize("breaker,parts", [pytest.param(b, p, id=i) for i, b, p in BREAKERS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_errors_leave_buffers_untouched(breaker, parts, backend):
    t = valid_call()
    breaker(t)
    snap = {n: bits(x).clone() for n, x in t.items() if x.device.type != "meta"}
    with pytest.raises(ValueError) as excinfo:
        gated_rmsnorm(t["x"], t["gate"], t["weight"], out=t["out"], backend=backend)
    for part in parts:
        assert part in str(excinfo.value), f"{part!r} not in {str(excinfo.value)!r}"
    for n, before in snap.items():
        assert torch.equal(bits(t[n]), before), f"`{n}` changed although the call raised"


def test_bad_eps_and_full_checks():
    t = valid_call()
    with pytest.raises(ValueError, match="`eps` must be > 0"):
        gated_rmsnorm(t["x"], t["gate"], t["weight"], out=t["out"], eps=0.0)
    t["weight"][3] = float("nan")
    with pytest.raises(ValueError, match="`weight` holds non-finite"):
        gated_rmsnorm(t["x"], t["gate"], t["weight"], out=t["out"], full_checks=True)
    assert (t["out"] == POISON).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gate_in_two_row_groups_runs(backend):
    t = gate_two_row_groups_is_fine()
    gated_rmsnorm(t["x"], t["gate"], t["weight"], out=t["out"], backend=backend)
    assert_close(t["out"], ref(t["x"], t["gate"], t["weight"]), 1e-6)
