"""The prep's ``A`` and ``P`` products of ``chunk_prefill``, and the loads they share.

Per (chunk, value head) the prep holds, in its float32 workspace, the chunk-local cumulative
log-decay Γ (``[C, BLOCK_K]``) and, with ``ChunkConfig.qk_from_input``, each row's reciprocal
norms of k and q (the later phases read q and k from the inputs and scale them as they load:
``_unit_rows``). The pairs whose earlier token lies in 16-token column block ``j`` form one
tensor-core product over the rows at or below it, factored at a token ``b`` so that no exponent
is positive beyond what the block's log-decay spread bounds (the package doc of ``kdakit.ops.chunk_prefill``).
By block (``_column_block_products``), a column block's products run over every K slice, in a
loop over the blocks or a program per block (on all the rows, or for the lower half of the
blocks on the lower half of the rows); by slice
(``_pair_products_by_slice``), the K slices are the outer loop and each slice of k̂, q̂ and Γ
feeds all blocks' products, summed in the same order: the same bits, a quarter of the loads.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unit_rows(x_head, norms, which, scale, t0, n_tok, rows, cols, stride_t, K: tl.constexpr,
               NORMED: tl.constexpr):
    """k̂ (``which`` 0, ``scale`` 1) or q̂ (``which`` 1, the q scale) of the chunk's ``rows`` and
    ``cols`` from the input, as the workspace would hold them (``x * (1 / norm) * scale``, the first
    phase's arithmetic, ``x * scale`` without the L2 norm; zeros past the chunk's tokens and K)."""
    m = (rows < n_tok)[:, None] & (cols < K)[None, :]
    x = tl.load(x_head + (t0 + rows)[:, None] * stride_t + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if NORMED:
        x = x * tl.load(norms + rows * 2 + which)[:, None]
    return x * scale


@triton.jit
def _block_spread(ws_gamma, j, offs_k, BLOCK_K: tl.constexpr):
    """Sub-block ``j``'s log-decay spread: Γ of the token before it (0 before the chunk) minus
    Γ of its last token, the largest over the channels (>= 0: Γ never increases)."""
    ref = j * 16 - 1
    before = tl.load(ws_gamma + ref * BLOCK_K + offs_k, mask=(offs_k * 0 + ref) >= 0, other=0.0)
    return tl.max(before - tl.load(ws_gamma + (j * 16 + 15) * BLOCK_K + offs_k), axis=0)


@triton.jit
def _unit_slice(x_ws, x_head, norms, which, scale, t0, n_tok, rows, cols, stride_t, K: tl.constexpr,
                BLOCK_K: tl.constexpr, NORMED: tl.constexpr, QK_FROM_INPUT: tl.constexpr):
    """k̂ or q̂ of ``rows`` x ``cols``: from the inputs (``_unit_rows``) or the float32 workspace."""
    if QK_FROM_INPUT:
        x = _unit_rows(x_head, norms, which, scale, t0, n_tok, rows, cols, stride_t, K, NORMED)
    else:
        x = tl.load(x_ws + rows[:, None] * BLOCK_K + cols[None, :])
    return x


@triton.jit
def _rows_slice(ww, wk, wq, wn, k_h, q_h, rows, kk, t0, n_tok, stride_k_t, stride_q_t, scale, K: tl.constexpr,
                BLOCK_K: tl.constexpr, SLICE: tl.constexpr, NORMED: tl.constexpr, QK_FROM_INPUT: tl.constexpr):
    """Γ, k̂ and q̂ of ``rows`` on the K slice from column ``kk``: what every column block's
    product of that slice takes."""
    offs_n = tl.arange(0, SLICE)
    G = tl.load(ww + rows[:, None] * BLOCK_K + kk + offs_n[None, :])
    k_c = _unit_slice(wk, k_h, wn, 0, 1.0, t0, n_tok, rows, kk + offs_n, stride_k_t, K, BLOCK_K, NORMED, QK_FROM_INPUT)
    q_c = _unit_slice(wq, q_h, wn, 1, scale, t0, n_tok, rows, kk + offs_n, stride_q_t, K, BLOCK_K, NORMED,
                      QK_FROM_INPUT)
    return G, k_c, q_c


@triton.jit
def _column_block_reference(ww, j, diag_spread_max, offs_c, BLOCK_K: tl.constexpr):
    """Column block ``j``'s factoring token and the rows its product covers (see the kernel):
    the token before the block and the block's rows too where its spread allows, else the
    block's last token and the rows below it."""
    factor = _block_spread(ww, j, tl.arange(0, BLOCK_K), BLOCK_K) <= diag_spread_max
    ref = tl.where(factor, j * 16 - 1, j * 16 + 15)
    below = offs_c >= tl.where(factor, j * 16, j * 16 + 16)
    return ref, below


@triton.jit
def _column_block_slice(acc_a, acc_p, k_c, q_c, G, ref, below, j, wk, ww, wn, k_h, t0, n_tok, kk, stride_k_t,
                        K: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr, NORMED: tl.constexpr,
                        QK_FROM_INPUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K slice of column block ``j``'s A and P products, factored at token ``ref``."""
    offs_n = tl.arange(0, SLICE)
    rows_j = j * 16 + tl.arange(0, 16)
    G_ref = tl.load(ww + ref * BLOCK_K + kk + offs_n, mask=(offs_n * 0 + ref) >= 0, other=0.0)
    left = tl.exp(tl.where(below[:, None], G - G_ref[None, :], float("-inf")))
    k_j = _unit_slice(wk, k_h, wn, 0, 1.0, t0, n_tok, rows_j, kk + offs_n, stride_k_t, K, BLOCK_K, NORMED,
                      QK_FROM_INPUT)
    right = tl.trans(k_j * tl.exp(G_ref[None, :] - tl.load(ww + rows_j[:, None] * BLOCK_K + kk + offs_n[None, :])))
    acc_a = tl.dot(k_c * left, right, acc_a, input_precision=DOT_PRECISION)
    acc_p = tl.dot(q_c * left, right, acc_p, input_precision=DOT_PRECISION)
    return acc_a, acc_p


@triton.jit
def _store_column_block(wa, wp, acc_a, acc_p, b_beta, below, j, rows, C: tl.constexpr):
    """Column block ``j`` of A (β-scaled, strictly lower) and P (lower) on ``rows`` (``b_beta``
    their β), its covered rows only."""
    col = j * 16 + tl.arange(0, 16)
    p_col = rows[:, None] * C + col[None, :]
    tl.store(wa + p_col, tl.where(rows[:, None] > col[None, :], acc_a * b_beta[:, None], 0.0), mask=below[:, None])
    tl.store(wp + p_col, tl.where(rows[:, None] >= col[None, :], acc_p, 0.0).to(wp.dtype.element_ty),
             mask=below[:, None])


@triton.jit
def _column_block_products(wa, wp, wk, wq, ww, wn, k_h, q_h, rows, b_beta, j, t0, n_tok, stride_k_t, stride_q_t,
                           scale, diag_spread_max, K: tl.constexpr, BLOCK_K: tl.constexpr, C: tl.constexpr,
                           SLICE: tl.constexpr, NORMED: tl.constexpr, QK_FROM_INPUT: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    """Column block ``j``'s A and P over every K slice, on the chunk's ``rows`` (``b_beta`` their
    β): all C of them, or the lower half for a block in the lower half (no row above covers it)."""
    NB: tl.constexpr = C // 16
    ROWS: tl.constexpr = rows.shape[0]
    ref, below = _column_block_reference(ww, j, diag_spread_max, rows, BLOCK_K)
    if (ref < j * 16) | (j < NB - 1):  # a steep last block has no rows below it
        acc_a = tl.zeros([ROWS, 16], dtype=tl.float32)
        acc_p = tl.zeros([ROWS, 16], dtype=tl.float32)
        for kk in tl.static_range(0, BLOCK_K, SLICE):
            G, k_c, q_c = _rows_slice(ww, wk, wq, wn, k_h, q_h, rows, kk, t0, n_tok, stride_k_t, stride_q_t, scale,
                                      K, BLOCK_K, SLICE, NORMED, QK_FROM_INPUT)
            acc_a, acc_p = _column_block_slice(acc_a, acc_p, k_c, q_c, G, ref, below, j, wk, ww, wn, k_h, t0, n_tok,
                                               kk, stride_k_t, K, BLOCK_K, SLICE, NORMED, QK_FROM_INPUT,
                                               DOT_PRECISION)
        _store_column_block(wa, wp, acc_a, acc_p, b_beta, below, j, rows, C)


@triton.jit
def _pair_products_by_slice(wk, wq, ww, wa, wp, wn, k_h, q_h, b_beta, t0, n_tok, stride_k_t, stride_q_t, scale,
                            diag_spread_max, K: tl.constexpr, BLOCK_K: tl.constexpr, C: tl.constexpr,
                            SLICE: tl.constexpr, NORMED: tl.constexpr, QK_FROM_INPUT: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    """A and P as the by-block products compute them (the same products, summed over the K
    slices in the same order, so the same bits), with the K slices outermost: each slice of
    k̂, q̂ and Γ is loaded once for every column block, where the by-block order loads it once
    a block. The price is every block's two accumulators live at once (up to 4 blocks)."""
    NB: tl.constexpr = C // 16
    tl.static_assert(NB <= 4, "by_slice products hold at most 4 column blocks (C <= 64)")
    offs_c = tl.arange(0, C)
    ref0, below0 = _column_block_reference(ww, 0, diag_spread_max, offs_c, BLOCK_K)
    ref1, below1 = _column_block_reference(ww, 1 % NB, diag_spread_max, offs_c, BLOCK_K)
    ref2, below2 = _column_block_reference(ww, 2 % NB, diag_spread_max, offs_c, BLOCK_K)
    ref3, below3 = _column_block_reference(ww, 3 % NB, diag_spread_max, offs_c, BLOCK_K)
    a0 = tl.zeros([C, 16], dtype=tl.float32)
    p0 = tl.zeros([C, 16], dtype=tl.float32)
    a1 = tl.zeros([C, 16], dtype=tl.float32)
    p1 = tl.zeros([C, 16], dtype=tl.float32)
    a2 = tl.zeros([C, 16], dtype=tl.float32)
    p2 = tl.zeros([C, 16], dtype=tl.float32)
    a3 = tl.zeros([C, 16], dtype=tl.float32)
    p3 = tl.zeros([C, 16], dtype=tl.float32)
    for kk in tl.static_range(0, BLOCK_K, SLICE):
        G, k_c, q_c = _rows_slice(ww, wk, wq, wn, k_h, q_h, offs_c, kk, t0, n_tok, stride_k_t, stride_q_t, scale, K,
                                  BLOCK_K, SLICE, NORMED, QK_FROM_INPUT)
        a0, p0 = _column_block_slice(a0, p0, k_c, q_c, G, ref0, below0, 0, wk, ww, wn, k_h, t0, n_tok, kk,
                                     stride_k_t, K, BLOCK_K, SLICE, NORMED, QK_FROM_INPUT, DOT_PRECISION)
        if NB > 1:
            a1, p1 = _column_block_slice(a1, p1, k_c, q_c, G, ref1, below1, 1, wk, ww, wn, k_h, t0, n_tok, kk,
                                         stride_k_t, K, BLOCK_K, SLICE, NORMED, QK_FROM_INPUT, DOT_PRECISION)
        if NB > 2:
            a2, p2 = _column_block_slice(a2, p2, k_c, q_c, G, ref2, below2, 2, wk, ww, wn, k_h, t0, n_tok, kk,
                                         stride_k_t, K, BLOCK_K, SLICE, NORMED, QK_FROM_INPUT, DOT_PRECISION)
            a3, p3 = _column_block_slice(a3, p3, k_c, q_c, G, ref3, below3, 3, wk, ww, wn, k_h, t0, n_tok, kk,
                                         stride_k_t, K, BLOCK_K, SLICE, NORMED, QK_FROM_INPUT, DOT_PRECISION)
    _store_column_block(wa, wp, a0, p0, b_beta, below0, 0, offs_c, C)
    if NB > 1:
        _store_column_block(wa, wp, a1, p1, b_beta, below1, 1, offs_c, C)
    if NB > 2:
        _store_column_block(wa, wp, a2, p2, b_beta, below2, 2, offs_c, C)
        _store_column_block(wa, wp, a3, p3, b_beta, below3, 3, offs_c, C)


@triton.jit
def _steep_column(ww, wk, wn, k_h, row, kk, offs_n, t0, n_tok, stride_k_t, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  NORMED: tl.constexpr, QK_FROM_INPUT: tl.constexpr):
    """K slice ``kk`` of k̂ and Γ at chunk row ``row``: a steep sub-block's column (k̂ from the
    input scaled by the kept reciprocal norm, as _unit_rows gives that row, or from the workspace)."""
    if QK_FROM_INPUT:
        row_r = offs_n * 0 + row
        k_r = tl.load(k_h + (t0 + row_r) * stride_k_t + kk + offs_n,
                      mask=(row_r < n_tok) & ((kk + offs_n) < K), other=0.0).to(tl.float32)
        if NORMED:
            k_r = k_r * tl.load(wn + row_r * 2)
    else:
        k_r = tl.load(wk + row * BLOCK_K + kk + offs_n)
    return k_r, tl.load(ww + row * BLOCK_K + kk + offs_n)


@triton.jit
def _steep_block_pairs_by_slice(wa, wp, ww, wk, wq, wn, k_h, q_h, i, beta_i, t0, n_tok, stride_k_t, stride_q_t,
                                scale, K: tl.constexpr, BLOCK_K: tl.constexpr, C: tl.constexpr,
                                SLICE: tl.constexpr, NORMED: tl.constexpr, QK_FROM_INPUT: tl.constexpr):
    """The exact pairs of steep sub-block ``i`` (its own 16 x 16 block of A and P, decays taken
    element-wise), the K slices outermost: each slice of the block's Γ, k̂ and q̂ is loaded once
    for its 16 columns, where a column at a time loads it 16 times. Each column's sum is built
    slice by slice in the same order: the bits of the column-at-a-time form."""
    offs_s = tl.arange(0, 16)
    offs_n = tl.arange(0, SLICE)
    rows = i * 16 + offs_s
    a_blk = tl.zeros([16, 16], dtype=tl.float32)
    p_blk = tl.zeros([16, 16], dtype=tl.float32)
    for kk in tl.static_range(0, BLOCK_K, SLICE):
        G, k_c, q_c = _rows_slice(ww, wk, wq, wn, k_h, q_h, rows, kk, t0, n_tok, stride_k_t, stride_q_t, scale, K,
                                  BLOCK_K, SLICE, NORMED, QK_FROM_INPUT)
        for r in range(16):
            k_r, G_r = _steep_column(ww, wk, wn, k_h, i * 16 + r, kk, offs_n, t0, n_tok, stride_k_t, K, BLOCK_K,
                                     NORMED, QK_FROM_INPUT)
            kr = k_r[None, :] * tl.exp(tl.where((offs_s >= r)[:, None], G - G_r[None, :], float("-inf")))
            column = offs_s[None, :] == r
            a_blk = tl.where(column, a_blk + tl.sum(k_c * kr, axis=1)[:, None], a_blk)
            p_blk = tl.where(column, p_blk + tl.sum(q_c * kr, axis=1)[:, None], p_blk)
    p_blk_rows = rows[:, None] * C + i * 16 + offs_s[None, :]
    tl.store(wa + p_blk_rows, tl.where(offs_s[:, None] > offs_s[None, :], a_blk * beta_i[:, None], 0.0))
    tl.store(wp + p_blk_rows, p_blk.to(wp.dtype.element_ty))
