"""The implementations of ``chunk_prefill`` that ``kdakit.backends.select`` picks from: the
Triton launcher (the chunk plan, the workspaces, and the launches of the prep, the inverse's
diagonal blocks and the state chain) and the reference's.

The workspace (``max_chunks · HV · C · (3K + V + 2C + 1)`` floats) comes from PyTorch's
caching allocator, so from the graph's pool under capture.
"""
from __future__ import annotations

import torch

from ... import errors, reference
from ...backends import register
from ..launch import cdiv, interpreting, next_power_of_2
from .chain import _chunk_output, _chunk_pieces, _chunk_state
from .config import (_FACTOR_DTYPES, BETA_AS_IS, BETA_SIGMOID, BETA_SIGMOID_X2, BF16_DOTS_MIN_BLOCK_V, CHUNK_SIZE,
                     SAFE_SPREAD_MAX, SUB, ChunkConfig, chunk_config)
from .inverse import diagonal_inverse
from .plan import chunk_plan, max_chunks_for
from .prep import _chunk_prep

_DIAGONAL = "diagonal inverse"  # the launch list's entry for diagonal_inverse's launch


@register("chunk_prefill", "triton")
def chunk_prefill_triton(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, scale, use_qk_l2norm, A_log,
                         dt_bias, lower_bound, beta_mode, has_initial_state, chunk_states, chunk_state_indices,
                         config: ChunkConfig | None = None, chunk_state_interval: int = CHUNK_SIZE):
    """``chunk_state_interval``: tokens between the states written to ``chunk_states`` (a
    multiple of the kernel's chunk; the public op's is ``CHUNK_SIZE``)."""
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1
    if N == 0 or HV == 0:
        return out
    cfg = config or chunk_config(N, HV, K, V, act_dtype=q.dtype, T=T)
    C = cfg.chunk
    if chunk_states is not None and chunk_state_interval % C:
        raise ValueError(f"chunk_state_interval={chunk_state_interval} must be a multiple of the chunk ({C}).")
    BK = next_power_of_2(max(K, 16))
    BVW = next_power_of_2(max(V, 16))
    block_v = min(cfg.block_v, BVW)
    if cfg.chain_dot_dtype == "bfloat16" and block_v < BF16_DOTS_MIN_BLOCK_V:
        raise ValueError(f"ChunkConfig.chain_dot_dtype='bfloat16' needs V tiles of at least "
                         f"{BF16_DOTS_MIN_BLOCK_V} rows (this call's tile: {block_v}); on 16-row tiles "
                         "the bf16 chain products wrote non-finite outputs on the H200.")
    max_chunks = max_chunks_for(T, N, C)
    first, seq = chunk_plan(cu_seqlens, C, max_chunks, T)
    dev = q.device
    rows = max_chunks * HV * C
    factor_dtype = _FACTOR_DTYPES[cfg.factor_dtype]
    # q̂ and k̂ in float32 unless the later phases read the inputs; with float32 factors the
    # chain's factors are written over q̂, k̂ and Γ (ws_q, ws_k, ws_w), else into their own buffers.
    qk_dtype = factor_dtype if cfg.qk_from_input else torch.float32
    ws_q = torch.empty(rows, BK, dtype=qk_dtype, device=dev)
    ws_k = torch.empty(rows, BK, dtype=qk_dtype, device=dev)
    ws_w = torch.empty(rows, BK, dtype=torch.float32, device=dev)
    update_dtype = _FACTOR_DTYPES[cfg.update_factor_dtype or cfg.factor_dtype]
    ws_u = torch.empty(rows, BVW, dtype=update_dtype, device=dev)
    f_q, f_k, f_w = (ws if ws.dtype == dtype else torch.empty_like(ws, dtype=dtype)
                     for ws, dtype in ((ws_q, factor_dtype), (ws_k, update_dtype), (ws_w, update_dtype)))
    ws_p = torch.empty(rows, C, dtype=_FACTOR_DTYPES[cfg.qk_pairs_dtype], device=dev)
    ws_a = torch.empty(rows, C, dtype=torch.float32, device=dev)
    ws_g = torch.empty(max_chunks * HV, BK, dtype=torch.float32, device=dev)
    # the reciprocal row norms of k and q, kept for the later phases (qk_from_input with the L2 norm)
    ws_n = torch.empty(rows, 2, dtype=torch.float32, device=dev) if cfg.qk_from_input and use_qk_l2norm else ws_g
    gate = A_log is not None
    if lower_bound is None:
        spread_max = cfg.factor_spread_max
    else:  # a sub-block's spread is below 16 |lower_bound|: up to e^80 (|lower_bound| <= 5), all factored
        spread_max = SAFE_SPREAD_MAX if cfg.factor_safe_gate else -1.0
    prep_args = (q, k, v, g, beta, A_log if gate else q, dt_bias if gate else q, cu_seqlens, first, seq,
                 ws_q, ws_k, ws_w, ws_u, ws_p, ws_a, ws_g, ws_n, f_q, f_k, f_w, N, T,
                 q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), g.stride(1),
                 g.stride(2), beta.stride(1), beta.stride(2),
                 float(scale), float(lower_bound) if lower_bound is not None else 0.0, float(spread_max))
    # the inverse's diagonal blocks as programs of their own, between the products and the rest of it
    diagonal_programs = cfg.split_prep and cfg.split_rest and cfg.diagonal_programs
    prep_constexprs = dict(H=H, HV=HV, K=K, V=V, BLOCK_K=BK, BLOCK_V=BVW, C=C, SLICE=min(cfg.slice_k, BK, BVW),
                           USE_QK_L2NORM=bool(use_qk_l2norm), GATE_IN_KERNEL=gate, SAFE_GATE=lower_bound is not None,
                           BETA_MODE=int(beta_mode), DOT_PRECISION=cfg.dot_precision,
                           QK_FROM_INPUT=bool(cfg.qk_from_input), INVERSE_BY_DOUBLING=cfg.inverse == "doubling",
                           DIAGONAL_INVERTED=diagonal_programs, PRODUCTS_BY_SLICE=cfg.products == "by_slice",
                           STEEP_BY_SLICE=cfg.steep_pairs == "by_slice",
                           FACTORS_IN_PLACE=f_w is ws_w or (not cfg.qk_from_input and (f_q is ws_q or f_k is ws_k)))
    # Launches of the prep after the first two, as (phases, programs a (chunk, head), BLOCK_LAUNCH):
    # the products a program per column block (in two launches: the lower blocks take the lower
    # half of the rows) and the factors a program per K and V slice where the config says so.
    NB = C // SUB
    if cfg.products == "block_programs" and NB > 1:
        products = [(4, NB // 2, 1), (4, NB // 2, 2)]
    else:
        products = [(4, 1, 0)]
    factors = [(16, max(BK, BVW) // prep_constexprs["SLICE"] if cfg.factor_programs else 1, 0)]
    if cfg.split_prep:
        tail = [(8, 1, 0), *factors]
        rest = ([*products, (_DIAGONAL, 1, 0), *tail] if diagonal_programs else [*products, *tail]) \
            if cfg.split_rest else [(4 | 8 | 16, 1, 0)]
        launches = [((max_chunks, HV), 1, False, 1, 0), ((max_chunks, HV, NB), 2, True, 1, 0),
                    *[((max_chunks * parts, HV), phases, False, parts, block_launch)
                      for phases, parts, block_launch in rest]]
    else:
        launches = [((max_chunks, HV), 1 | 2 | 4 | 8 | 16, False, 1, 0)]
    for grid, phases, per_sub_block, parts, block_launch in launches:
        if phases is _DIAGONAL:
            diagonal_inverse((max_chunks, HV, NB), (ws_a,), dict(HV=HV, C=C), num_warps=1, num_stages=1)
        else:
            _chunk_prep(grid, prep_args, dict(prep_constexprs, PHASES=phases, SUB_BLOCK_PROGRAMS=per_sub_block,
                                              PARTS=parts, BLOCK_LAUNCH=block_launch),
                        num_warps=cfg.lower_block_warps if block_launch == 2 else cfg.prep_warps, num_stages=1)
    has_cs = chunk_states is not None
    cs = chunk_states if has_cs else state
    ci = chunk_state_indices if has_cs else slot_indices
    ci_cols = ci.shape[1] if has_cs else 0
    # Outputs after the chain (one piece only): the chain stores each chunk's start state and U
    # in the dtype its products take (bf16 with bf16 products) for _chunk_output_kernel.
    after = cfg.outputs == "after_chain" and cfg.chain_pieces <= 1
    bf16_dots = (2 if interpreting() else 1) if cfg.chain_dot_dtype == "bfloat16" else 0
    h_dtype = torch.bfloat16 if bf16_dots else torch.float32
    ws_h = torch.empty(max_chunks * HV, BVW, BK, dtype=h_dtype, device=dev) if after else ws_g
    ws_v = torch.empty(rows, BVW, dtype=h_dtype, device=dev) if after else ws_g
    state_args = (out, state, slot_indices, has_initial_state if has_initial_state is not None else slot_indices,
                  cu_seqlens, first, f_q, f_k, f_w, ws_u, ws_p, ws_g, ws_h, ws_v, cs, ci, errors.counters(q.device))
    state_tail = (state.shape[0], cs.shape[0], T, max_chunks,
                  out.stride(1), out.stride(2), *state.stride(), *cs.stride(),
                  ci.stride(0), ci.stride(1) if has_cs else 0, ci_cols)
    # bf16 chain products (bf16_dots): native bf16 dots, or (interpreter) their emulation (_chain_dot)
    state_constexprs = dict(H=H, HV=HV, K=K, V=V, BLOCK_K=BK, BLOCK_V_WS=BVW, BLOCK_V=block_v, C=C,
                            HAS_INITIAL_FLAGS=has_initial_state is not None, HAS_CHUNK_STATES=has_cs,
                            DOT_PRECISION=cfg.dot_precision, BF16_DOTS=bf16_dots,
                            PIPELINE_STAGES=1 if interpreting() else cfg.pipeline_stages,
                            INTERVAL=chunk_state_interval, ERR_INDEX=errors.INDEX["chunk_prefill"])
    P = cfg.chain_pieces
    if P <= 1:
        _chunk_state((cdiv(V, block_v), HV, N), (*state_args, state, *state_tail),
                     dict(state_constexprs, PIECES=1, MODE=0, ROWS=V, OUTPUTS=2 if after else 1),
                     num_warps=cfg.state_warps, num_stages=1)
        if after:
            bv_out = min(cfg.output_block_v, BVW)
            _chunk_output((cdiv(V, bv_out), HV, max_chunks),
                          (out, slot_indices, cu_seqlens, first, seq, f_q, ws_p, ws_h, ws_v, N, state.shape[0], T,
                           out.stride(1), out.stride(2)),
                          dict(HV=HV, K=K, V=V, BLOCK_K=BK, BLOCK_V_WS=BVW, BLOCK_V=bv_out, C=C,
                               DOT_PRECISION=cfg.dot_precision, BF16_DOTS=bf16_dots),
                          num_warps=cfg.output_warps, num_stages=1)
        return out
    # The chain cut into P pieces of a sequence: each piece's transition (in parallel), the
    # start states (serial over the pieces, one product each), then each piece's outputs.
    transitions = torch.empty(N * P, HV, V + K, K, dtype=torch.float32, device=dev)
    starts = torch.empty(N * P, HV, V, K, dtype=torch.float32, device=dev)
    _chunk_state((cdiv(V + K, block_v), HV, N * P), (*state_args, transitions, *state_tail),
                 dict(state_constexprs, HAS_CHUNK_STATES=False, PIECES=P, MODE=1, ROWS=V + K, OUTPUTS=0),
                 num_warps=cfg.state_warps, num_stages=1)
    _chunk_pieces((cdiv(V, 32), HV, N),
                  (state, slot_indices, has_initial_state if has_initial_state is not None else slot_indices,
                   transitions, starts, state.shape[0], *state.stride()),
                  dict(HV=HV, K=K, V=V, BLOCK_K=BK, BLOCK_V=32, PIECES=P,
                       HAS_INITIAL_FLAGS=has_initial_state is not None, DOT_PRECISION=cfg.dot_precision),
                  num_warps=8, num_stages=1)
    _chunk_state((cdiv(V, block_v), HV, N * P), (*state_args, starts, *state_tail),
                 dict(state_constexprs, PIECES=P, MODE=2, ROWS=V, OUTPUTS=1),
                 num_warps=cfg.state_warps, num_stages=1)
    return out


@register("chunk_prefill", "reference")
def chunk_prefill_reference(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, scale, use_qk_l2norm, A_log,
                            dt_bias, lower_bound, beta_mode, has_initial_state, chunk_states, chunk_state_indices,
                            chunk_size=CHUNK_SIZE, compute_dtype=torch.float32):
    if beta_mode == BETA_SIGMOID_X2:
        beta, beta_mode = 2.0 * torch.sigmoid(beta.float()), BETA_AS_IS
    return reference.chunk_prefill(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                                   use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                                   lower_bound=lower_bound, beta_is_logit=beta_mode == BETA_SIGMOID,
                                   has_initial_state=has_initial_state, chunk_states=chunk_states,
                                   chunk_state_indices=chunk_state_indices, chunk_size=chunk_size,
                                   compute_dtype=compute_dtype)
