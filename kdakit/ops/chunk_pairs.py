"""The pair sums of ``chunk_prefill``'s prep as one small program per pair of sub-blocks.

Per chunk of ``C`` tokens and value head (notation of ``chunk_prefill``): ``A[s, r] = β_s
Σ_k k̂_s k̂_r e^(Γ_s - Γ_r)`` (r < s) and ``P[t, s] = Σ_k q̂_t k̂_s e^(Γ_t - Γ_s)`` (s <= t),
cut into 16 x 16 blocks ``(i, j)``, row sub-block ``i`` >= column sub-block ``j``: C = 64
has 10 such blocks, and each is one program of one warp, so that a chunk's pairs run side by
side instead of one after another (the column-block form, ``ChunkConfig.pairs
"column_blocks"``, loops over them in one program of a chunk). Every block of row ``i`` is
factored at ``b``, the token before sub-block ``i`` (the chunk start for i = 0),
``e^(Γ_s - Γ_r) = e^(Γ_s - Γ_b) · e^(Γ_b - Γ_r)``:

- below the diagonal (j < i) both factors are <= 1 whatever the gate (r <= b < s);
- on the diagonal ``e^(Γ_b - Γ_r)`` is at most ``e^spread``, the sub-block's log-decay spread,
  so it is factored only where the spread is at most ``spread_max``; a steeper diagonal block
  takes its exact decays element-wise, a column at a time.

A diagonal block's program also inverts ``I + A_ii`` (forward substitution in registers) and
writes the inverse over ``A_ii``; the launch after it builds the rest of ``(I + A)^-1`` from
the diagonal inverses (``chunk_prefill._invert_unit_lower*``, told the diagonal is done).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .launch import CachedKernel


@triton.jit
def chunk_tokens(chunk_seq, chunk_first, cu_seqlens, i_c, num_seqs, T, C: tl.constexpr):
    """(first token, token count) of global chunk ``i_c`` (count 0 past the plan's end).
    Offsets are clamped into [0, T] (and eos >= bos), as the plan clamps them: no token
    outside the inputs is read whatever cu_seqlens holds (full-check mode rejects such offsets)."""
    seq = tl.load(chunk_seq + i_c).to(tl.int64)
    valid = seq < num_seqs
    seq_c = tl.minimum(seq, num_seqs - 1)
    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + seq_c).to(tl.int64), 0), T)
    eos = tl.maximum(tl.minimum(tl.maximum(tl.load(cu_seqlens + seq_c + 1).to(tl.int64), 0), T), bos)
    t0 = bos + (i_c.to(tl.int64) - tl.load(chunk_first + seq_c).to(tl.int64)) * C
    return t0, tl.where(valid, tl.minimum(eos - t0, C), 0)


@triton.jit
def unit_rows(x_head, norms, which, scale, t0, n_tok, rows, cols, stride_t, K: tl.constexpr,
              NORMED: tl.constexpr):
    """k̂ (``which`` 0, ``scale`` 1) or q̂ (``which`` 1, the q scale) of the chunk's ``rows`` and
    ``cols`` from the input, as the workspace would hold them (``x / norm * scale``, the first
    phase's arithmetic, ``x * scale`` without the L2 norm; zeros past the chunk's tokens and K)."""
    m = (rows < n_tok)[:, None] & (cols < K)[None, :]
    x = tl.load(x_head + (t0 + rows)[:, None] * stride_t + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if NORMED:
        x = x / tl.load(norms + rows * 2 + which)[:, None]
    return x * scale


@triton.jit
def block_spread(ws_gamma, j, offs_k, BLOCK_K: tl.constexpr):
    """Sub-block ``j``'s log-decay spread: Γ of the token before it (0 before the chunk) minus
    Γ of its last token, the largest over the channels (>= 0: Γ never increases)."""
    ref = j * 16 - 1
    before = tl.load(ws_gamma + ref * BLOCK_K + offs_k, mask=(offs_k * 0 + ref) >= 0, other=0.0)
    return tl.max(before - tl.load(ws_gamma + (j * 16 + 15) * BLOCK_K + offs_k), axis=0)


@triton.jit
def beta_values(beta, tok, mask, stride_b_t, stride_b_h, i_hv, BETA_MODE: tl.constexpr):
    """β of the tokens ``tok`` (zeros where not ``mask``) from β or its logit."""
    b = tl.load(beta + tok * stride_b_t + i_hv * stride_b_h, mask=mask, other=0.0).to(tl.float32)
    if BETA_MODE == 1:
        b = tl.sigmoid(b)
    if BETA_MODE == 2:
        b = tl.sigmoid(b) * 2.0
    return tl.where(mask, b, 0.0)


@triton.jit
def _qk_rows(x_head, ws_x, norms, which, scale, t0, n_tok, rows, cols, stride_t, K: tl.constexpr,
             BLOCK_K: tl.constexpr, NORMED: tl.constexpr, FROM_INPUT: tl.constexpr):
    """k̂ or q̂ rows: from the input (``unit_rows``) or from the float32 workspace."""
    if FROM_INPUT:
        x = unit_rows(x_head, norms, which, scale, t0, n_tok, rows, cols, stride_t, K, NORMED)
    else:
        x = tl.load(ws_x + rows[:, None] * BLOCK_K + cols[None, :]).to(tl.float32)
    return x


@triton.jit
def _qk_row(x_head, ws_x, norms, which, scale, t0, n_tok, row, cols, stride_t, K: tl.constexpr,
            BLOCK_K: tl.constexpr, NORMED: tl.constexpr, FROM_INPUT: tl.constexpr):
    """Row ``row`` of ``_qk_rows`` as a vector over ``cols`` (the same arithmetic, the same bits)."""
    if FROM_INPUT:
        rows = cols * 0 + row
        x = tl.load(x_head + (t0 + rows) * stride_t + cols, mask=(rows < n_tok) & (cols < K), other=0.0)
        x = x.to(tl.float32)
        if NORMED:
            x = x / tl.load(norms + rows * 2 + which)
        x = x * scale
    else:
        x = tl.load(ws_x + row * BLOCK_K + cols).to(tl.float32)
    return x


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
def _factored_piece(acc_a, acc_p, kk, b, k_h, q_h, wk, wq, wg, wn, scale, n_tok, rows_i, rows_j, stride_k_t,
                    stride_q_t, K: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr, NORMED: tl.constexpr,
                    FROM_INPUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Block (i, j)'s products over columns [kk, kk + SLICE), factored at token ``b``."""
    offs_n = tl.arange(0, SLICE)
    cols = kk + offs_n
    G_b = tl.load(wg + b * BLOCK_K + cols, mask=(offs_n * 0 + b) >= 0, other=0.0)
    left = tl.exp(tl.load(wg + rows_i[:, None] * BLOCK_K + cols[None, :]) - G_b[None, :])
    k_j = _qk_rows(k_h, wk, wn, 0, 1.0, 0, n_tok, rows_j, cols, stride_k_t, K, BLOCK_K, NORMED, FROM_INPUT)
    right = tl.trans(k_j * tl.exp(G_b[None, :] - tl.load(wg + rows_j[:, None] * BLOCK_K + cols[None, :])))
    k_i = _qk_rows(k_h, wk, wn, 0, 1.0, 0, n_tok, rows_i, cols, stride_k_t, K, BLOCK_K, NORMED, FROM_INPUT)
    acc_a = tl.dot(k_i * left, right, acc_a, input_precision=DOT_PRECISION)
    q_i = _qk_rows(q_h, wq, wn, 1, scale, 0, n_tok, rows_i, cols, stride_q_t, K, BLOCK_K, NORMED, FROM_INPUT)
    acc_p = tl.dot(q_i * left, right, acc_p, input_precision=DOT_PRECISION)
    return acc_a, acc_p


@triton.jit
def _chunk_pairs_kernel(
    q, k, beta, cu_seqlens, chunk_first, chunk_seq, ws_q, ws_k, ws_gamma, ws_p, ws_a, ws_n,
    num_seqs, T, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_b_t, stride_b_h,
    scale, spread_max,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, C: tl.constexpr,
    SLICE: tl.constexpr, USE_QK_L2NORM: tl.constexpr, BETA_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QK_FROM_INPUT: tl.constexpr, UNROLL_SLICES: tl.constexpr, EXACT_SLICE: tl.constexpr,
):
    i_c, i_hv, pair = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    NB: tl.constexpr = C // 16
    # pair -> (i, j), j <= i, row by row: (0,0) (1,0) (1,1) (2,0) ...
    i = -1
    for ii in tl.static_range(NB):
        i += (pair >= ii * (ii + 1) // 2).to(tl.int32)
    j = pair - i * (i + 1) // 2
    t0, n_tok = chunk_tokens(chunk_seq, chunk_first, cu_seqlens, i_c, num_seqs, T, C)
    ws_row = (i_c.to(tl.int64) * HV + i_hv) * C
    wq = ws_q + ws_row * BLOCK_K
    wk = ws_k + ws_row * BLOCK_K
    wg = ws_gamma + ws_row * BLOCK_K
    wn = ws_n + ws_row * 2
    # the chunk's first token as the base pointer: int32 offsets from it (64-bit offset tiles
    # double the registers every address takes)
    k_h = k + i_h * stride_k_h + t0 * stride_k_t
    q_h = q + i_h * stride_q_h + t0 * stride_q_t
    offs_s = tl.arange(0, 16)
    rows_i = i * 16 + offs_s
    rows_j = j * 16 + offs_s
    b = i * 16 - 1
    factored = (i != j) | (block_spread(wg, i, tl.arange(0, BLOCK_K), BLOCK_K) <= spread_max)
    acc_a = tl.zeros([16, 16], dtype=tl.float32)
    acc_p = tl.zeros([16, 16], dtype=tl.float32)
    if factored:
        if UNROLL_SLICES:
            for kk in tl.static_range(0, BLOCK_K, SLICE):
                acc_a, acc_p = _factored_piece(acc_a, acc_p, kk, b, k_h, q_h, wk, wq, wg, wn, scale, n_tok, rows_i,
                                               rows_j, stride_k_t, stride_q_t, K, BLOCK_K, SLICE, USE_QK_L2NORM,
                                               QK_FROM_INPUT, DOT_PRECISION)
        else:
            for kk in range(0, BLOCK_K, SLICE):
                acc_a, acc_p = _factored_piece(acc_a, acc_p, kk, b, k_h, q_h, wk, wq, wg, wn, scale, n_tok, rows_i,
                                               rows_j, stride_k_t, stride_q_t, K, BLOCK_K, SLICE, USE_QK_L2NORM,
                                               QK_FROM_INPUT, DOT_PRECISION)
    else:
        # A steep diagonal block (the default gate is unbounded): exact decays, every pair of the
        # block at once on [16, 16, EXACT_SLICE] pieces (s, r, channel).
        offs_e = tl.arange(0, EXACT_SLICE)
        causal = (offs_s[:, None] >= offs_s[None, :])[:, :, None]
        for kk in range(0, BLOCK_K, EXACT_SLICE):
            cols = kk + offs_e
            G = tl.load(wg + rows_i[:, None] * BLOCK_K + cols[None, :])
            k_i = _qk_rows(k_h, wk, wn, 0, 1.0, 0, n_tok, rows_i, cols, stride_k_t, K, BLOCK_K, USE_QK_L2NORM,
                           QK_FROM_INPUT)
            q_i = _qk_rows(q_h, wq, wn, 1, scale, 0, n_tok, rows_i, cols, stride_q_t, K, BLOCK_K, USE_QK_L2NORM,
                           QK_FROM_INPUT)
            kr = k_i[None, :, :] * tl.exp(tl.where(causal, G[:, None, :] - G[None, :, :], float("-inf")))
            acc_a += tl.sum(k_i[:, None, :] * kr, axis=2)
            acc_p += tl.sum(q_i[:, None, :] * kr, axis=2)
    beta_i = beta_values(beta, t0 + rows_i, rows_i < n_tok, stride_b_t, stride_b_h, i_hv, BETA_MODE)
    # below the diagonal block's diagonal, or anywhere in a block below the diagonal (+16)
    below = offs_s[:, None] - offs_s[None, :] + 16 * (i != j).to(tl.int32)
    a_ij = tl.where(below > 0, acc_a * beta_i[:, None], 0.0)
    p_ij = tl.where(below >= 0, acc_p, 0.0)
    p_blk = rows_i[:, None] * C + rows_j[None, :]
    tl.store(ws_p + ws_row * C + p_blk, p_ij)
    if i == j:
        a_ij = _invert_unit_lower_16(a_ij)
    tl.store(ws_a + ws_row * C + p_blk, a_ij)


chunk_pairs = CachedKernel(_chunk_pairs_kernel)


def num_pairs(C: int) -> int:
    """Blocks at or below the diagonal of a chunk's 16 x 16 grid: the launch's third grid axis."""
    nb = C // 16
    return nb * (nb + 1) // 2


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
