"""Gated RMSNorm over the last dim: ``y = x · rsqrt(mean(x²) + eps) · w · sigmoid(gate)``.

``x, gate [..., V]`` (float32/bfloat16/float16, last dim contiguous, leading dims any
strides that collapse into at most two row groups), ``weight [V]`` float32; ``out``
has ``x``'s shape. Math in float32, one rounding at the store.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .. import reference
from ..backends import register, select
from ..contracts import (_shape, check_finite, check_float_dtype, check_last_dim_contiguous, check_non_overlapping,
                         check_same_device, full_checks_enabled)
from .launch import CachedKernel, cdiv, next_power_of_2
from .registry import example_rand, example_randn, example_rng, kdakit_op
from .triton_math import gated_rmsnorm_tile


@triton.jit
def _gated_rmsnorm_kernel(
    x, gate, weight, out,
    num_rows, rows_inner, stride_x_outer, stride_x_inner, stride_gate_outer, stride_gate_inner,
    stride_out_outer, stride_out_inner, eps,
    V: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr, WAIT_FOR_X: tl.constexpr,
):
    # ROWS whole rows per program (V <= 16384 in registers), one pass over memory: fewer,
    # fuller programs than one per row once there are thousands of rows.
    # WAIT_FOR_X: a programmatic dependent launch after the kernel that writes x (the
    # decode of the unfused chain); gate and weight load while it finishes.
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    r_outer, r_inner = r // rows_inner, r % rows_inner
    offs = tl.arange(0, BLOCK_V)
    mask = (r < num_rows)[:, None] & (offs < V)[None, :]
    gr = tl.load(gate + (r_outer * stride_gate_outer + r_inner * stride_gate_inner)[:, None] + offs[None, :],
                 mask=mask, other=0.0)
    w = tl.load(weight + offs, mask=offs < V, other=0.0)
    if WAIT_FOR_X:
        gdc_wait()
    xr = tl.load(x + (r_outer * stride_x_outer + r_inner * stride_x_inner)[:, None] + offs[None, :], mask=mask,
                 other=0.0)
    y = gated_rmsnorm_tile(xr.to(tl.float32), gr.to(tl.float32), w, eps, V)
    tl.store(out + (r_outer * stride_out_outer + r_inner * stride_out_inner)[:, None] + offs[None, :],
             y.to(out.dtype.element_ty), mask=mask)


_gated_rmsnorm = CachedKernel(_gated_rmsnorm_kernel)


@dataclass(frozen=True)
class GatedRMSNormConfig:
    """Launch configuration of one call (``gated_rmsnorm_config`` picks it from the shapes)."""
    rows: int = 1           # rows per program
    num_warps: int = 1


def gated_rmsnorm_config(V: int, rows: int) -> GatedRMSNormConfig:
    """Pinned: ~8 elements a thread, 1..8 warps. One row a program up
    to 2048 rows, 8 rows a program beyond (the decode step's norm on the H200,
    fused_decode_norm_rows_h200.json: N = 512 requests x 32 heads 575.7 us against 587.1
    for the step, N = 128 152.4 against 153.6; at 1024 rows and below one row a program
    was as fast or faster: N = 32 41.65 against 41.9-42.1)."""
    block_v = next_power_of_2(V)
    per_program = 8 if rows > 2048 and block_v <= 1024 else 1
    return GatedRMSNormConfig(rows=per_program, num_warps=min(8, max(1, per_program * block_v // 256)))


@register("gated_rmsnorm", "triton")
def gated_rmsnorm_triton(x, gate, weight, out, *, eps, groups, wait_for_x=False,
                         config: GatedRMSNormConfig | None = None):
    """``wait_for_x``: a programmatic dependent launch after the kernel that writes ``x``;
    ``config`` overrides the pinned choice (``gated_rmsnorm_config``; sweeps, tests)."""
    n_outer, n_inner, ((sxo, sxi), (sgo, sgi), (soo, soi)) = groups
    rows = n_outer * n_inner
    if rows == 0:
        return out
    V = x.shape[-1]
    cfg = config or gated_rmsnorm_config(V, rows)
    rows_per_program, num_warps = cfg.rows, cfg.num_warps
    _gated_rmsnorm(
        (cdiv(rows, rows_per_program), 1, 1),
        (x, gate, weight, out, rows, n_inner, sxo, sxi, sgo, sgi, soo, soi, float(eps)),
        dict(V=V, BLOCK_V=next_power_of_2(V), ROWS=rows_per_program, WAIT_FOR_X=bool(wait_for_x)),
        num_warps=num_warps, num_stages=1, launch_pdl=bool(wait_for_x))
    return out


def gated_rmsnorm_after(x, gate, weight, out, *, eps, wait_for_x, config: GatedRMSNormConfig | None = None):
    """The Triton norm of ``x``, an intermediate another kdakit kernel has just written
    (``wait_for_x``: launched as its programmatic dependent); shapes already valid."""
    groups = check_gated_rmsnorm(x, gate, weight, out, eps=eps, full_checks=False)
    return gated_rmsnorm_triton(x, gate, weight, out, eps=eps, groups=groups, wait_for_x=wait_for_x, config=config)


@register("gated_rmsnorm", "reference")
def gated_rmsnorm_reference(x, gate, weight, out, *, eps, groups):
    return reference.gated_rmsnorm_op(x, gate, weight, out, eps=eps)


def run_gated_rmsnorm(x, gate, weight, out, eps, groups, backend):
    """Dispatch after validation; ``groups`` as ``row_groups`` gives them."""
    _, impl = select("gated_rmsnorm", x.device, backend)
    impl(x, gate, weight, out, eps=eps, groups=groups)


def _schema_args(x, gate, weight, out, eps, groups, backend):
    """The custom op's arguments: ``groups`` as a flat int list."""
    (n_outer, n_inner, ((sxo, sxi), (sgo, sgi), (soo, soi))) = groups
    return x, gate, weight, out, eps, [n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi], backend


@kdakit_op("gated_rmsnorm", mutates=("out",), dispatch=run_gated_rmsnorm, flatten=_schema_args)
def gated_rmsnorm_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                     groups: list[int], backend: str | None) -> None:
    """``groups`` is ``row_groups`` flattened: ``[n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi]``."""
    n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi = groups
    run_gated_rmsnorm(x, gate, weight, out, eps, (n_outer, n_inner, ((sxo, sxi), (sgo, sgi), (soo, soi))), backend)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
MAX_NORM_DIM = 16384


def row_groups(shape: tuple, *tensors) -> tuple:
    """Rows of ``[..., D]`` tensors as ``(n_outer, n_inner, [(stride_outer, stride_inner) per tensor])``.

    The leading dims of every tensor must collapse into at most two strided groups at
    the same place (a contiguous ``[B, 1, HV, V]`` output and a gate sliced from a wider
    ``[B, HV*V + ...]`` projection both do). Returns None when they do not.
    """
    if any(n == 0 for n in shape[:-1]):
        return 0, 1, [(0, 0) for _ in tensors]
    lead = [d for d in range(len(shape) - 1) if shape[d] > 1]
    breaks = set()
    for t in tensors:
        for i in range(len(lead) - 1):
            outer, inner = lead[i], lead[i + 1]
            if t.stride(outer) != t.stride(inner) * t.shape[inner]:
                breaks.add(i)
    if len(breaks) > 1:
        return None
    if not lead:
        return 1, 1, [(0, 0) for _ in tensors]
    if breaks:
        cut = breaks.pop()
        outer_dims, inner_dims = lead[:cut + 1], lead[cut + 1:]
    else:
        outer_dims, inner_dims = [], lead
    n_outer = 1
    for d in outer_dims:
        n_outer *= shape[d]
    n_inner = 1
    for d in inner_dims:
        n_inner *= shape[d]
    strides = [(t.stride(outer_dims[-1]) if outer_dims else 0, t.stride(inner_dims[-1])) for t in tensors]
    return n_outer, n_inner, strides


def check_gated_rmsnorm(x, gate, weight, out, *, eps=1e-6, full_checks=None) -> tuple:
    """``x, gate, out [..., V]``, ``weight [V]`` float32. Returns ``row_groups`` of (x, gate, out)."""
    if not (x.dim() >= 1):
        raise ValueError(f"`x` must have at least 1 dim [..., V] (got ndim={x.dim()}).")
    V = x.shape[-1]
    for name, t in (("x", x), ("gate", gate), ("out", out)):
        check_float_dtype(name, t)
    check_same_device(x, gate, weight, out)
    if not (_shape(gate) == _shape(x)):
        raise ValueError(f"`gate` must have x's shape {_shape(x)} (got {_shape(gate)}).")
    if not (_shape(out) == _shape(x)):
        raise ValueError(f"`out` must have x's shape {_shape(x)} (got {_shape(out)}).")
    if not (weight.dim() == 1 and weight.shape[0] == V):
        raise ValueError(f"`weight` must have shape [V] = ({V},) (got {_shape(weight)}).")
    if not (weight.dtype == torch.float32):
        raise ValueError(f"`weight` must be float32 (got {weight.dtype}).")
    if not (weight.is_contiguous()):
        raise ValueError("`weight` must be contiguous.")
    if not (1 <= V <= MAX_NORM_DIM):
        raise ValueError(f"gated RMSNorm dim V must be in [1, {MAX_NORM_DIM}] (got V={V}).")
    for name, t in (("x", x), ("gate", gate), ("out", out)):
        check_last_dim_contiguous(name, t)
    check_non_overlapping("out", out)
    if not (float(eps) > 0.0):
        raise ValueError(f"`eps` must be > 0 (got {eps}).")
    groups = row_groups(_shape(x), x, gate, out)
    if groups is None:
        raise ValueError(f"the leading dims of `x`, `gate` and `out` (shape {_shape(x)}, strides "
                         f"{tuple(x.stride())}, {tuple(gate.stride())}, {tuple(out.stride())}) must collapse into "
                         "at most two strided row groups; pass .contiguous() copies of x and gate.")
    if full_checks_enabled(full_checks):
        check_finite(True, weight=weight)
    return groups


def gated_rmsnorm(x, gate, weight, *, eps=1e-6, out=None, backend=None, full_checks=None):
    """Gated RMSNorm of each row of ``x [..., V]`` with ``gate [..., V]`` and ``weight [V]`` float32.

    Returns ``out`` (``x``'s shape; allocated in ``x``'s dtype when not given).
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    groups = check_gated_rmsnorm(x, gate, weight, out, eps=eps, full_checks=full_checks)
    gated_rmsnorm_op(x, gate, weight, out, eps, groups, backend)
    return out


@gated_rmsnorm_op.register_example
def _example(seed, device="cpu", *, out=True):
    g = example_rng(seed)
    B, HV, V = 3, 2, 16
    bf16 = torch.bfloat16
    wide = example_randn(g, B, HV * V + 8, dtype=bf16, device=device)  # gate sliced from a wider projection
    args = (example_randn(g, B, 1, HV, V, dtype=bf16, device=device), wide[:, :HV * V].view(B, 1, HV, V),
            example_rand(g, V, device=device) + 0.5)
    kw = dict(eps=1e-5)
    if out:
        kw["out"] = torch.full((B, 1, HV, V), 7.0, dtype=bf16, device=device)
    return gated_rmsnorm, args, kw
