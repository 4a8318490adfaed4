"""The 16 x 16 diagonal blocks of ``chunk_prefill``'s ``(I + A)^-1``, one warp per block.

``A`` (β-scaled, strictly lower; ``chunk_prefill``) sits in the prep's workspace, a
``[C, C]`` matrix per (chunk, value head). Each program inverts one diagonal block
``I + A_ii`` by forward substitution in registers and writes the inverse over ``A_ii``; the
prep launch after it builds the blocks below the diagonal from these
(``chunk_prefill._invert_unit_lower*`` with ``DIAGONAL_INVERTED``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .launch import CachedKernel


@triton.jit
def _invert_unit_lower_16(a):
    """``(I + a)^-1`` of a strictly lower 16 x 16 register tile, row by row (forward
    substitution: row r is e_r minus row r of ``a`` times the rows above it)."""
    offs = tl.arange(0, 16)
    rows = offs[:, None] + offs[None, :] * 0
    inv = tl.where(rows == offs[None, :], 1.0, 0.0)
    for r in range(1, 16):
        a_r = tl.sum(tl.where(rows == r, a, 0.0), axis=0)
        new = tl.where(offs == r, 1.0, 0.0) - tl.sum(a_r[:, None] * inv, axis=0)
        inv = tl.where(rows == r, new[None, :], inv)
    return inv


@triton.jit
def _diagonal_inverse_kernel(ws_a, HV: tl.constexpr, C: tl.constexpr):
    # One warp per diagonal block: the substitution's reductions stay within the warp
    # (shuffles, no barrier), where a chunk's program of four warps waits on shared memory
    # at each of the 15 steps.
    i_c, i_hv, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = tl.arange(0, 16)
    p = ws_a + (i_c.to(tl.int64) * HV + i_hv) * C * C + (i * 16 + offs)[:, None] * C + i * 16 + offs[None, :]
    tl.store(p, _invert_unit_lower_16(tl.load(p)))


diagonal_inverse = CachedKernel(_diagonal_inverse_kernel)
