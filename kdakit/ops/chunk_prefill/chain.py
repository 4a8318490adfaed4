"""The state chain of ``chunk_prefill``: the serial walk over each sequence's chunks.

``_chunk_state_kernel``, one program per (sequence, value head, V tile), serial over
the sequence's chunks with the state tile in float32 registers: outputs and the
state update (``S0``, ``U``, ``o`` and ``S`` of the package doc); the final state written back
in place (and optionally the state after every ``C`` tokens into scratch slots: prefix caching).
A counted loop of ``ChunkConfig.pipeline_stages`` stages streams the next chunk's factors into
shared memory during this chunk's products (the interpreter runs the same step in a while loop).

With ``ChunkConfig.chain_pieces = P > 1`` each sequence's chain is cut into P pieces of
chunks. A chunk maps every state row affinely, ``S -> S (diag(e^Γ_C) - wᵀ k̂_d) + uᵀ k̂_d``
(``k̂_d = k̂ ⊙ e^(Γ_C - Γ)``), so a piece maps ``S -> S M + B``: the same kernel runs each
piece from the rows ``[0; I]`` of a ``[V + K, K]`` tile, all pieces at once, giving ``B``
and ``M``; ``_chunk_pieces_kernel`` walks the pieces in order from the pool slot (one
``[V, K] x [K, K]`` product each) for their start states; then the same kernel runs every
piece's outputs from its start, the last piece writing the final state. About twice the
chain's products, in P times as many programs: one long sequence with few heads (picked
there, ``chunk_config``: 4 pieces, the V tile chosen for the pieces' programs).

With ``ChunkConfig.outputs="after_chain"`` (picked for few chains of 4096 to 8191 tokens) the chain stores
each chunk's start state and ``U`` instead of its outputs, and ``_chunk_output_kernel``,
one program per (V tile, value head, chunk), computes them token-parallel: the serial
loop runs two of its four products. The same products on the same operands: the same bits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..launch import CachedKernel
from ..triton_math import count_bad_row
from .plan import _chunk_tokens


@triton.jit
def _bcast(flag, like):
    """The scalar boolean ``flag`` as a block of ``like``'s shape (a block mask may not be
    combined with a scalar one: Triton 3.9's interpreter rejects it)."""
    return (tl.zeros(like.shape, dtype=tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def _bf16_dot(a16, b16, acc, EMULATE: tl.constexpr):
    """``acc + a16 @ b16`` of bf16 operands with float32 accumulation; ``EMULATE``: widened to
    float32 and multiplied exactly (the interpreter's bf16 dot reads bf16 bits wrongly; a
    bf16 x bf16 product is exact in float32)."""
    if EMULATE:
        return tl.dot(a16.to(tl.float32), b16.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a16, b16, acc)


@triton.jit
def _chain_dot(a, b, acc, BF16_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` (``a @ b`` when ``acc`` is None) as the chain takes it: bf16 operands
    with ``BF16_DOTS`` (float32 accumulation; a float32 operand, the state's included, is
    rounded for the product alone), else float32 operands at ``DOT_PRECISION``. ``BF16_DOTS``
    1: native bf16 dots; 2: their emulation (``_bf16_dot``)."""
    if BF16_DOTS >= 1:
        EMULATE: tl.constexpr = BF16_DOTS == 2
        return _bf16_dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc, EMULATE)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)


@triton.jit
def _chain_step(S, c, c_first, live, counts, n64, bos, eos, i_hv, out, ws_q, ws_k, ws_w, ws_u, ws_p, ws_g, ws_h, ws_v,
                chunk_states, chunk_state_idx, errors, num_chunk_slots, chunk_idx_cols,
                stride_o_t, stride_o_h, stride_cs_slot, stride_cs_h, stride_cs_v, stride_cs_k, stride_ci_n,
                stride_ci_j, offs_c, offs_k, offs_v, mask_v, mask_s,
                HV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V_WS: tl.constexpr, C: tl.constexpr,
                HAS_CHUNK_STATES: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERVAL: tl.constexpr,
                ERR_INDEX: tl.constexpr, V: tl.constexpr, OUTPUTS: tl.constexpr, BF16_DOTS: tl.constexpr):
    """One chunk of the chain for one (sequence, value head, V tile): outputs (``OUTPUTS`` 1),
    or the chunk's start state and ``U`` for ``_chunk_output_kernel`` (``OUTPUTS`` 2), then
    the state. With ``OUTPUTS`` 0 only the state, whose rows past V (the transition of a
    piece of the chain) take no ``u``."""
    ws_row = (c * HV + i_hv) * C
    p_ck = offs_c[:, None] * BLOCK_K + offs_k[None, :]
    b_w = tl.load(ws_w + ws_row * BLOCK_K + p_ck)
    b_u = tl.load(ws_u + ws_row * BLOCK_V_WS + offs_c[:, None] * BLOCK_V_WS + offs_v[None, :],
                  mask=(offs_v < V)[None, :], other=0.0).to(tl.float32)
    b_kd = tl.load(ws_k + ws_row * BLOCK_K + p_ck)
    e_last = tl.load(ws_g + (c * HV + i_hv) * BLOCK_K + offs_k)
    St = tl.trans(S)  # [BLOCK_K, BLOCK_V]
    b_U = b_u - _chain_dot(b_w, St, None, BF16_DOTS, DOT_PRECISION)  # [C, BLOCK_V]
    t0 = bos + (c - c_first) * C
    if OUTPUTS == 2:  # as the products below would take them: the output kernel's bits are the same
        tl.store(ws_h + ((c * HV + i_hv) * BLOCK_V_WS + offs_v[:, None]) * BLOCK_K + offs_k[None, :],
                 S.to(ws_h.dtype.element_ty), mask=mask_s)
        tl.store(ws_v + ws_row * BLOCK_V_WS + offs_c[:, None] * BLOCK_V_WS + offs_v[None, :],
                 b_U.to(ws_v.dtype.element_ty), mask=mask_v[None, :])
    if OUTPUTS == 1:
        b_qg = tl.load(ws_q + ws_row * BLOCK_K + p_ck)
        b_P = tl.load(ws_p + ws_row * C + offs_c[:, None] * C + offs_c[None, :],  # above the diagonal: unwritten
                      mask=offs_c[:, None] // 16 >= offs_c[None, :] // 16, other=0.0)
        b_o = _chain_dot(b_qg, St, None, BF16_DOTS, DOT_PRECISION)
        b_o = _chain_dot(b_P, b_U, b_o, BF16_DOTS, DOT_PRECISION)
        b_o = tl.where(live, b_o, 0.0)
        tok = t0 + offs_c
        tl.store(out + tok[:, None] * stride_o_t + i_hv * stride_o_h + offs_v[None, :],
                 b_o.to(out.dtype.element_ty), mask=(tok < eos)[:, None] & mask_v[None, :])
    S = S * e_last[None, :]
    S = _chain_dot(tl.trans(b_U), b_kd, S, BF16_DOTS, DOT_PRECISION)  # [BLOCK_V, BLOCK_K]
    if HAS_CHUNK_STATES:  # (only with OUTPUTS: the launcher passes it so)
        # The state after the sequence's first (j+1)*INTERVAL tokens, when it has that many.
        EVERY: tl.constexpr = INTERVAL // C
        steps = c - c_first + 1
        j = steps // EVERY - 1
        full = (steps % EVERY == 0) & (t0 + C <= eos) & live & (j < chunk_idx_cols)
        row = tl.load(chunk_state_idx + n64 * stride_ci_n + tl.where(full, j, 0) * stride_ci_j,
                      mask=full, other=-1).to(tl.int64)
        ok = full & (row >= 0) & (row < num_chunk_slots)
        count_bad_row(errors, full & (row >= num_chunk_slots) & counts, ERR_INDEX)
        p_cs = chunk_states + tl.where(ok, row, 0) * stride_cs_slot + i_hv * stride_cs_h \
            + offs_v[:, None] * stride_cs_v + offs_k[None, :] * stride_cs_k
        tl.store(p_cs, S.to(chunk_states.dtype.element_ty), mask=mask_s & _bcast(ok, mask_s))
    return S


@triton.jit
def _chunk_state_kernel(
    out, state, slot_indices, has_initial, cu_seqlens, chunk_first,
    ws_q, ws_k, ws_w, ws_u, ws_p, ws_g, ws_h, ws_v, chunk_states, chunk_state_idx, errors, pieces_ws,
    num_slots, num_chunk_slots, T, max_chunks,
    stride_o_t, stride_o_h, stride_s_slot, stride_s_h, stride_s_v, stride_s_k,
    stride_cs_slot, stride_cs_h, stride_cs_v, stride_cs_k, stride_ci_n, stride_ci_j, chunk_idx_cols,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V_WS: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr, HAS_CHUNK_STATES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PIPELINE_STAGES: tl.constexpr, INTERVAL: tl.constexpr, ERR_INDEX: tl.constexpr,
    PIECES: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, OUTPUTS: tl.constexpr, BF16_DOTS: tl.constexpr,
):
    # MODE 0: the whole chain of a sequence from its pool slot. With the chain cut into PIECES
    # pieces (program_id 2 = sequence * PIECES + piece), MODE 1: a piece's transition, the
    # chain run on the rows [0; I] of a [V + K, K] tile without outputs (rows < V: the state
    # the piece reaches from zeros, B; rows >= V: the map M, so that the piece takes S to
    # S M + B), into ``pieces_ws``; MODE 2: a piece's outputs from its start state (in
    # ``pieces_ws``, from _chunk_pieces_kernel), the last piece writing the final state.
    i_v, i_hv, i_prog = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = i_prog // PIECES
    piece = i_prog % PIECES
    n64 = i_n.to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < ROWS  # V, or V + K for a transition (MODE 1)
    mask_s = mask_v[:, None] & mask_k[None, :]

    slot = tl.load(slot_indices + n64).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)  # anything else is a padding row: no pool access
    counts = (i_v == 0) & (i_hv == 0)  # the one program of the sequence (of the piece) that counts
    if MODE != 1:
        count_bad_row(errors, (slot >= num_slots) & counts & (piece == 0), ERR_INDEX)
    read = live
    if HAS_INITIAL_FLAGS:
        read = read & (tl.load(has_initial + n64) != 0)
    p_state = state + tl.where(live, slot, 0) * stride_s_slot + i_hv * stride_s_h \
        + offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k
    p_piece = pieces_ws + ((i_prog.to(tl.int64) * HV + i_hv) * ROWS + offs_v[:, None]) * K + offs_k[None, :]
    if MODE == 0:
        S = tl.load(p_state, mask=mask_s & _bcast(read, mask_s), other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_K]
    elif MODE == 1:
        S = tl.where((offs_v[:, None] - V == offs_k[None, :]) & mask_s, 1.0, 0.0)
    else:
        S = tl.load(p_piece, mask=mask_s, other=0.0)

    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + n64).to(tl.int64), 0), T)
    eos = tl.maximum(tl.minimum(tl.maximum(tl.load(cu_seqlens + n64 + 1).to(tl.int64), 0), T), bos)
    c_first = tl.load(chunk_first + n64).to(tl.int64)
    c_end = tl.minimum(tl.load(chunk_first + n64 + 1).to(tl.int64), max_chunks)  # never past the workspace
    c_lo = c_first
    c_hi = c_end
    if PIECES > 1:
        per_piece = (tl.maximum(c_end - c_first, 0) + PIECES - 1) // PIECES
        c_lo = tl.minimum(c_first + piece * per_piece, c_end)
        c_hi = tl.minimum(c_lo + per_piece, c_end)
    if PIPELINE_STAGES > 1:
        # A counted loop, so that the compiler streams the next chunks' factors into shared
        # memory while this chunk's products run (the interpreter cannot run a loop whose
        # bound is loaded, so it takes the while loop below: the same step).
        for c in tl.range(c_lo, c_hi, num_stages=PIPELINE_STAGES):
            S = _chain_step(S, c, c_first, live, counts, n64, bos, eos, i_hv, out, ws_q, ws_k, ws_w, ws_u, ws_p, ws_g,
                            ws_h, ws_v, chunk_states, chunk_state_idx, errors, num_chunk_slots, chunk_idx_cols,
                            stride_o_t, stride_o_h, stride_cs_slot, stride_cs_h, stride_cs_v, stride_cs_k,
                            stride_ci_n, stride_ci_j, offs_c, offs_k, offs_v, mask_v, mask_s,
                            HV, BLOCK_K, BLOCK_V_WS, C, HAS_CHUNK_STATES, DOT_PRECISION, INTERVAL, ERR_INDEX,
                            V, OUTPUTS, BF16_DOTS)
    else:
        c = c_lo
        while c < c_hi:
            S = _chain_step(S, c, c_first, live, counts, n64, bos, eos, i_hv, out, ws_q, ws_k, ws_w, ws_u, ws_p, ws_g,
                            ws_h, ws_v, chunk_states, chunk_state_idx, errors, num_chunk_slots, chunk_idx_cols,
                            stride_o_t, stride_o_h, stride_cs_slot, stride_cs_h, stride_cs_v, stride_cs_k,
                            stride_ci_n, stride_ci_j, offs_c, offs_k, offs_v, mask_v, mask_s,
                            HV, BLOCK_K, BLOCK_V_WS, C, HAS_CHUNK_STATES, DOT_PRECISION, INTERVAL, ERR_INDEX,
                            V, OUTPUTS, BF16_DOTS)
            c += 1
    if MODE == 1:
        tl.store(p_piece, S, mask=mask_s)
    else:
        # The piece that holds the sequence's last chunk (piece 0 of an empty one) ends it.
        last = (c_hi >= c_end) & ((c_lo < c_end) | (piece == 0))
        tl.store(p_state, S.to(state.dtype.element_ty), mask=mask_s & _bcast(live & last, mask_s))


@triton.jit
def _chunk_output_kernel(out, slot_indices, cu_seqlens, chunk_first, chunk_seq, ws_q, ws_p, ws_h, ws_v,
                         num_seqs, num_slots, T, stride_o_t, stride_o_h,
                         HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V_WS: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BF16_DOTS: tl.constexpr):
    """A chunk's outputs ``o = (q̂ ⊙ e^Γ) S0ᵀ + P U`` from the start state and ``U`` the chain
    stored (``OUTPUTS`` 2), one program per (V tile, value head, chunk): the products the
    chain would have run, out of its serial loop. Zeros for a padding sequence."""
    i_v, i_hv, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c64 = i_c.to(tl.int64)
    t0, n_tok = _chunk_tokens(chunk_seq, chunk_first, cu_seqlens, i_c, num_seqs, T, C)
    seq = tl.minimum(tl.load(chunk_seq + i_c), num_seqs - 1).to(tl.int64)
    slot = tl.load(slot_indices + seq).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    rows = offs_c < n_tok  # none past the plan's chunks
    ws_row = (c64 * HV + i_hv) * C
    b_qg = tl.load(ws_q + (ws_row + offs_c[:, None]) * BLOCK_K + offs_k[None, :], mask=rows[:, None], other=0.0)
    b_P = tl.load(ws_p + (ws_row + offs_c[:, None]) * C + offs_c[None, :],  # above the diagonal: unwritten
                  mask=rows[:, None] & (offs_c[:, None] // 16 >= offs_c[None, :] // 16), other=0.0)
    # the chain stores the state's K columns only: the tile's columns past K are never written
    b_S = tl.load(ws_h + ((c64 * HV + i_hv) * BLOCK_V_WS + offs_v[:, None]) * BLOCK_K + offs_k[None, :],
                  mask=mask_v[:, None] & (offs_k < K)[None, :] & _bcast(n_tok > 0, mask_v[:, None]), other=0.0)
    b_U = tl.load(ws_v + (ws_row + offs_c[:, None]) * BLOCK_V_WS + offs_v[None, :],
                  mask=rows[:, None] & mask_v[None, :], other=0.0)
    b_o = _chain_dot(b_qg, tl.trans(b_S), None, BF16_DOTS, DOT_PRECISION)
    b_o = _chain_dot(b_P, b_U, b_o, BF16_DOTS, DOT_PRECISION)
    b_o = tl.where(_bcast(live, b_o), b_o, 0.0)
    tl.store(out + (t0 + offs_c)[:, None] * stride_o_t + i_hv * stride_o_h + offs_v[None, :],
             b_o.to(out.dtype.element_ty), mask=rows[:, None] & mask_v[None, :])


@triton.jit
def _chunk_pieces_kernel(state, slot_indices, has_initial, pieces_ws, starts, num_slots,
                         stride_s_slot, stride_s_h, stride_s_v, stride_s_k,
                         HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, PIECES: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Each piece's start state from the pool slot and the pieces' transitions (S M + B), the
    pieces in order: the only serial part of a cut chain, one [V, K] x [K, K] product a piece."""
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n64 = i_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_s = (offs_v < V)[:, None] & mask_k[None, :]
    slot = tl.load(slot_indices + n64).to(tl.int64)
    read = (slot >= 0) & (slot < num_slots)
    if HAS_INITIAL_FLAGS:
        read = read & (tl.load(has_initial + n64) != 0)
    p_state = state + tl.where(read, slot, 0) * stride_s_slot + i_hv * stride_s_h \
        + offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k
    S = tl.load(p_state, mask=mask_s & _bcast(read, mask_s), other=0.0).to(tl.float32)
    for p in tl.static_range(PIECES):
        prog = n64 * PIECES + p
        tl.store(starts + ((prog * HV + i_hv) * V + offs_v[:, None]) * K + offs_k[None, :], S, mask=mask_s)
        base = pieces_ws + (prog * HV + i_hv) * (V + K) * K
        B = tl.load(base + offs_v[:, None] * K + offs_k[None, :], mask=mask_s, other=0.0)
        M = tl.load(base + (V + offs_k[:, None]) * K + offs_k[None, :], mask=mask_k[:, None] & mask_k[None, :],
                    other=0.0)
        S = tl.dot(S, M, B, input_precision=DOT_PRECISION)


_chunk_state = CachedKernel(_chunk_state_kernel)
_chunk_pieces = CachedKernel(_chunk_pieces_kernel)
_chunk_output = CachedKernel(_chunk_output_kernel)
