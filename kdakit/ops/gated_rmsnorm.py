"""Gated RMSNorm over the last dim: ``y = x · rsqrt(mean(x²) + eps) · w · sigmoid(gate)``.

``x, gate [..., V]`` (float32/bfloat16/float16, last dim contiguous, leading dims any
strides that collapse into at most two row groups), ``weight [V]`` float32; ``out``
has ``x``'s shape. Math in float32, one rounding at the store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .. import contracts, reference
from ..backends import register, select
from .launch import CachedKernel
from .triton_math import gated_rmsnorm_rows


@triton.jit
def _gated_rmsnorm_kernel(
    x, gate, weight, out,
    rows_inner, stride_x_outer, stride_x_inner, stride_gate_outer, stride_gate_inner,
    stride_out_outer, stride_out_inner, eps,
    V: tl.constexpr, BLOCK_V: tl.constexpr, WAIT_FOR_X: tl.constexpr,
):
    # One program per row: the whole row sits in registers (V <= 16384), one pass over memory.
    # WAIT_FOR_X: a programmatic dependent launch after the kernel that writes x (the
    # decode of the unfused chain); gate and weight load while it finishes.
    r = tl.program_id(0).to(tl.int64)
    r_outer, r_inner = r // rows_inner, r % rows_inner
    offs = tl.arange(0, BLOCK_V)
    mask = offs < V
    gr = tl.load(gate + r_outer * stride_gate_outer + r_inner * stride_gate_inner + offs, mask=mask, other=0.0)
    w = tl.load(weight + offs, mask=mask, other=0.0)
    if WAIT_FOR_X:
        gdc_wait()
    xr = tl.load(x + r_outer * stride_x_outer + r_inner * stride_x_inner + offs, mask=mask, other=0.0)
    y = gated_rmsnorm_rows(xr.to(tl.float32), gr.to(tl.float32), w, eps, V)
    tl.store(out + r_outer * stride_out_outer + r_inner * stride_out_inner + offs, y.to(out.dtype.element_ty),
             mask=mask)


_gated_rmsnorm = CachedKernel(_gated_rmsnorm_kernel)


def _launch_config(V: int) -> tuple:
    """(BLOCK_V, num_warps), pinned: the whole row, ~8 elements a thread, 1..8 warps."""
    block_v = triton.next_power_of_2(V)
    return block_v, min(8, max(1, block_v // 256))


@register("gated_rmsnorm", "triton")
def gated_rmsnorm_triton(x, gate, weight, out, *, eps, groups, wait_for_x=False):
    """``wait_for_x``: a programmatic dependent launch after the kernel that writes ``x``."""
    n_outer, n_inner, ((sxo, sxi), (sgo, sgi), (soo, soi)) = groups
    rows = n_outer * n_inner
    if rows == 0:
        return out
    V = x.shape[-1]
    block_v, num_warps = _launch_config(V)
    _gated_rmsnorm(
        (rows, 1, 1),
        (x, gate, weight, out, n_inner, sxo, sxi, sgo, sgi, soo, soi, float(eps)),
        dict(V=V, BLOCK_V=block_v, WAIT_FOR_X=bool(wait_for_x)), num_warps=num_warps, num_stages=1,
        launch_pdl=bool(wait_for_x))
    return out


def gated_rmsnorm_after(x, gate, weight, out, *, eps, wait_for_x):
    """The Triton norm of ``x``, an intermediate another kdakit kernel has just written
    (``wait_for_x``: launched as its programmatic dependent); shapes already valid."""
    groups = contracts.check_gated_rmsnorm(x, gate, weight, out, eps=eps, full_checks=False)
    return gated_rmsnorm_triton(x, gate, weight, out, eps=eps, groups=groups, wait_for_x=wait_for_x)


@register("gated_rmsnorm", "reference")
def gated_rmsnorm_reference(x, gate, weight, out, *, eps, groups):
    return reference.gated_rmsnorm_op(x, gate, weight, out, eps=eps)


def gated_rmsnorm(x, gate, weight, *, eps=1e-6, out=None, backend=None, full_checks=None):
    """Gated RMSNorm of each row of ``x [..., V]`` with ``gate [..., V]`` and ``weight [V]`` float32.

    Returns ``out`` (``x``'s shape; allocated in ``x``'s dtype when not given).
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    groups = contracts.check_gated_rmsnorm(x, gate, weight, out, eps=eps, full_checks=full_checks)
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor:  # traced: kdakit/custom_ops.py
        (n_outer, n_inner, ((sxo, sxi), (sgo, sgi), (soo, soi))) = groups
        torch.ops.kdakit.gated_rmsnorm(x, gate, weight, out, float(eps),
                                       [n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi], backend)
        return out
    _, impl = select("gated_rmsnorm", x.device, backend)
    return impl(x, gate, weight, out, eps=eps, groups=groups)
