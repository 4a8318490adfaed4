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

from .. import contracts, reference
from ..backends import register, select
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
    groups = contracts.check_gated_rmsnorm(x, gate, weight, out, eps=eps, full_checks=False)
    return gated_rmsnorm_triton(x, gate, weight, out, eps=eps, groups=groups, wait_for_x=wait_for_x, config=config)


@register("gated_rmsnorm", "reference")
def gated_rmsnorm_reference(x, gate, weight, out, *, eps, groups):
    return reference.gated_rmsnorm_op(x, gate, weight, out, eps=eps)


def run_gated_rmsnorm(x, gate, weight, out, eps, groups, backend):
    """Dispatch after validation; ``groups`` as ``contracts.row_groups`` gives them."""
    _, impl = select("gated_rmsnorm", x.device, backend)
    impl(x, gate, weight, out, eps=eps, groups=groups)


def _schema_args(x, gate, weight, out, eps, groups, backend):
    """The custom op's arguments: ``groups`` as a flat int list."""
    (n_outer, n_inner, ((sxo, sxi), (sgo, sgi), (soo, soi))) = groups
    return x, gate, weight, out, eps, [n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi], backend


@kdakit_op("gated_rmsnorm", mutates=("out",), dispatch=run_gated_rmsnorm, flatten=_schema_args)
def gated_rmsnorm_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                     groups: list[int], backend: str | None) -> None:
    """``groups`` is ``contracts.row_groups`` flattened: ``[n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi]``."""
    n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi = groups
    run_gated_rmsnorm(x, gate, weight, out, eps, (n_outer, n_inner, ((sxo, sxi), (sgo, sgi), (soo, soi))), backend)


def gated_rmsnorm(x, gate, weight, *, eps=1e-6, out=None, backend=None, full_checks=None):
    """Gated RMSNorm of each row of ``x [..., V]`` with ``gate [..., V]`` and ``weight [V]`` float32.

    Returns ``out`` (``x``'s shape; allocated in ``x``'s dtype when not given).
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    groups = contracts.check_gated_rmsnorm(x, gate, weight, out, eps=eps, full_checks=full_checks)
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
