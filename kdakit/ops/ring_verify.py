"""Ring-mode verify: the outputs of T = 1 + num_spec steps from ONE read of the state.

A ring verify writes no state, only the per-step raw inputs, so its outputs need not
be computed step by step. With ``G_t = g_1 + ... + g_t`` (per key channel) and
``u_t = β_t (v_t - S_{t-1} diag(exp g_t) k_t)`` the delta rule unrolls to

    S_{t-1} diag(exp g_t) k_t = S_0 (exp(G_t) ⊙ k_t) + Σ_{s<t} A[t, s] u_s
    o_t = S_t q_t              = S_0 (exp(G_t) ⊙ q_t) + Σ_{s≤t} B[t, s] u_s
    A[t, s] = Σ_c k_s[c] k_t[c] exp(G_t[c] - G_s[c]),   B[t, s] = same with q_t

so the state enters only through two small matrix products ``S_0 · [exp(G) ⊙ k]ᵀ`` and
``S_0 · [exp(G) ⊙ q]ᵀ``; what stays sequential is a T x T triangular solve on V-vectors.
Every exponent is ``G_t - G_s <= 0`` (s <= t): nothing overflows, whatever the gate.
The ring commit replays the steps one by one (``commit.py``); it is that replay, not
this kernel, that must equal a snapshot commit bitwise.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .launch import CachedKernel
from .mtp_verify_inputs import conv_silu_steps, row_of, store_windows
from .triton_math import kda_log_decay


@triton.jit
def _rows_l2_normalize(x):
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _ring_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out,
    w_q, w_k, w_v, bias_q, bias_k, bias_v,
    cs_q, cs_k, cs_v, ic_q, ic_k, ic_v,
    ring_k, ring_v, ring_g, ring_beta,
    stride_state_slot,
    s_csq_slot, s_csq_c, s_csq_w, s_csk_slot, s_csk_c, s_csk_w, s_csv_slot, s_csv_c, s_csv_w,
    s_icq_row, s_icq_t, s_ick_row, s_ick_t, s_icv_row, s_icv_t,
    s_rk_slot, s_rv_slot, s_rg_slot, s_rb_slot, ring_len,
    scale, lower_bound,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_CONV: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One program: BLOCK_V rows of one (request, value head). Data shared by the programs
    # of a key head (the k ring, q/k windows) has one writer: the group's first value head,
    # V tile 0. BLOCK_T >= 16 (tl.dot); steps past T are zeroed and never stored.
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    G: tl.constexpr = HV // H
    i_h = i_hv // G
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    steps = tl.arange(0, BLOCK_T)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_t = steps < T
    slot = tl.load(slot_indices + i_n).to(tl.int64)
    row = tl.load(scratch_indices + i_n).to(tl.int64)
    live = slot >= 0  # padding rows: zero output, nothing else read or written
    writes_head = live & (i_v == 0)
    writes_key_head = writes_head & (i_hv % G == 0)
    S0 = tl.load(state + slot * stride_state_slot + i_hv * V * K + offs_v[:, None] * K + offs_k[None, :],
                 mask=live & (mask_v[:, None] & mask_k[None, :]), other=0.0).to(tl.float32)

    n64 = i_n.to(tl.int64)
    x_q = q + n64 * T * H * K                     # this request's token 0, channel 0
    x_k = k + n64 * T * H * K
    x_v = v + n64 * T * HV * V
    ch_qk = i_h * K + offs_k
    ch_v = i_hv * V + offs_v
    tk_mask = mask_t[:, None] & mask_k[None, :]
    tv_mask = mask_t[:, None] & mask_v[None, :]
    if HAS_CONV:
        win_q = cs_q + slot * s_csq_slot
        win_k = cs_k + slot * s_csk_slot
        win_v = cs_v + slot * s_csv_slot
        # Post-conv values are stored in the activation dtype by an unfused conv: round alike.
        q_all = conv_silu_steps(x_q, H * K, win_q, s_csq_c, s_csq_w, w_q, bias_q, ch_qk, mask_k, live, 0,
                                T, W, BLOCK_T, HAS_CONV_BIAS).to(q.dtype.element_ty).to(tl.float32)
        k_all = conv_silu_steps(x_k, H * K, win_k, s_csk_c, s_csk_w, w_k, bias_k, ch_qk, mask_k, live, 0,
                                T, W, BLOCK_T, HAS_CONV_BIAS).to(q.dtype.element_ty).to(tl.float32)
        v_all = conv_silu_steps(x_v, HV * V, win_v, s_csv_c, s_csv_w, w_v, bias_v, ch_v, mask_v, live, 0,
                                T, W, BLOCK_T, HAS_CONV_BIAS).to(q.dtype.element_ty).to(tl.float32)
        store_windows(ic_q + row * s_icq_row, s_icq_t, x_q, H * K, win_q, s_csq_c, s_csq_w, ch_qk, mask_k,
                      live, writes_key_head, 0, T, W, BLOCK_T)
        store_windows(ic_k + row * s_ick_row, s_ick_t, x_k, H * K, win_k, s_csk_c, s_csk_w, ch_qk, mask_k,
                      live, writes_key_head, 0, T, W, BLOCK_T)
        store_windows(ic_v + row * s_icv_row, s_icv_t, x_v, HV * V, win_v, s_csv_c, s_csv_w, ch_v, mask_v,
                      live, live, 0, T, W, BLOCK_T)
    else:
        q_all = tl.load(x_q + steps[:, None] * H * K + ch_qk[None, :], mask=tk_mask, other=0.0).to(tl.float32)
        k_all = tl.load(x_k + steps[:, None] * H * K + ch_qk[None, :], mask=tk_mask, other=0.0).to(tl.float32)
        v_all = tl.load(x_v + steps[:, None] * HV * V + ch_v[None, :], mask=tv_mask, other=0.0).to(tl.float32)
    tok = n64 * T + steps
    a_all = tl.load(a + (tok[:, None] * HV + i_hv) * K + offs_k[None, :], mask=tk_mask, other=0.0)
    bias = tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    A_log_h = tl.load(A_log + i_hv).to(tl.float32)
    g_all = kda_log_decay(a_all.to(tl.float32), bias[None, :], A_log_h, lower_bound, SAFE_GATE)
    beta_all = tl.sigmoid(tl.load(b + tok * HV + i_hv, mask=mask_t, other=0.0).to(tl.float32))
    # the raw per-step inputs of the commit's replay
    tl.store(ring_k + slot * s_rk_slot + (i_h * ring_len + steps[:, None]) * K + offs_k[None, :],
             k_all.to(ring_k.dtype.element_ty), mask=tk_mask & writes_key_head)
    tl.store(ring_v + slot * s_rv_slot + (i_hv * ring_len + steps[:, None]) * V + offs_v[None, :],
             v_all.to(ring_v.dtype.element_ty), mask=tv_mask & live)
    tl.store(ring_g + slot * s_rg_slot + (i_hv * ring_len + steps[:, None]) * K + offs_k[None, :],
             g_all.to(ring_g.dtype.element_ty), mask=tk_mask & writes_head)
    tl.store(ring_beta + slot * s_rb_slot + i_hv * ring_len + steps,
             beta_all.to(ring_beta.dtype.element_ty), mask=mask_t & writes_head)

    # Steps past T (and a conv's read-ahead into them) are zeroed: they come after every
    # real step, so they could only reach outputs that are never stored, but zeros keep
    # them finite.
    q_hat = tl.where(mask_t[:, None], _rows_l2_normalize(q_all) * scale, 0.0)
    k_hat = tl.where(mask_t[:, None], _rows_l2_normalize(k_all), 0.0)
    g_all = tl.where(tk_mask, g_all, 0.0)
    G_all = tl.cumsum(g_all, axis=0)
    decay = tl.exp(G_all)
    # [BLOCK_V, BLOCK_T]: S_0 (exp(G_t) ⊙ k_t) and S_0 (exp(G_t) ⊙ q_t) for every step t
    SK = tl.dot(S0, tl.trans(k_hat * decay), input_precision=DOT_PRECISION)
    SQ = tl.dot(S0, tl.trans(q_hat * decay), input_precision=DOT_PRECISION)
    cols = steps[None, :]
    residual = tl.trans(tl.where(tv_mask, v_all, 0.0)) - SK   # v_t - S_0 (exp(G_t) ⊙ k_t), [BLOCK_V, BLOCK_T]
    U = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
    for t in tl.static_range(T):
        G_t = row_of(G_all, t, BLOCK_T)
        k_t = row_of(k_hat, t, BLOCK_T)
        q_t = row_of(q_hat, t, BLOCK_T)
        beta_t = tl.sum(tl.where(steps == t, beta_all, 0.0), axis=0)
        # decay from step s to step t, rows s <= t (the others are exp(-inf) = 0)
        k_decayed = k_hat * tl.exp(tl.where(steps[:, None] <= t, G_t[None, :] - G_all, float("-inf")))
        a_row = tl.where(steps < t, tl.sum(k_decayed * k_t[None, :], axis=1), 0.0)
        b_row = tl.sum(k_decayed * q_t[None, :], axis=1)
        u_t = beta_t * tl.sum(tl.where(cols == t, residual, 0.0) - U * a_row[None, :], axis=1)
        U += tl.where(cols == t, u_t[:, None], 0.0)
        o_t = tl.sum(tl.where(cols == t, SQ, 0.0) + U * b_row[None, :], axis=1)
        tl.store(out + ((n64 * T + t) * HV + i_hv) * V + offs_v, tl.where(live, o_t, 0.0).to(out.dtype.element_ty),
                 mask=mask_v)


_ring_verify = CachedKernel(_ring_verify_kernel)


def ring_verify_tile(V: int, K: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps): the whole of V in one program (the T x T work is per head),
    pinned from the H200 sweep (benchmarks/results)."""
    return max(16, triton.next_power_of_2(V)), 8


def launch_ring_verify(grid_args: dict, *, T: int, V: int, K: int, config=None):
    """Launch with the arguments ``mtp_verify_triton`` prepared (``grid_args``)."""
    block_v, num_warps, *precision = config or ring_verify_tile(V, K)
    meta = dict(grid_args["constexprs"], BLOCK_K=triton.next_power_of_2(K), BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_V=block_v,
                DOT_PRECISION=precision[0] if precision else "ieee")
    N, HV = grid_args["N"], grid_args["HV"]
    _ring_verify((triton.cdiv(V, block_v), HV, N), grid_args["args"], meta, num_warps=num_warps, num_stages=1)
