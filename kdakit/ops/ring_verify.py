"""Ring-mode verify in the chunk (WY) form: every step's output from one read of the state.

A ring verify keeps no state after any step (the commit replays the accepted prefix from
the rings), so it need not carry the state through the steps. With ``G_t`` the running sum
of the log-decays, ``q̂, k̂`` normalised, ``S_0`` the slot's state, and

    A[t, s] = Σ_k k̂_t k̂_s e^(G_t - G_s)  (s < t),     B[t, s] = Σ_k q̂_t k̂_s e^(G_t - G_s)  (s <= t),
    M = B (I + diag(β) A)^-1 diag(β),

Steps 4-6 of the one-token math (docs/design.md), unrolled over the request's tokens, give

    o_t = S_0 x_t + Σ_s M[t, s] v_s,   x_t = q̂_t e^G_t - Σ_s M[t, s] k̂_s e^G_s.

Two kernels: ``_ring_verify_steps`` (one small program per request and value head: the
pair sums, the triangular solve, ``x``, ``M`` and the k, g, β ring entries), then
``_ring_verify_state`` (the state streamed through shared memory into one matrix product
with ``x``, plus ``v^T M^T``; the v ring entries), a dependent launch of the first. With
``RingVerifyConfig.state_from_inputs`` the state kernel forms ``S_0 (q̂ e^G)^T`` and
``S_0 (k̂ e^G)^T`` from the inputs before it waits, and ``o = S_0 (q̂ e^G)^T + (v^T - S_0 (k̂ e^G)^T) M^T``
(the same ``o``), so its read of the state runs beside the steps kernel. Under the
default gate each ``e^(G_t - G_s)`` is taken pair by pair (``e^G_t · e^-G_s`` overflows for
fast-decaying channels); under the safe gate with ``T |lower_bound| <= 80`` the pair sums factor
as ``(k̂ e^G)(k̂ e^-G)^T`` (see ``FACTOR_BOUND``).

Trees (``parents=``, the ring mode of ``tree_verify``): node ``t``'s state is the chain's along
its root-to-node path, so the same formulas hold with ``G_t`` the sum of the log-decays on
that path and the pairs ``(t, s)`` restricted to ``s`` on it (``s`` an ancestor of ``t``, or
``t`` itself for ``B``). An ancestor's index is below its descendant's, so ``A`` stays
strictly lower triangular and the forward substitution is unchanged; a path holds at most
``T`` nodes, so the factoring bound holds as well; the state kernel does not see the tree.
One read of the state serves every node, where the recurrence refolds each node off the
chain from the committed state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import errors
from .launch import CachedKernel, cdiv, next_power_of_2
from .tree_conv import count_invalid_parents, load_tree_parents, tree_parent
from .triton_math import count_bad_row, count_bad_rows, kda_log_decay, mask_if, verify_request


# The most nodes a tree's chunk form takes: a node's path is a bit set of one 64-bit word
# (``tree_path_bits``); larger trees run the recurrence.
MAX_TREE_NODES = 64


@triton.jit
def tree_path_bits(par, T: tl.constexpr, BLOCK_T: tl.constexpr):
    """[BLOCK_T] integers, bit ``s`` of entry ``t`` set where node ``s`` is ``t`` or an ancestor
    of ``t`` (``par`` from ``load_tree_parents``; ``T <= MAX_TREE_NODES``; zero past T). A
    node's set is its parent's plus itself, built root first. Each pair test is then a shift
    of a small vector in registers, not a column reduced out of a [T, T] mask (which spilled
    the steps kernel's registers several times over)."""
    BITS: tl.constexpr = tl.int32 if BLOCK_T <= 32 else tl.int64  # half the registers where it fits
    nodes = tl.arange(0, BLOCK_T)
    bits = tl.zeros([BLOCK_T], dtype=BITS)
    for t in tl.static_range(T):
        above = tl.sum(tl.where(nodes == tree_parent(par, t, BLOCK_T), bits, 0), axis=0)  # 0 for p = -1
        bits = tl.where(nodes == t, above | (tl.full([], 1, BITS) << t), bits)
    return bits


@triton.jit
def _pair_sums_by_column(k_hat, q_hat, G_cum, path_bits, offs_t, T: tl.constexpr, BLOCK_T: tl.constexpr,
                         TREE: tl.constexpr):
    """A and B one column s at a time on [T, K] tiles (no [T, T, K] products), each decay
    ``e^(G_t - G_s)`` taken pair by pair (zero off the pairs: t < s, or s off t's path): row s
    of a tile is picked out exactly (one value plus zeros), within each thread's registers
    as the program is one warp. Safe whatever the gate."""
    A = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    B = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for s in tl.static_range(T):
        row_s = offs_t[:, None] == s
        k_s = tl.sum(tl.where(row_s, k_hat, 0.0), axis=0)
        G_s = tl.sum(tl.where(row_s, G_cum, 0.0), axis=0)
        if TREE:  # the rows t whose path holds s
            pairs = ((path_bits >> s) & 1) != 0
        else:
            pairs = offs_t >= s
        k_decayed = k_s[None, :] * tl.exp(tl.where(pairs[:, None], G_cum - G_s[None, :], float("-inf")))
        A = tl.where(offs_t[None, :] == s, tl.sum(k_hat * k_decayed, axis=1)[:, None], A)
        B = tl.where(offs_t[None, :] == s, tl.sum(q_hat * k_decayed, axis=1)[:, None], B)
    return A, B


@triton.jit
def _pair_sums_factored_dots(k_hat, k_gated, q_gated, G_cum, mask_tk, DOT_PRECISION: tl.constexpr):
    """A and B (every pair, masked by the caller) as two tensor-core products factored at the
    committed state: (k̂ e^G)(k̂ e^-G)ᵀ and (q̂ e^G)(k̂ e^-G)ᵀ. Only where e^-G stays finite and
    the products cannot overflow (|G| bounded: the caller decides)."""
    k_ungated = k_hat * tl.exp(tl.where(mask_tk, -G_cum, 0.0))
    A = tl.dot(k_gated, tl.trans(k_ungated), input_precision=DOT_PRECISION)
    B = tl.dot(q_gated, tl.trans(k_ungated), input_precision=DOT_PRECISION)
    return A, B


@triton.jit
def _ring_verify_steps_kernel(
    q, k, a, b, A_log, dt_bias, slot_indices, scratch_indices, parents, x_rows, m_rows,
    ring_k, ring_g, ring_beta, errors, s_rk_slot, s_rg_slot, s_rb_slot, ring_len,
    num_slots, num_rows, scale, lower_bound,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SAFE_GATE: tl.constexpr, FACTORED: tl.constexpr,
    TREE: tl.constexpr, STORE_X: tl.constexpr, PAIR_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_SPREAD_MAX: tl.constexpr,
    WAIT_FOR_TOKENS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, CHECK_ROWS: tl.constexpr,
    ERR_INDEX: tl.constexpr,
):
    # One program per (request, value head): M, and x unless the state kernel forms its
    # products from the inputs (STORE_X false; v enters in the state kernel). The k
    # ring has one writer per key head: the group's first value head. TREE: the pairs and
    # decay sums follow each node's root-to-node path (``parents`` [N, T]); otherwise the
    # steps form a chain (``parents`` is not read).
    i_hv, i_n = tl.program_id(0), tl.program_id(1)
    if LAUNCH_DEPENDENTS:  # the state kernel may start now
        gdc_launch_dependents()
    G: tl.constexpr = HV // H
    i_h = i_hv // G
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t = offs_t < T
    mask_tk = mask_t[:, None] & (offs_k < K)[None, :]
    # Padding rows, and indices past their buffers (as every kernel of the verify decides).
    slot, row, live = verify_request(slot_indices, scratch_indices, i_n, num_slots, num_rows, CHECK_ROWS)
    if TREE:
        # tree_verify's count, by value head 0: a claimed slot whose slot or row is outside
        # its buffer, once; for a live request, each node whose parent is invalid.
        if ERR_INDEX >= 0:
            if i_hv == 0:
                n_bad = ((slot >= 0) & ~live).to(tl.int32)
                if live:
                    n_bad = count_invalid_parents(parents + i_n.to(tl.int64) * T, T, BLOCK_T)
                count_bad_rows(errors, n_bad, ERR_INDEX)
    else:
        count_bad_row(errors, (slot >= 0) & ~live & (i_hv == 0), ERR_INDEX)
    bias = tl.load(dt_bias + i_hv * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    A_log_h = tl.load(A_log + i_hv).to(tl.float32)
    if WAIT_FOR_TOKENS:  # q and k come from the conv prologue launched just before
        gdc_wait()

    tok = i_n.to(tl.int64) * T + offs_t
    qk_rows = ((tok * H + i_h) * K)[:, None] + offs_k[None, :]
    q_raw = tl.load(q + qk_rows, mask=mask_tk, other=0.0).to(tl.float32)
    k_in = tl.load(k + qk_rows, mask=mask_tk, other=0.0)
    a_t = tl.load(a + ((tok * HV + i_hv) * K)[:, None] + offs_k[None, :], mask=mask_tk, other=0.0).to(tl.float32)
    g = tl.where(mask_tk, kda_log_decay(a_t, bias[None, :], A_log_h, lower_bound, SAFE_GATE), 0.0)
    beta = tl.sigmoid(tl.load(b + tok * HV + i_hv, mask=mask_t, other=0.0).to(tl.float32))

    # The commit's replay reads these (k before its L2 norm).
    ring_rows_k = (offs_t * K)[:, None] + offs_k[None, :]
    tl.store(ring_k + slot * s_rk_slot + i_h * ring_len * K + ring_rows_k, k_in.to(ring_k.dtype.element_ty),
             mask=mask_if(mask_tk, live & (i_hv % G == 0)))
    tl.store(ring_g + slot * s_rg_slot + i_hv * ring_len * K + ring_rows_k, g.to(ring_g.dtype.element_ty),
             mask=mask_if(mask_tk, live))
    tl.store(ring_beta + slot * s_rb_slot + i_hv * ring_len + offs_t, beta.to(ring_beta.dtype.element_ty),
             mask=mask_if(mask_t, live))

    k_raw = k_in.to(tl.float32)
    q_hat = q_raw * (scale / tl.sqrt(tl.sum(q_raw * q_raw, axis=1) + 1e-6))[:, None]
    k_hat = k_raw / tl.sqrt(tl.sum(k_raw * k_raw, axis=1) + 1e-6)[:, None]
    if TREE:
        # on_path[t, s]: s is t or an ancestor of t (an invalid parent is the committed
        # state, as load_tree_parents maps it); G_cum[t]: the log-decays summed along t's
        # path, root first (its parent's sum plus its own; with PAIR_DOTS one product of
        # the path matrix with g, the same sums in another order).
        par = load_tree_parents(parents + i_n.to(tl.int64) * T, T, BLOCK_T)
        path_bits = tree_path_bits(par, T, BLOCK_T)
        on_path = ((path_bits[:, None] >> offs_t[None, :].to(path_bits.dtype)) & 1) != 0
        if PAIR_DOTS:
            G_cum = tl.dot(on_path.to(tl.float32), g, input_precision="ieee")
        else:
            G_cum = g
            for t in tl.static_range(1, T):  # the parent's row is final (p < t); none for p = -1
                G_p = tl.sum(tl.where(offs_t[:, None] == tree_parent(par, t, BLOCK_T), G_cum, 0.0), axis=0)
                G_cum = tl.where(offs_t[:, None] == t, G_cum + G_p[None, :], G_cum)
        pair_mask = on_path
    else:
        path_bits = offs_t  # not read
        G_cum = tl.cumsum(g, axis=0)
        pair_mask = offs_t[:, None] >= offs_t[None, :]
    # The pair sums: elementwise one column s at a time on [T, K] tiles (_pair_sums_by_column), or
    # with PAIR_DOTS as two tensor-core products factored at the committed state, e^(G_t - G_s) =
    # e^G_t · e^-G_s, wherever that is safe: under FACTORED (the launcher's rule) or where this
    # program's largest decay -G is at most DOT_SPREAD_MAX (decided here, from the decays).
    e_G = tl.exp(G_cum)
    k_gated = k_hat * e_G
    q_gated = q_hat * e_G
    if PAIR_DOTS:
        if FACTORED:
            A, B = _pair_sums_factored_dots(k_hat, k_gated, q_gated, G_cum, mask_tk, DOT_PRECISION)
        else:
            steep = tl.max(tl.max(tl.where(mask_tk, -G_cum, 0.0), axis=1), axis=0) > DOT_SPREAD_MAX
            if steep:
                A, B = _pair_sums_by_column(k_hat, q_hat, G_cum, path_bits, offs_t, T, BLOCK_T, TREE)
            else:
                A, B = _pair_sums_factored_dots(k_hat, k_gated, q_gated, G_cum, mask_tk, DOT_PRECISION)
        B = tl.where(pair_mask, B, 0.0)
    elif FACTORED:
        k_ungated = k_hat * tl.exp(-G_cum)
        A = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        B = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        for s in tl.static_range(T):
            k_s = tl.sum(tl.where(offs_t[:, None] == s, k_ungated, 0.0), axis=0)
            A = tl.where(offs_t[None, :] == s, tl.sum(k_gated * k_s[None, :], axis=1)[:, None], A)
            B = tl.where(offs_t[None, :] == s, tl.sum(q_gated * k_s[None, :], axis=1)[:, None], B)
        B = tl.where(pair_mask, B, 0.0)
    else:
        A, B = _pair_sums_by_column(k_hat, q_hat, G_cum, path_bits, offs_t, T, BLOCK_T, TREE)
    A = tl.where(pair_mask & (offs_t[:, None] != offs_t[None, :]), A, 0.0)

    # (I + diag(β) A)^-1 by forward substitution: row t needs only rows s < t.
    beta_A = beta[:, None] * A
    solve = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for t in tl.static_range(T):
        row = tl.sum(tl.where(offs_t[:, None] == t, beta_A, 0.0), axis=0)
        new = tl.where(offs_t == t, 1.0, 0.0) - tl.sum(row[:, None] * solve, axis=0)
        solve = tl.where(offs_t[:, None] == t, new[None, :], solve)
    if PAIR_DOTS:
        M = tl.dot(B, solve, input_precision=DOT_PRECISION) * beta[None, :]
    else:
        M = tl.sum(B[:, :, None] * solve[None, :, :], axis=1) * beta[None, :]

    head_rows = (i_n.to(tl.int64) * HV + i_hv) * T + offs_t
    if STORE_X:
        if PAIR_DOTS:
            x = q_gated - tl.dot(M, k_gated, input_precision=DOT_PRECISION)
        else:
            x = q_gated
            for s in tl.static_range(T):
                m_s = tl.sum(tl.where(offs_t[None, :] == s, M, 0.0), axis=1)
                x -= m_s[:, None] * tl.sum(tl.where(offs_t[:, None] == s, k_gated, 0.0), axis=0)[None, :]
        tl.store(x_rows + head_rows[:, None] * K + offs_k[None, :], x, mask=mask_tk)
    tl.store(m_rows + head_rows[:, None] * T + offs_t[None, :], M, mask=mask_t[:, None] & mask_t[None, :])


@triton.jit
def _gated_products_from_inputs(
    state_rows, q, k, a, A_log, dt_bias, parents, i_n, i_hv, live, mask_v, scale, lower_bound,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, DOT_T: tl.constexpr,
    BLOCK_V: tl.constexpr, K_CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SAFE_GATE: tl.constexpr, TREE: tl.constexpr,
):
    """``S_0 (q̂ e^G)^T`` and ``S_0 (k̂ e^G)^T`` ([BLOCK_V, DOT_T] each) from the verify's inputs:
    the q and k norms, the gate and its path sums formed here as the steps kernel forms them."""
    offs_t = tl.arange(0, DOT_T)
    mask_t = offs_t < T
    i_h = i_hv // (HV // H)
    tok = i_n.to(tl.int64) * T + offs_t
    qk_rows = (tok * H + i_h) * K
    q_sq = tl.zeros([DOT_T], dtype=tl.float32)
    k_sq = tl.zeros([DOT_T], dtype=tl.float32)
    for k0 in range(0, K, K_CHUNK):  # the norms span K, so they come first
        offs_c = k0 + tl.arange(0, K_CHUNK)
        # a padding row's tokens are not read: its products are zero whatever they hold
        mask_tc = mask_if(mask_t[:, None] & (offs_c < K)[None, :], live)
        q_c = tl.load(q + qk_rows[:, None] + offs_c[None, :], mask=mask_tc, other=0.0).to(tl.float32)
        k_c = tl.load(k + qk_rows[:, None] + offs_c[None, :], mask=mask_tc, other=0.0).to(tl.float32)
        q_sq += tl.sum(q_c * q_c, axis=1)
        k_sq += tl.sum(k_c * k_c, axis=1)
    q_scale = scale / tl.sqrt(q_sq + 1e-6)
    k_scale = 1.0 / tl.sqrt(k_sq + 1e-6)
    if TREE:  # on_path[t, s]: s is t or an ancestor of t, so on_path @ g sums g along t's path
        bits = tree_path_bits(load_tree_parents(parents + i_n.to(tl.int64) * T, T, DOT_T), T, DOT_T)
        on_path = (((bits[:, None] >> offs_t[None, :].to(bits.dtype)) & 1) != 0).to(tl.float32)
    A_log_h = tl.load(A_log + i_hv).to(tl.float32)
    acc_q = tl.zeros((BLOCK_V, DOT_T), dtype=tl.float32)
    acc_k = tl.zeros((BLOCK_V, DOT_T), dtype=tl.float32)
    for k0 in tl.range(0, K, K_CHUNK, num_stages=NUM_STAGES):
        offs_c = k0 + tl.arange(0, K_CHUNK)
        mask_c = offs_c < K
        mask_tc = mask_if(mask_t[:, None] & mask_c[None, :], live)
        S0 = tl.load(state_rows + offs_c[None, :], mask=mask_if(mask_v[:, None] & mask_c[None, :], live), other=0.0)
        q_c = tl.load(q + qk_rows[:, None] + offs_c[None, :], mask=mask_tc, other=0.0).to(tl.float32)
        k_c = tl.load(k + qk_rows[:, None] + offs_c[None, :], mask=mask_tc, other=0.0).to(tl.float32)
        a_c = tl.load(a + ((tok * HV + i_hv) * K)[:, None] + offs_c[None, :], mask=mask_tc, other=0.0).to(tl.float32)
        bias = tl.load(dt_bias + i_hv * K + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        g = tl.where(mask_tc, kda_log_decay(a_c, bias[None, :], A_log_h, lower_bound, SAFE_GATE), 0.0)
        if TREE:
            G_cum = tl.dot(on_path, g, input_precision="ieee")
        else:
            G_cum = tl.cumsum(g, axis=0)
        e_G = tl.exp(G_cum)
        acc_q = tl.dot(S0.to(tl.float32), tl.trans(q_c * q_scale[:, None] * e_G), acc_q, input_precision=DOT_PRECISION)
        acc_k = tl.dot(S0.to(tl.float32), tl.trans(k_c * k_scale[:, None] * e_G), acc_k, input_precision=DOT_PRECISION)
    return acc_q, acc_k


@triton.jit
def _ring_verify_state_kernel(
    state, q, k, v, a, A_log, dt_bias, parents, slot_indices, scratch_indices, x_rows, m_rows, out, ring_v,
    stride_state_slot, s_rv_slot, ring_len, num_slots, num_rows, scale, lower_bound,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    DOT_T: tl.constexpr, BLOCK_V: tl.constexpr, K_CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SAFE_GATE: tl.constexpr, TREE: tl.constexpr, FROM_INPUTS: tl.constexpr,
    WAIT_FOR_STEPS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, CHECK_ROWS: tl.constexpr,
):
    # One program: BLOCK_V state rows of one (request, value head); out = S_0 x^T + v^T M^T,
    # and these rows of the v ring. DOT_T >= 16 steps (a dot's smallest side); the steps
    # past T are zero. FROM_INPUTS: the state's read and products need nothing of the steps
    # kernel, so they run before the wait, beside it: with q̃ = q̂ e^G, k̃ = k̂ e^G and
    # x = q̃ - M k̃, out = S_0 q̃^T + (v^T - S_0 k̃^T) M^T.
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if LAUNCH_DEPENDENTS:  # the output norm may start loading its gate now
        gdc_launch_dependents()
    offs_t = tl.arange(0, DOT_T)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_t, mask_v = offs_t < T, offs_v < V
    # Padding rows, and indices past their buffers: zero output, nothing of the pool read.
    slot, row, live = verify_request(slot_indices, scratch_indices, i_n, num_slots, num_rows, CHECK_ROWS)
    head = i_n.to(tl.int64) * HV + i_hv
    state_rows = state + slot * stride_state_slot + i_hv * V * K + offs_v[:, None] * K
    if FROM_INPUTS:
        acc_q, acc_k = _gated_products_from_inputs(
            state_rows, q, k, a, A_log, dt_bias, parents, i_n, i_hv, live, mask_v, scale, lower_bound,
            T=T, H=H, HV=HV, K=K, DOT_T=DOT_T, BLOCK_V=BLOCK_V, K_CHUNK=K_CHUNK, NUM_STAGES=NUM_STAGES,
            DOT_PRECISION=DOT_PRECISION, SAFE_GATE=SAFE_GATE, TREE=TREE)
    if WAIT_FOR_STEPS:  # M (and x) come from the steps kernel (and v from the conv before it)
        gdc_wait()
    mask_vt = mask_v[:, None] & mask_t[None, :]
    tok = i_n.to(tl.int64) * T + offs_t
    # not read for a padding row: its output is exactly zero whatever its v holds (0 * NaN is not)
    vT = tl.load(v + (tok * HV + i_hv)[None, :] * V + offs_v[:, None], mask=mask_if(mask_vt, live), other=0.0)
    tl.store(ring_v + slot * s_rv_slot + i_hv * ring_len * V + offs_t[None, :] * V + offs_v[:, None],
             vT.to(ring_v.dtype.element_ty), mask=mask_if(mask_vt, live))
    M = tl.load(m_rows + (head * T + offs_t)[:, None] * T + offs_t[None, :],
                mask=mask_if(mask_t[:, None] & mask_t[None, :], live), other=0.0)
    if FROM_INPUTS:
        o = tl.dot(vT.to(tl.float32) - acc_k, tl.trans(M), acc_q, input_precision=DOT_PRECISION)
    else:
        x_head = x_rows + (head * T + offs_t)[:, None] * K
        acc = tl.zeros((BLOCK_V, DOT_T), dtype=tl.float32)
        for k0 in tl.range(0, K, K_CHUNK, num_stages=NUM_STAGES):
            offs_c = k0 + tl.arange(0, K_CHUNK)
            mask_c = offs_c < K
            S0 = tl.load(state_rows + offs_c[None, :], mask=mask_if(mask_v[:, None] & mask_c[None, :], live), other=0.0)
            x = tl.load(x_head + offs_c[None, :], mask=mask_if(mask_t[:, None] & mask_c[None, :], live), other=0.0)
            acc = tl.dot(S0.to(tl.float32), tl.trans(x), acc, input_precision=DOT_PRECISION)
        o = tl.dot(vT.to(tl.float32), tl.trans(M), acc, input_precision=DOT_PRECISION)
    tl.store(out + (tok * HV + i_hv)[None, :] * V + offs_v[:, None], o.to(out.dtype.element_ty), mask=mask_vt)


_ring_verify_steps = CachedKernel(_ring_verify_steps_kernel)
_ring_verify_state = CachedKernel(_ring_verify_state_kernel)

@dataclass(frozen=True)
class RingVerifyConfig:
    """Launch configuration of the chunk form (``ring_verify_config`` picks it from the steps
    and the gate). The state kernel's tile (``state_block_v`` rows on ``state_warps``), K
    chunk, pipeline depth and dot precision (tf32x3: three tf32 products, float32-level
    accuracy); the steps kernel's warps (``steps_warps``) and whether its pair sums are
    factored (``factored_pair_sums``; only sound where the safe gate bounds the decay).
    ``state_from_inputs``: the state kernel forms ``q̂ e^G`` and ``k̂ e^G`` from the inputs and
    reads the state before it waits for the steps kernel, which then writes only ``M`` (no
    effect where q and k come from a conv launched just before, which the wait orders)."""
    state_block_v: int = 64
    state_warps: int = 4
    k_chunk: int = 32
    num_stages: int = 4
    dot_precision: str = "tf32x3"
    steps_warps: int = 1
    factored: bool = False
    state_from_inputs: bool = False
    pair_dots: bool = False          # steps kernel: the pair sums, M and x as tensor-core products on
    #                                  16-row tiles (factored at the committed state where |G| <= the
    #                                  spread bound, checked per program) instead of a column at a time
    steps_dot_precision: str = "ieee"  # pair_dots: the steps kernel's products (float32 FMA: the column
    #                                  form's accuracy, 178-188 registers at 16 nodes on 4 warps for sm_90
    #                                  where tf32x3 spills; "tf32" is one rounding of each operand)
    dot_spread_max: float = 60.0     # pair_dots under the default gate: the largest decay -G a program
    #                                  factors (e^60 and e^-60 are normal float32 numbers); steeper ones
    #                                  take their pairs a column at a time

    def __post_init__(self):
        for name in ("dot_precision", "steps_dot_precision"):
            if getattr(self, name) not in ("tf32", "tf32x3", "ieee"):
                raise ValueError(f"RingVerifyConfig.{name} must be 'tf32', 'tf32x3' or 'ieee' "
                                 f"(got {getattr(self, name)!r}).")
        if not 0.0 <= self.dot_spread_max <= FACTOR_BOUND:
            raise ValueError(f"RingVerifyConfig.dot_spread_max must be within [0, {FACTOR_BOUND}] (e^-G stays a "
                             f"normal float32 number; got {self.dot_spread_max!r}).")


# The pair sums factored as (k̂ e^G)(k̂ e^-G) where the safe gate bounds |G| by T |lower_bound|
# <= FACTOR_BOUND (e^80 and e^-80 are normal float32 numbers); pair by pair otherwise (the
# default gate's decay is unbounded; a sweep may pass ``factored=False`` at any gate).
FACTOR_BOUND = 80.0


def factored_pair_sums(T: int, lower_bound) -> bool:
    if lower_bound is None:
        return False
    return T * abs(float(lower_bound)) <= FACTOR_BOUND


def steps_warps(T: int) -> int:
    """One warp keeps every row pick of the steps kernel within a thread's registers: at 8
    steps one warp beat two and four by 2x and 4x (results/mtp_ring_v_in_state_kernel_sweep_h200.json).
    Past 8 steps ([16, K] tiles) one warp would spill."""
    return 1 if T <= 8 else 2


def state_from_inputs(T: int, tree: bool) -> bool:
    """From 9 to 16 nodes the tree's steps kernel (two warps) is long enough that the state's
    read and products pay for their extra work by running beside it: 16 nodes, N = 8 / 64 /
    256, 51-52 / 284-290 / 1085 µs against 58-64 / 309-316 / 1166-1171, q and k given post-conv
    (results/tree_verify_ring_from_inputs_h200.json). At 8 nodes and fewer they cost more
    (N = 8: 25.7 against 22.2 µs; N = 64: 126 against 75). Not timed past 16 nodes, nor for
    chains past 8 steps. With the conv fused (and dependent launches) the launcher keeps the
    order after the wait whatever the config says."""
    return tree and 8 < T <= 16


def ring_verify_config(T: int, lower_bound, tree: bool = False) -> RingVerifyConfig:
    """The chunk form's pinned config for ``T`` steps (``tree``: nodes) under ``lower_bound``
    (None: the default gate)."""
    dots = 8 < T <= 16
    return RingVerifyConfig(steps_warps=4 if dots else steps_warps(T), factored=factored_pair_sums(T, lower_bound),
                            state_from_inputs=state_from_inputs(T, tree), pair_dots=dots)


def ring_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, bounds, out, rings, *, scale,
                lower_bound, wait_for_tokens: bool, launch_dependents: bool, pdl: bool, parents=None,
                config: RingVerifyConfig | None = None):
    """Outputs and ring entries of a ring-mode verify (post-conv q, k, v; inputs checked by the caller).
    ``bounds = (slots, scratch rows or -1)``: rows whose indices fall outside are padding (counted).
    ``wait_for_tokens``: q, k, v come from a kernel launched just before (dependent launch).
    ``parents [N, T]``: the steps are tree nodes (``tree_verify``'s ring mode, which counts its
    padding rows and invalid parents under its own name); None: a chain. ``config`` (default
    ``ring_verify_config``): the launch configuration."""
    N, T, H, K = q.shape
    HV, V = v.shape[-2:]
    ring_k, ring_v, ring_g, ring_beta = rings
    tree = parents is not None
    cfg = config or ring_verify_config(T, lower_bound, tree=tree)
    # q and k from a conv launched just before are ready only after the wait
    from_inputs = cfg.state_from_inputs and not (wait_for_tokens and pdl)
    m_rows = torch.empty(N, HV, T, T, dtype=torch.float32, device=q.device)
    x_rows = m_rows if from_inputs else torch.empty(N, HV, T, K, dtype=torch.float32, device=q.device)
    assert not tree or T <= MAX_TREE_NODES, "a tree's chunk form takes at most MAX_TREE_NODES nodes"
    _ring_verify_steps(
        (HV, N),
        (q, k, a, b, A_log, dt_bias, slot_indices, scratch_indices, parents if tree else slot_indices, x_rows,
         m_rows, ring_k, ring_g, ring_beta,
         errors.counters(q.device), ring_k.stride(0), ring_g.stride(0), ring_beta.stride(0), ring_k.shape[2],
         *bounds, float(scale), float(lower_bound) if lower_bound is not None else 0.0),
        dict(T=T, H=H, HV=HV, K=K, BLOCK_T=max(16, next_power_of_2(T)) if cfg.pair_dots else next_power_of_2(T),
             BLOCK_K=max(16, next_power_of_2(K)) if cfg.pair_dots else next_power_of_2(K),
             SAFE_GATE=lower_bound is not None, FACTORED=bool(cfg.factored) and lower_bound is not None, TREE=tree,
             STORE_X=not from_inputs, PAIR_DOTS=bool(cfg.pair_dots), DOT_PRECISION=cfg.steps_dot_precision,
             DOT_SPREAD_MAX=float(cfg.dot_spread_max), WAIT_FOR_TOKENS=wait_for_tokens and pdl, LAUNCH_DEPENDENTS=pdl,
             CHECK_ROWS=bounds[1] >= 0,
             ERR_INDEX=errors.INDEX["tree_verify" if tree else "mtp_verify"]),
        num_warps=cfg.steps_warps, num_stages=1, launch_pdl=wait_for_tokens and pdl)
    block_v, num_warps = cfg.state_block_v, cfg.state_warps
    block_v = max(16, min(block_v, next_power_of_2(V)))
    _ring_verify_state(
        (cdiv(V, block_v), HV, N),
        (state, q, k, v, a, A_log, dt_bias, parents if tree else slot_indices, slot_indices, scratch_indices, x_rows,
         m_rows, out, ring_v, state.stride(0), ring_v.stride(0), ring_v.shape[2], *bounds, float(scale),
         float(lower_bound) if lower_bound is not None else 0.0),
        dict(T=T, H=H, HV=HV, K=K, V=V, DOT_T=max(16, next_power_of_2(T)), BLOCK_V=block_v,
             K_CHUNK=max(16, min(cfg.k_chunk, next_power_of_2(K))), NUM_STAGES=cfg.num_stages,
             DOT_PRECISION=cfg.dot_precision, SAFE_GATE=lower_bound is not None, TREE=tree,
             FROM_INPUTS=from_inputs, WAIT_FOR_STEPS=pdl, LAUNCH_DEPENDENTS=launch_dependents and pdl,
             CHECK_ROWS=bounds[1] >= 0),
        num_warps=num_warps if block_v >= 64 else 4, num_stages=1, launch_pdl=pdl)
    return out
