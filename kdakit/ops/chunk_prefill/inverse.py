"""``T = (I + A)^-1`` of ``chunk_prefill``'s prep, in place of ``A``.

``A`` (β-scaled, strictly lower; ``chunk_prefill``) sits in the prep's workspace, a
``[C, C]`` matrix per (chunk, value head). Its 16 x 16 diagonal blocks are inverted by forward
substitution, either inside the prep (``_invert_diagonal_blocks``) or one warp per block by
``diagonal_inverse``, a launch of its own that writes each inverse over ``A_ii``; the blocks
below them come from the prep (``_invert_unit_lower*``, with ``DIAGONAL_INVERTED`` after
``diagonal_inverse``), by block-row substitution or by doubling.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..launch import CachedKernel


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


@triton.jit
def _invert_diagonal_blocks(wa, C: tl.constexpr, NB: tl.constexpr):
    """The [NB, 16, 16] diagonal blocks of ``(I + A)^-1`` written over ``A``'s, by forward
    substitution, every block's row r at once (each block whole: zeros above its diagonal)."""
    offs_s = tl.arange(0, 16)
    offs_b = tl.arange(0, NB)
    p_d = (offs_b[:, None, None] * 16 + offs_s[None, :, None]) * C \
        + offs_b[:, None, None] * 16 + offs_s[None, None, :]
    A_d = tl.load(wa + p_d)
    row3 = offs_s[None, :, None] + offs_b[:, None, None] * 0
    col2 = offs_s[None, :] + offs_b[:, None] * 0
    inv = tl.where(row3 == offs_s[None, None, :], 1.0, 0.0)
    for r in range(1, 16):
        a_r = tl.sum(tl.where(row3 == r, A_d, 0.0), axis=1)  # [NB, 16]: row r of each block
        new = tl.where(col2 == r, 1.0, 0.0) - tl.sum(a_r[:, :, None] * inv, axis=1)
        inv = tl.where(row3 == r, new[:, None, :], inv)
    tl.debug_barrier()
    tl.store(wa + p_d, inv)
    tl.debug_barrier()


@triton.jit
def _invert_unit_lower_by_doubling(wa, C: tl.constexpr, NB: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                   DIAGONAL_INVERTED: tl.constexpr):
    """``_invert_unit_lower`` by doubling: from the 16 x 16 diagonal blocks, each level inverts
    the diagonal blocks twice as large, whose lower-left block is ``-T_bb A_ba T_aa`` (T_aa,
    T_bb: the inverses of the level below, A_ba: ``A``'s block under T_aa). Two levels at
    C = 64, each one pair of products per block (16- then 32-row), where the block-row
    substitution takes six dependent steps of 16-row products. ``DIAGONAL_INVERTED``: the 16 x 16
    diagonal blocks hold their inverses already."""
    if not DIAGONAL_INVERTED:
        _invert_diagonal_blocks(wa, C, NB)
    if C > 16:
        _double_diagonal_blocks(wa, C, 16, DOT_PRECISION)
    if C > 32:
        _double_diagonal_blocks(wa, C, 32, DOT_PRECISION)


@triton.jit
def _double_diagonal_blocks(wa, C: tl.constexpr, SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The diagonal blocks of 2 SIZE rows from those of SIZE rows (above): each pair's lower-left
    block ``-T_bb A_ba T_aa`` over ``A_ba``. Above the 16 x 16 diagonal blocks the workspace is
    not written: T_aa and T_bb load masked to the blocks at or below it."""
    offs = tl.arange(0, SIZE)
    blk = offs // 16
    at_or_below = blk[:, None] >= blk[None, :]
    for pair in tl.static_range(C // (2 * SIZE)):
        a = 2 * pair * SIZE
        b = a + SIZE
        t_aa = tl.load(wa + (a + offs)[:, None] * C + a + offs[None, :], mask=at_or_below, other=0.0)
        t_bb = tl.load(wa + (b + offs)[:, None] * C + b + offs[None, :], mask=at_or_below, other=0.0)
        p_ba = (b + offs)[:, None] * C + a + offs[None, :]
        t_ba = -tl.dot(t_bb, tl.dot(tl.load(wa + p_ba), t_aa, input_precision=DOT_PRECISION),
                       input_precision=DOT_PRECISION)
        tl.debug_barrier()  # every thread has read A_ba before any overwrites it
        tl.store(wa + p_ba, t_ba)
    tl.debug_barrier()


@triton.jit
def _invert_unit_lower(wa, C: tl.constexpr, NB: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       DIAGONAL_INVERTED: tl.constexpr):
    """``(I + A)^-1`` for the strictly lower-triangular ``A [C, C]`` at
    ``wa`` (row stride ``C``), written over it (blocks above the diagonal are left as they are;
    ``DIAGONAL_INVERTED``: the 16 x 16 diagonal blocks hold their inverses already)."""
    offs_s = tl.arange(0, 16)
    if not DIAGONAL_INVERTED:
        _invert_diagonal_blocks(wa, C, NB)
    # Below the diagonal, row block by row block, j ascending: T_ij = -T_ii Σ_{j<=m<i} A_im T_mj.
    # T_ij may overwrite A_ij: the later j of row block i read A_im only for m > j.
    for i in tl.static_range(1, NB):
        p_i = (i * 16 + offs_s[:, None]) * C + offs_s[None, :]
        t_ii = tl.load(wa + p_i + i * 16)
        for j in tl.static_range(0, i):
            acc = tl.zeros([16, 16], dtype=tl.float32)
            for m in tl.static_range(j, i):
                a_im = tl.load(wa + p_i + m * 16)
                t_mj = tl.load(wa + (m * 16 + offs_s[:, None]) * C + j * 16 + offs_s[None, :])
                acc = tl.dot(a_im, t_mj, acc, input_precision=DOT_PRECISION)
            t_ij = -tl.dot(t_ii, acc, input_precision=DOT_PRECISION)
            tl.debug_barrier()
            tl.store(wa + p_i + j * 16, t_ij)
            tl.debug_barrier()
