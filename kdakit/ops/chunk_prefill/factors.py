"""The prep's last phase of ``chunk_prefill``: the chain's factors of one (chunk, value head).

With ``T = (I + A)^-1`` (``[C, C]``, float32, in the workspace) and the chunk-local cumulative
log-decay Γ, per K slice ``w = T diag(β)(k̂ ⊙ e^Γ)``, ``q̂ ⊙ e^Γ``, ``k̂ ⊙ e^(Γ_C - Γ)`` and
``e^Γ_C``, and per V slice ``u = T diag(β) v``. A slice depends on no other slice, so the
phase runs as a loop over the slices in one program or as a program per slice
(``ChunkConfig.factor_programs``): the same products on the same operands, the same bits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .products import _unit_slice


@triton.jit
def _k_slice_factors(b_T, b_beta, kk, ww, wk, wq, wn, k_h, q_h, f_w, f_q, f_k, g_last, t0, n_tok, stride_k_t,
                     stride_q_t, scale, K: tl.constexpr, BLOCK_K: tl.constexpr, C: tl.constexpr, SLICE: tl.constexpr,
                     NORMED: tl.constexpr, QK_FROM_INPUT: tl.constexpr, FACTORS_IN_PLACE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """K slice ``kk`` of w, q̂ ⊙ e^Γ and k̂ ⊙ e^(Γ_C - Γ) (``f_w``, ``f_q``, ``f_k``: this chunk's
    rows, in their dtype) and of e^Γ_C (``g_last``). With ``FACTORS_IN_PLACE`` the float32
    factors go over the Γ, k̂ and q̂ they are made of, so the slice's reads finish first."""
    offs_c = tl.arange(0, C)
    offs_n = tl.arange(0, SLICE)
    p_sl = offs_c[:, None] * BLOCK_K + kk + offs_n[None, :]
    G = tl.load(ww + p_sl)
    G_last = tl.load(ww + (C - 1) * BLOCK_K + kk + offs_n)
    kn = _unit_slice(wk, k_h, wn, 0, 1.0, t0, n_tok, offs_c, kk + offs_n, stride_k_t, K, BLOCK_K, NORMED,
                     QK_FROM_INPUT)
    qn = _unit_slice(wq, q_h, wn, 1, scale, t0, n_tok, offs_c, kk + offs_n, stride_q_t, K, BLOCK_K, NORMED,
                     QK_FROM_INPUT)
    e_G = tl.exp(G)
    b_w = tl.dot(b_T, kn * e_G * b_beta[:, None], input_precision=DOT_PRECISION)
    if FACTORS_IN_PLACE:
        tl.debug_barrier()
    tl.store(f_w + p_sl, b_w.to(f_w.dtype.element_ty))
    tl.store(f_q + p_sl, (qn * e_G).to(f_q.dtype.element_ty))
    tl.store(f_k + p_sl, (kn * tl.exp(G_last[None, :] - G)).to(f_k.dtype.element_ty))
    tl.store(g_last + kk + offs_n, tl.exp(G_last))


@triton.jit
def _v_slice_factors(b_T, b_beta, vv, v_h, tok, mask_c, stride_v_t, f_u, V: tl.constexpr, BLOCK_V: tl.constexpr,
                     C: tl.constexpr, SLICE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """V slice ``vv`` of u (``f_u``: this chunk's rows) from the value input ``v_h`` (this head)."""
    offs_c = tl.arange(0, C)
    offs_v = vv + tl.arange(0, SLICE)
    b_v = tl.load(v_h + tok[:, None] * stride_v_t + offs_v[None, :], mask=mask_c[:, None] & (offs_v < V)[None, :],
                  other=0.0).to(tl.float32)
    b_u = tl.dot(b_T, b_v * b_beta[:, None], input_precision=DOT_PRECISION)
    tl.store(f_u + offs_c[:, None] * BLOCK_V + offs_v[None, :], b_u.to(f_u.dtype.element_ty))
