"""The prep kernel of ``chunk_prefill``: each chunk's factors for the state chain.

``_chunk_prep_kernel``, one program per (chunk, value head), token-parallel: L2 norm,
gate, β, the cumulative decay, ``A`` and ``P``, the inverse, and the chunk's ``w``,
``u``, ``q̂ ⊙ e^Γ``, ``k̂ ⊙ e^(Γ_C - Γ)``, ``P`` and ``e^Γ_C`` into a float32 workspace.
Each phase reads its pieces back from the workspace (16-row sub-blocks,
``ChunkConfig.slice_k``-column pieces), so that no whole-chunk tile outlives its phase:
those spill registers. With ``ChunkConfig.qk_from_input`` the first phase keeps only the
rows' reciprocal norms of k and q (two floats a row), and the later phases read q and k
from the inputs and normalise them as they load. With ``ChunkConfig.split_prep`` (the picked default) the phases
run as three launches of the same kernel (token-parallel; the exact pairs of steep
sub-blocks, a program per sub-block; the rest), each holding fewer registers. With
``split_rest`` the rest goes as three (products, inverse, w and u; the products as two
with ``products="block_programs"``), and with
``diagonal_programs`` (picked) the inverse's 16 x 16 diagonal blocks are inverted one warp
each by ``diagonal_inverse`` (``inverse.py``) between the products and the inverse launch, which then only
builds the blocks below them (by doubling, ``inverse="doubling"``, picked).

The prep's products (``ChunkConfig.products``, ``products.py`` with the loads the phases
share) run a program per column block (``"block_programs"``, picked) in two launches: the
upper half of the blocks on all the chunk's rows, the lower half on the lower half of the rows
(all they cover). The programs of a (chunk, head) are adjacent in the grid, so its k, q and Γ
come from the L2 after the first. ``"by_slice"`` accumulates every block's product per K slice
in one program, ``"by_block"`` loops over the blocks. ``w`` and ``u`` go a program per K and V
slice (``factor_programs``, picked; ``factors.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..launch import CachedKernel
from ..triton_math import kda_log_decay
from .factors import _k_slice_factors, _v_slice_factors
from .inverse import _invert_unit_lower, _invert_unit_lower_by_doubling
from .plan import _chunk_tokens
from .products import (_block_spread, _column_block_products, _pair_products_by_slice, _steep_block_pairs_by_slice,
                       _steep_column, _unit_rows)


@triton.jit
def _chunk_prep_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_first, chunk_seq,
    ws_q, ws_k, ws_w, ws_u, ws_p, ws_a, ws_g, ws_n, f_q, f_k, f_w,
    num_seqs, T,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_g_h,
    stride_b_t, stride_b_h,
    scale, lower_bound, diag_spread_max,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr, SLICE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, SAFE_GATE: tl.constexpr,
    BETA_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PHASES: tl.constexpr, SUB_BLOCK_PROGRAMS: tl.constexpr, QK_FROM_INPUT: tl.constexpr,
    INVERSE_BY_DOUBLING: tl.constexpr, DIAGONAL_INVERTED: tl.constexpr, PRODUCTS_BY_SLICE: tl.constexpr,
    STEEP_BY_SLICE: tl.constexpr, FACTORS_IN_PLACE: tl.constexpr, PARTS: tl.constexpr, BLOCK_LAUNCH: tl.constexpr,
):
    # Every phase reads what it needs back from the (L2-resident) workspace in 16-row or
    # SLICE-column pieces, so that no [C, K] tile outlives its phase: whole-chunk tiles kept
    # live across phases spill registers. PHASES (bits: 1 token-parallel, 2 the exact
    # in-sub-block pairs, 4 the column-block products, 8 the inverse, 16 w and u and the
    # chain's other factors) lets a launch run some of them: split over launches,
    # each kernel holds fewer registers, so more programs share an SM. SUB_BLOCK_PROGRAMS:
    # one program per sub-block (program_id 2) instead of a loop over them. QK_FROM_INPUT:
    # the first phase keeps each row's reciprocal norms of k and q (ws_n), and the later phases read
    # q and k from the inputs and scale them as the first phase would have (_unit_rows).
    # f_q, f_k, f_w (and ws_u): where the chain's factors go, in their dtype; float32 ones
    # are ws_q, ws_k, ws_w themselves, written over q̂, k̂ and Γ.
    # PARTS programs a (chunk, head), adjacent in the grid so that they share its loads in the L2:
    # the by-block products a column block each (BLOCK_LAUNCH 1: the upper half of the blocks,
    # 2: the lower half; 0: every block in one program), or the factors a K and V slice each
    i_c, part, i_hv = tl.program_id(0) // PARTS, tl.program_id(0) % PARTS, tl.program_id(1)
    i_h = i_hv // (HV // H)
    c64 = i_c.to(tl.int64)
    NB: tl.constexpr = C // 16
    t0, n_tok = _chunk_tokens(chunk_seq, chunk_first, cu_seqlens, i_c, num_seqs, T, C)  # none past the plan

    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < n_tok
    tok = t0 + offs_c
    # This (chunk, head)'s rows of the [rows, ...] workspaces; offsets inside them are int32
    # (64-bit offset tiles double the registers every address takes).
    ws_row = (c64 * HV + i_hv) * C
    wq = ws_q + ws_row * BLOCK_K
    wk = ws_k + ws_row * BLOCK_K
    ww = ws_w + ws_row * BLOCK_K
    wa = ws_a + ws_row * C
    wp = ws_p + ws_row * C
    wn = ws_n + ws_row * 2  # (1 / norm of k, 1 / norm of q) a row, with QK_FROM_INPUT and the L2 norm
    k_h = k + i_h * stride_k_h
    q_h = q + i_h * stride_q_h

    # ---- token-parallel: normalised k̂ and q̂ (scaled), the cumulative decay Γ ----
    # In SLICE-column pieces too: the row norms first, over every piece.
    offs_n = tl.arange(0, SLICE)
    if PHASES & 1:
        p_kt = k + tok[:, None] * stride_k_t + i_h * stride_k_h
        p_qt = q + tok[:, None] * stride_q_t + i_h * stride_q_h
        p_gt = g + tok[:, None] * stride_g_t + i_hv * stride_g_h
        if USE_QK_L2NORM:
            ss_k = tl.zeros([C], dtype=tl.float32)
            ss_q = tl.zeros([C], dtype=tl.float32)
            for kk in tl.static_range(0, BLOCK_K, SLICE):
                m = mask_c[:, None] & ((kk + offs_n) < K)[None, :]
                b_k = tl.load(p_kt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
                b_q = tl.load(p_qt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
                ss_k += tl.sum(b_k * b_k, axis=1)
                ss_q += tl.sum(b_q * b_q, axis=1)
            # reciprocals: every phase multiplies (a division an element costs about ten instructions)
            inv_k = 1.0 / tl.sqrt(ss_k + 1e-6)
            inv_q = 1.0 / tl.sqrt(ss_q + 1e-6)
            if QK_FROM_INPUT:
                tl.store(wn + offs_c * 2, inv_k)
                tl.store(wn + offs_c * 2 + 1, inv_q)
        for kk in tl.static_range(0, BLOCK_K, SLICE):
            in_k = (kk + offs_n) < K
            m = mask_c[:, None] & in_k[None, :]
            p_sl = offs_c[:, None] * BLOCK_K + kk + offs_n[None, :]
            if not QK_FROM_INPUT:
                b_k = tl.load(p_kt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
                b_q = tl.load(p_qt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
                if USE_QK_L2NORM:
                    b_k = b_k * inv_k[:, None]
                    b_q = b_q * inv_q[:, None]
                tl.store(wk + p_sl, b_k)
                tl.store(wq + p_sl, b_q * scale)
            b_g = tl.load(p_gt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
            if GATE_IN_KERNEL:
                A_h = tl.load(A_log + i_hv).to(tl.float32)
                bias = tl.load(dt_bias + i_hv * K + kk + offs_n, mask=in_k, other=0.0).to(tl.float32)
                b_g = kda_log_decay(b_g, bias[None, :], A_h, lower_bound, SAFE_GATE)
            b_g = tl.where(m, b_g, 0.0)  # rows past the chunk's tokens: no decay, so Γ_C is the last token's
            tl.store(ww + p_sl, tl.cumsum(b_g, axis=0))  # Γ: chunk-local, inclusive, <= 0 and non-increasing
    tl.debug_barrier()

    # ---- A (β-scaled, strictly lower) and P (lower) ----
    # By column block j (the pairs whose earlier token r is in sub-block j), over all the rows
    # below it at once: a [C, K] x [K, 16] product ([C / 2, K] in block_programs' lower launch),
    # the rows split over the warps (16-row products would copy their left operand into every
    # warp). Factored at a token b, e^(Γ_s - Γ_b) · e^(Γ_b - Γ_r) = e^(Γ_s - Γ_r):
    # - b the token before sub-block j, the block's own rows included, where the sub-block's
    #   log-decay spread (Γ_b - Γ of its last token, per channel) is at most ``diag_spread_max``:
    #   e^(Γ_b - Γ_r) <= e^spread, the only positive exponent (e^60 is far inside float32), and
    #   a left factor that underflows belongs to a term below e^(spread - 87);
    # - else b the last token of sub-block j, rows below the block only (both factors <= 1),
    #   and the block's own pairs take their exact decays element-wise, a column at a time on
    #   [16, SLICE] pieces (the default gate is unbounded: no factoring inside a steep block).
    # Both phases decide from the same workspace values, so they agree on every block.
    offs_s = tl.arange(0, 16)
    if PHASES & 2:
        for i in range(NB):  # a loop, not unrolled: unrolled sub-blocks keep each other's tiles live
            if SUB_BLOCK_PROGRAMS:
                run = i == tl.program_id(2)
            else:
                run = i >= 0
            if run:
                spread = _block_spread(ww, i, offs_k, BLOCK_K)
                if spread > diag_spread_max:
                    rows = i * 16 + offs_s
                    beta_i = _beta_values(beta, t0 + rows, rows < n_tok, stride_b_t, stride_b_h, i_hv, BETA_MODE)
                    if STEEP_BY_SLICE:
                        _steep_block_pairs_by_slice(wa, wp, ww, wk, wq, wn, k_h, q_h, i, beta_i, t0, n_tok,
                                                    stride_k_t, stride_q_t, scale, K, BLOCK_K, C, SLICE,
                                                    USE_QK_L2NORM, QK_FROM_INPUT)
                    else:  # a column at a time
                        for r in range(16):
                            a_col = tl.zeros([16], dtype=tl.float32)
                            p_col = tl.zeros([16], dtype=tl.float32)
                            for kk in tl.static_range(0, BLOCK_K, SLICE):
                                p_ik = rows[:, None] * BLOCK_K + kk + offs_n[None, :]
                                k_r, G_r = _steep_column(ww, wk, wn, k_h, i * 16 + r, kk, offs_n, t0, n_tok,
                                                         stride_k_t, K, BLOCK_K, USE_QK_L2NORM, QK_FROM_INPUT)
                                d = tl.where((offs_s >= r)[:, None], tl.load(ww + p_ik) - G_r[None, :], float("-inf"))
                                kr = k_r[None, :] * tl.exp(d)
                                if QK_FROM_INPUT:
                                    a_col += tl.sum(_unit_rows(k_h, wn, 0, 1.0, t0, n_tok, rows, kk + offs_n, stride_k_t,
                                                               K, USE_QK_L2NORM) * kr, axis=1)
                                    p_col += tl.sum(_unit_rows(q_h, wn, 1, scale, t0, n_tok, rows, kk + offs_n,
                                                               stride_q_t, K, USE_QK_L2NORM) * kr, axis=1)
                                else:
                                    a_col += tl.sum(tl.load(wk + p_ik) * kr, axis=1)
                                    p_col += tl.sum(tl.load(wq + p_ik) * kr, axis=1)
                            tl.store(wa + rows * C + i * 16 + r, tl.where(offs_s > r, a_col * beta_i, 0.0))
                            tl.store(wp + rows * C + i * 16 + r, p_col.to(wp.dtype.element_ty))
    b_beta = _beta_values(beta, tok, mask_c, stride_b_t, stride_b_h, i_hv, BETA_MODE)
    if PHASES & 4:
        if PRODUCTS_BY_SLICE:
            _pair_products_by_slice(wk, wq, ww, wa, wp, wn, k_h, q_h, b_beta, t0, n_tok, stride_k_t, stride_q_t,
                                    scale, diag_spread_max, K, BLOCK_K, C, SLICE, USE_QK_L2NORM, QK_FROM_INPUT,
                                    DOT_PRECISION)
        else:  # a column block at a time: fewer accumulators live, every slice loaded once a block
            if BLOCK_LAUNCH == 0:  # every block, in turn
                for j in range(NB):
                    _column_block_products(wa, wp, wk, wq, ww, wn, k_h, q_h, offs_c, b_beta, j, t0, n_tok,
                                           stride_k_t, stride_q_t, scale, diag_spread_max, K, BLOCK_K, C, SLICE,
                                           USE_QK_L2NORM, QK_FROM_INPUT, DOT_PRECISION)
            else:  # a program per block: of the upper half on every row (BLOCK_LAUNCH 1), of the
                #      lower half on the lower half of the rows, all it covers (2)
                rows, betas, j = offs_c, b_beta, part
                if BLOCK_LAUNCH == 2:
                    rows = C // 2 + tl.arange(0, C // 2)
                    betas = _beta_values(beta, t0 + rows, rows < n_tok, stride_b_t, stride_b_h, i_hv, BETA_MODE)
                    j = NB // 2 + part
                _column_block_products(wa, wp, wk, wq, ww, wn, k_h, q_h, rows, betas, j, t0, n_tok, stride_k_t,
                                       stride_q_t, scale, diag_spread_max, K, BLOCK_K, C, SLICE, USE_QK_L2NORM,
                                       QK_FROM_INPUT, DOT_PRECISION)
    tl.debug_barrier()

    if PHASES & 8:
        # ---- T = (I + A)^-1 in place of A ----
        # (with DIAGONAL_INVERTED the 16 x 16 diagonal blocks hold their inverses: diagonal_inverse)
        if INVERSE_BY_DOUBLING:
            _invert_unit_lower_by_doubling(wa, C, NB, DOT_PRECISION, DIAGONAL_INVERTED)
        else:
            _invert_unit_lower(wa, C, NB, DOT_PRECISION, DIAGONAL_INVERTED)
        tl.debug_barrier()

    if PHASES & 16:
        # ---- w = T diag(β)(k̂ ⊙ e^Γ), u = T diag(β) v, q̂ ⊙ e^Γ, k̂ ⊙ e^(Γ_C - Γ), e^Γ_C ----
        # (factors.py) a K and a V slice at a time: all of them here, or with PARTS > 1
        # this program's part only (a program per slice)
        p_cc = offs_c[:, None] * C + offs_c[None, :]
        blk = offs_c // 16
        b_T = tl.load(wa + p_cc, mask=blk[:, None] >= blk[None, :], other=0.0)
        f_row = ws_row * BLOCK_K
        g_last = ws_g + (c64 * HV + i_hv) * BLOCK_K
        u_row = ws_u + ws_row * BLOCK_V
        v_h = v + i_hv * stride_v_h
        if PARTS > 1:
            if part * SLICE < BLOCK_K:
                _k_slice_factors(b_T, b_beta, part * SLICE, ww, wk, wq, wn, k_h, q_h, f_w + f_row, f_q + f_row,
                                 f_k + f_row, g_last, t0, n_tok, stride_k_t, stride_q_t, scale, K, BLOCK_K, C, SLICE,
                                 USE_QK_L2NORM, QK_FROM_INPUT, FACTORS_IN_PLACE, DOT_PRECISION)
            if part * SLICE < BLOCK_V:
                _v_slice_factors(b_T, b_beta, part * SLICE, v_h, tok, mask_c, stride_v_t, u_row, V, BLOCK_V, C,
                                 SLICE, DOT_PRECISION)
        else:
            for kk in tl.static_range(0, BLOCK_K, SLICE):
                _k_slice_factors(b_T, b_beta, kk, ww, wk, wq, wn, k_h, q_h, f_w + f_row, f_q + f_row, f_k + f_row,
                                 g_last, t0, n_tok, stride_k_t, stride_q_t, scale, K, BLOCK_K, C, SLICE,
                                 USE_QK_L2NORM, QK_FROM_INPUT, FACTORS_IN_PLACE, DOT_PRECISION)
            for vv in tl.static_range(0, BLOCK_V, SLICE):
                _v_slice_factors(b_T, b_beta, vv, v_h, tok, mask_c, stride_v_t, u_row, V, BLOCK_V, C, SLICE,
                                 DOT_PRECISION)


@triton.jit
def _beta_values(beta, tok, mask, stride_b_t, stride_b_h, i_hv, BETA_MODE: tl.constexpr):
    """β of the tokens ``tok`` (zeros where not ``mask``) from β or its logit."""
    b = tl.load(beta + tok * stride_b_t + i_hv * stride_b_h, mask=mask, other=0.0).to(tl.float32)
    if BETA_MODE == 1:
        b = tl.sigmoid(b)
    if BETA_MODE == 2:
        b = tl.sigmoid(b) * 2.0
    return tl.where(mask, b, 0.0)


_chunk_prep = CachedKernel(_chunk_prep_kernel)
