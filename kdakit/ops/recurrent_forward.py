"""Varlen recurrent forward: several tokens per sequence over a pool of recurrent states.

Inputs are one flattened batch: ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``,
``g [1, T, HV, K]`` (log-decay, or the raw gate when ``A_log`` is given),
``beta [1, T, HV]`` (β, or its logit), split into ``N`` sequences by ``cu_seqlens``.

Slots (``state [slots, HV, V, K]``, V-major; a sequence whose starting slot is < 0 is
a padding row: zero outputs and states, no pool access; so is one with a slot past the pool,
counted by ``kdakit.take_errors``):
- 1-D ``slot_indices [N]``: sequence ``n`` starts from ``state[slot_indices[n]]`` and
  its final state goes back there (``write_final_state``).
- 2-D ``slot_indices [N, T_max]`` (fla's speculative serving path): sequence ``n``
  starts from ``state[slot_indices[n, num_accepted_tokens[n] - 1]]`` (``[n, 0]``
  without ``num_accepted_tokens``) and the state after its token ``i`` goes to
  ``state[slot_indices[n, i]]``.

The Triton kernel runs one program per (sequence, value head, V tile) and keeps the
state tile in registers across the sequence's tokens; the state is addressed through
four strides, so the same kernel serves fla's K-major pools (``kdakit.compat.fla``)
by a transposed view, with no copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import errors, reference
from ..backends import register, select
from ..contracts import (STATE_DTYPES, _shape, check_finite, check_float_dtypes, check_head_dims, check_index_dtype,
                         check_lower_bound, check_same_device, check_slot_values, full_checks_enabled)
from .launch import CachedKernel, cdiv, next_power_of_2
from .registry import example_index, example_pool, example_rand, example_randn, example_rng, kdakit_op
from .triton_math import count_bad_row, delta_rule_update, kda_log_decay, l2_normalize, mask_if

# How beta becomes β: as given, sigmoid of a logit, or 2·sigmoid (fla's allow_neg_eigval).
BETA_AS_IS, BETA_SIGMOID, BETA_SIGMOID_X2 = 0, 1, 2


@triton.jit
def _load_state_tile(head_state, offs_v, offs_k, stride_v, stride_k, mask):
    return tl.load(head_state + offs_v[:, None] * stride_v + offs_k[None, :] * stride_k, mask=mask, other=0.0)


@triton.jit
def _zero_rows(row_ptrs, t_begin, t_end, stride_t, mask):
    """Zeros at ``row_ptrs`` for tokens ``t_begin .. t_end - 1`` (a while loop: the bounds
    are loaded values, which the interpreter's ``range`` does not take)."""
    t = t_begin
    while t < t_end:
        tl.store(row_ptrs + t * stride_t, tl.zeros(row_ptrs.shape, dtype=row_ptrs.dtype.element_ty), mask=mask)
        t += 1


@triton.jit
def _recurrent_forward_kernel(
    q, k, v, g, beta, A_log, dt_bias, out, state, slot_indices, num_accepted, cu_seqlens, token_states, final_states,
    errors, T, num_seqs, num_slots, num_cols,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_g_h,
    stride_b_t, stride_b_h, stride_o_t, stride_o_h,
    stride_s_slot, stride_s_h, stride_s_v, stride_s_k,
    stride_ts_t, stride_ts_h, stride_ts_v, stride_ts_k,
    stride_fs_n, stride_fs_h, stride_fs_v, stride_fs_k,
    stride_idx_n, stride_idx_t,
    scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, V_TILES: tl.constexpr, PREFETCH_TILE: tl.constexpr,
    IS_VARLEN: tl.constexpr, PER_TOKEN_SLOTS: tl.constexpr, HAS_NUM_ACCEPTED: tl.constexpr,
    WRITE_STATE: tl.constexpr, HAS_TOKEN_STATES: tl.constexpr, HAS_FINAL_STATES: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, SAFE_GATE: tl.constexpr, BETA_MODE: tl.constexpr,
    PADDING_ROWS: tl.constexpr, TILES_FIRST: tl.constexpr, V_PROGRAMS: tl.constexpr,
    ZERO_UNCOVERED: tl.constexpr, ERR_INDEX: tl.constexpr,
):
    if TILES_FIRST:
        # One flat grid, a sequence's heads and V tiles next to each other in launch order:
        # programs that run together stream neighbouring rows of one slot.
        pid = tl.program_id(0)
        i_v, i_hv, i_n = pid % V_PROGRAMS, (pid // V_PROGRAMS) % HV, pid // (V_PROGRAMS * HV)
    else:
        i_n, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    n64 = i_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    if IS_VARLEN:
        # Offsets clamped into [0, T] (and eos >= bos): whatever cu_seqlens holds (its values are
        # checked only in full-check mode), no token row outside q, k, v, g, beta, out is touched.
        bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n).to(tl.int64), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), bos), T)
    else:
        bos = n64 * 0
        eos = bos + T

    # The slot this sequence starts from (64-bit: slot * stride passes 2**31).
    if PER_TOKEN_SLOTS:
        if HAS_NUM_ACCEPTED:
            i0 = tl.load(num_accepted + i_n).to(tl.int64) - 1
        else:
            i0 = n64 * 0
        col_ok = (i0 >= 0) & (i0 < num_cols)  # never a read outside the index tensor either
        slot = tl.load(slot_indices + n64 * stride_idx_n + i0 * stride_idx_t, mask=col_ok, other=0).to(tl.int64)
        slot = tl.where(col_ok, slot, num_slots)
    else:
        slot = tl.load(slot_indices + i_n).to(tl.int64)
    # A sequence starting from a slot < 0: with PADDING_ROWS a padding row (zero outputs and
    # states, no pool access); without, fla's zero initial state (outputs computed). One
    # whose slots (any it writes, with per-token slots) leave the pool: a padding row, counted.
    in_pool = slot < num_slots
    if PER_TOKEN_SLOTS:
        if WRITE_STATE:
            t = bos
            while t < eos:
                col = t - bos
                slot_t = tl.load(slot_indices + n64 * stride_idx_n + col * stride_idx_t, mask=col < num_cols,
                                 other=0)
                in_pool = in_pool & (col < num_cols) & (slot_t < num_slots)
                t += 1
    used = (slot >= 0) | (not PADDING_ROWS)
    keep = used & in_pool
    reads = (slot >= 0) & in_pool
    if GATE_IN_KERNEL:
        A_log_h = tl.load(A_log + i_hv).to(tl.float32)
        bias = tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    # V_TILES tiles of BLOCK_V rows one after the other: they share the program's setup,
    # the next tile's state load is in flight while this one computes, and the next tile's
    # token loads hit the cache.
    first_v = i_v * V_TILES * BLOCK_V + tl.arange(0, BLOCK_V)
    if PREFETCH_TILE:
        S_next = _load_state_tile(state + slot * stride_s_slot + i_hv * stride_s_h, first_v, offs_k, stride_s_v,
                                  stride_s_k, mask_if((first_v < V)[:, None] & mask_k[None, :], reads))
    for i_tile in tl.static_range(V_TILES):
        offs_v = (i_v * V_TILES + i_tile) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        mask_s = mask_v[:, None] & mask_k[None, :]
        tile = i_hv * stride_s_h + offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k
        if PREFETCH_TILE:
            S = S_next.to(tl.float32)
        else:
            S = _load_state_tile(state + slot * stride_s_slot + i_hv * stride_s_h, offs_v, offs_k, stride_s_v,
                                 stride_s_k, mask_if(mask_s, reads)).to(tl.float32)
        if PREFETCH_TILE and i_tile + 1 < V_TILES:
            next_v = offs_v + BLOCK_V
            S_next = _load_state_tile(state + slot * stride_s_slot + i_hv * stride_s_h, next_v, offs_k, stride_s_v,
                                      stride_s_k, mask_if((next_v < V)[:, None] & mask_k[None, :], reads))

        t = bos
        while t < eos:
            q_t = tl.load(q + t * stride_q_t + i_h * stride_q_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            k_t = tl.load(k + t * stride_k_t + i_h * stride_k_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            g_t = tl.load(g + t * stride_g_t + i_hv * stride_g_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            b_t = tl.load(beta + t * stride_b_t + i_hv * stride_b_h).to(tl.float32)
            v_t = tl.load(v + t * stride_v_t + i_hv * stride_v_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            if USE_QK_L2NORM:
                q_t = l2_normalize(q_t)
                k_t = l2_normalize(k_t)
            q_t = q_t * scale
            if GATE_IN_KERNEL:
                g_t = kda_log_decay(g_t, bias, A_log_h, lower_bound, SAFE_GATE)
            if BETA_MODE == 1:
                b_t = tl.sigmoid(b_t)
            if BETA_MODE == 2:
                b_t = tl.sigmoid(b_t) * 2.0
            S = delta_rule_update(S, k_t, v_t, g_t, b_t)
            o = tl.where(keep, tl.sum(S * q_t[None, :], axis=1), 0.0)
            tl.store(out + t * stride_o_t + i_hv * stride_o_h + offs_v, o.to(out.dtype.element_ty), mask=mask_v)
            if HAS_TOKEN_STATES:
                p_ts = token_states + t * stride_ts_t + i_hv * stride_ts_h
                tl.store(p_ts + offs_v[:, None] * stride_ts_v + offs_k[None, :] * stride_ts_k,
                         tl.where(keep, S, 0.0).to(token_states.dtype.element_ty), mask=mask_s)
            if PER_TOKEN_SLOTS:
                if WRITE_STATE:
                    slot_t = tl.load(slot_indices + n64 * stride_idx_n + (t - bos) * stride_idx_t, mask=keep,
                                     other=-1).to(tl.int64)
                    tl.store(state + slot_t * stride_s_slot + tile, S.to(state.dtype.element_ty),
                             mask=mask_if(mask_s, (slot_t >= 0) & keep))
            t += 1

        if ZERO_UNCOVERED:
            # ``out`` was allocated for this call: the rows of tokens before the first
            # sequence and after the last are zero (as a zeroed allocation would leave them)
            # without a memset kernel of their own.
            if i_n == 0:
                _zero_rows(out + i_hv * stride_o_h + offs_v, bos * 0, bos, stride_o_t, mask_v)
            if i_n == num_seqs - 1:
                _zero_rows(out + i_hv * stride_o_h + offs_v, eos, eos * 0 + T, stride_o_t, mask_v)

        if not PER_TOKEN_SLOTS:
            if WRITE_STATE:
                tl.store(state + slot * stride_s_slot + tile, S.to(state.dtype.element_ty), mask=mask_if(mask_s, reads))
        if HAS_FINAL_STATES:
            p_fs = final_states + n64 * stride_fs_n + i_hv * stride_fs_h
            tl.store(p_fs + offs_v[:, None] * stride_fs_v + offs_k[None, :] * stride_fs_k,
                     tl.where(keep, S, 0.0).to(final_states.dtype.element_ty), mask=mask_s)
    count_bad_row(errors, used & ~in_pool & (i_v == 0) & (i_hv == 0), ERR_INDEX)


_recurrent_forward = CachedKernel(_recurrent_forward_kernel)


@dataclass(frozen=True)
class RecurrentForwardConfig:
    """Launch configuration of one call (``recurrent_forward_config`` picks it from the shapes)."""
    block_v: int                 # state rows (V) per tile
    num_warps: int = 1
    v_tiles: int = 1             # tiles per program
    prefetch_tile: bool = True   # the next tile's load in flight while one computes
    tiles_first: bool = False    # a sequence's programs next to each other in launch order
    max_registers: int | None = None  # ptxas cap per thread (one-warp programs: 128 keeps 16 a SM)


def recurrent_forward_config(N: int, HV: int, V: int, K: int, tokens: int,
                             k_major: bool = False, state_bytes: int = 4) -> RecurrentForwardConfig:
    """Pinned from the H200 sweeps
    (benchmarks/results/recurrent_forward_*sweep_h200.json), no autotuning in a serving call.
    Sequences of several tokens: one warp on 16 rows of K = 128 float32 (8 KB: fewer programs
    repeat each token's q/k/gate work). One-token sequences: two 2 KB tiles a program up to
    256 (sequence, head) pairs, one 4 KB tile beyond. A sequence's programs run next to each
    other in launch order (TILES_FIRST) for one-token sequences, and past 256 pairs for
    longer ones (recurrent_forward_tiles_first_h200.json, recurrent_forward_tiles_first_final_h200.json:
    T = 1, N = 64 72.3-73.1 us against 75.8-77.4 in (sequence, head, tile) order, N = 256 272.8
    against 297.6-314.0; T = 4, N = 256 411.2 against 433.6; T = 16, N = 64 338.6 against
    351.2; at T = 4 and 16, N = 8 0.2-1.9 us slower, not taken). A K-major
    pool (fla's layout, a transposed view) is contiguous along V: 32-row tiles (128 bytes of
    V per key) on one warp, in the same launch order (recurrent_forward_kmajor_sweep*_h200.json,
    fla's fused_recurrent_kda through kdakit.compat.fla: T = 1, N = 64 80.2 us against 91.1 on
    4 warps in (sequence, head, tile) order; T = 16, N = 256 1188 against 1985; 8- and 16-row
    tiles, 2 tiles a program, 2-8 warps all slower)."""
    rows = max(1, min(next_power_of_2(V), 4096 // (next_power_of_2(K) * 4)))
    if k_major:
        return RecurrentForwardConfig(min(next_power_of_2(V), 32), 1, 1, True, True)
    if tokens >= 2 * max(N, 1):
        # At K = 128 on a float32 pool, 128 registers keep 16 one-warp programs on an SM
        # without spills; uncapped the kernel takes 139 (14 a SM, and 8 x 32 heads of
        # 16-token sequences need two waves). Other shapes spill under that cap.
        cap = 128 if next_power_of_2(K) == 128 and state_bytes == 4 else None
        return RecurrentForwardConfig(min(next_power_of_2(V), 2 * rows), 1, 1, True, N * HV > 256,
                                      max_registers=cap)
    if N * HV <= 256:
        return RecurrentForwardConfig(max(1, rows // 2), 1, 2, False, True)
    return RecurrentForwardConfig(rows, 1, 1, True, True)


def _strides4(t):
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


@register("recurrent_forward", "triton")
def recurrent_forward_triton(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, scale, use_qk_l2norm,
                             A_log, dt_bias, lower_bound, beta_mode, num_accepted_tokens, token_states,
                             write_final_state, final_states, padding_rows=True, zero_uncovered=False,
                             config: RecurrentForwardConfig | None = None):
    """``state``, ``token_states``, ``final_states`` are V-major views of any strides
    (``[.., HV, V, K]``); ``config`` overrides the pinned choice (``recurrent_forward_config``). ``zero_uncovered``: ``out`` rows of tokens outside
    ``cu_seqlens`` are written zero (``out`` allocated uninitialized for this call)."""
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else 1
    if N == 0 or HV == 0:
        return out.zero_() if zero_uncovered else out  # no sequence: every row is outside
    cfg = config or recurrent_forward_config(N, HV, V, K, q.shape[1], k_major=state.stride(-1) != 1,
                                             state_bytes=state.element_size())
    block_v, num_warps, v_tiles = cfg.block_v, cfg.num_warps, cfg.v_tiles
    prefetch_tile, tiles_first = bool(cfg.prefetch_tile), bool(cfg.tiles_first)
    per_token = slot_indices.dim() == 2
    dummy = slot_indices  # never read: its constexpr flag is off
    v_programs = cdiv(V, block_v * v_tiles)
    grid = (N * HV * v_programs,) if tiles_first else (N, HV, v_programs)
    _recurrent_forward(
        grid,
        (q, k, v, g, beta, A_log if A_log is not None else q, dt_bias if dt_bias is not None else q, out, state,
         slot_indices, num_accepted_tokens if num_accepted_tokens is not None else dummy,
         cu_seqlens if cu_seqlens is not None else dummy,
         token_states if token_states is not None else state, final_states if final_states is not None else state,
         errors.counters(q.device), T, N, state.shape[0], slot_indices.shape[1] if per_token else 1,
         q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), g.stride(1), g.stride(2),
         beta.stride(1), beta.stride(2), out.stride(1), out.stride(2),
         *state.stride(), *_strides4(token_states), *_strides4(final_states),
         slot_indices.stride(0), slot_indices.stride(1) if per_token else 0,
         float(scale), float(lower_bound) if lower_bound is not None else 0.0),
        dict(H=H, HV=HV, K=K, V=V, BLOCK_K=next_power_of_2(K), BLOCK_V=block_v, V_TILES=v_tiles, PREFETCH_TILE=prefetch_tile,
             IS_VARLEN=cu_seqlens is not None, PER_TOKEN_SLOTS=per_token,
             HAS_NUM_ACCEPTED=num_accepted_tokens is not None, WRITE_STATE=bool(write_final_state),
             HAS_TOKEN_STATES=token_states is not None, HAS_FINAL_STATES=final_states is not None,
             USE_QK_L2NORM=bool(use_qk_l2norm), GATE_IN_KERNEL=A_log is not None,
             SAFE_GATE=lower_bound is not None, BETA_MODE=int(beta_mode), PADDING_ROWS=bool(padding_rows),
             TILES_FIRST=tiles_first, V_PROGRAMS=v_programs,
             ZERO_UNCOVERED=bool(zero_uncovered) and cu_seqlens is not None,
             ERR_INDEX=errors.INDEX["recurrent_forward"]),
        num_warps=num_warps, num_stages=1, max_registers=cfg.max_registers)
    return out


@register("recurrent_forward", "reference")
def recurrent_forward_reference(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, scale, use_qk_l2norm,
                                A_log, dt_bias, lower_bound, beta_mode, num_accepted_tokens, token_states,
                                write_final_state, final_states, padding_rows=True, zero_uncovered=False):
    if beta_mode == BETA_SIGMOID_X2:
        beta = 2.0 * torch.sigmoid(beta.float())
    if zero_uncovered and cu_seqlens is not None:
        T = out.shape[1]  # offsets clamped into [0, T], as the kernel reads them
        out[0, :min(max(int(cu_seqlens[0]), 0), T)] = 0
        out[0, min(max(int(cu_seqlens[-1]), 0), T):] = 0
    return reference.recurrent_forward(
        q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, beta_is_logit=beta_mode == BETA_SIGMOID,
        num_accepted_tokens=num_accepted_tokens, token_states=token_states, write_final_state=write_final_state,
        final_states=final_states, padding_rows=padding_rows)


def run_recurrent_forward(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens=None, scale=None,
                          use_qk_l2norm=True, A_log=None, dt_bias=None, lower_bound=None, beta_mode=BETA_AS_IS,
                          num_accepted_tokens=None, token_states=None, write_final_state=True, final_states=None,
                          padding_rows=True, zero_uncovered=False, backend=None):
    """Dispatch after validation (callers check first). ``state``, ``token_states`` and
    ``final_states`` are V-major ``[.., HV, V, K]`` views of any strides; ``final_states
    [N, HV, V, K]`` receives each sequence's final state (fla's non-in-place output).
    ``padding_rows=False``: a slot < 0 is a zero initial state (fla), not a padding row.
    ``zero_uncovered``: ``out`` was allocated uninitialized for this call; the rows of
    tokens outside ``cu_seqlens`` are written zero."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if A_log is not None:
        dt_bias = dt_bias.reshape(-1)
    _, impl = select("recurrent_forward", q.device, backend)
    return impl(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                beta_mode=beta_mode, num_accepted_tokens=num_accepted_tokens, token_states=token_states,
                write_final_state=write_final_state, final_states=final_states, padding_rows=padding_rows,
                zero_uncovered=zero_uncovered)


@kdakit_op("recurrent_forward", counts_errors=True,
           mutates=("state", "out", "token_states", "final_states"))
def recurrent_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, slot_indices: torch.Tensor, out: torch.Tensor,
                         cu_seqlens: torch.Tensor | None, scale: float | None, use_qk_l2norm: bool,
                         A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None,
                         beta_mode: int, num_accepted_tokens: torch.Tensor | None, token_states: torch.Tensor | None,
                         write_final_state: bool, final_states: torch.Tensor | None, padding_rows: bool,
                         backend: str | None) -> None:
    """``beta_mode`` is one of ``BETA_*``; ``final_states`` is fla's non-in-place output (the
    public native entry passes None)."""
    run_recurrent_forward(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                          use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                          beta_mode=beta_mode, num_accepted_tokens=num_accepted_tokens, token_states=token_states,
                          write_final_state=write_final_state, final_states=final_states, padding_rows=padding_rows,
                          backend=backend)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
def _check_strided_states(name, t, shape, layout) -> None:
    """An output of per-token or per-sequence states: shape ``shape``, a state dtype."""
    if not (_shape(t) == tuple(shape)):
        raise ValueError(f"`{name}` must have shape {tuple(shape)} ({layout}) (got {_shape(t)}).")
    if not (t.dtype in STATE_DTYPES):
        raise ValueError(f"`{name}` must be float32, bfloat16 or float16 (got {t.dtype}).")


def check_recurrent_forward(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens=None, A_log=None,
                            dt_bias=None, lower_bound=None, num_accepted_tokens=None, token_states=None,
                            final_states=None, state_name="state", k_major=False, full_checks=None) -> int:
    """The varlen recurrent-forward contract. Returns N, the number of sequences.

    ``state`` is the pool as the caller passed it: ``[slots, HV, V, K]`` (V-major), or
    ``[slots, HV, K, V]`` when ``k_major`` (fla's default layout); ``token_states`` and
    ``final_states`` are in the same layout. The two varlen texts are fla's, exactly.
    """
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if not (t.dim() == nd):
            raise ValueError(f"`{name}` must be a {nd}D tensor (got ndim={t.dim()}).")
    B = q.shape[0]
    if cu_seqlens is not None:
        if not (B == 1):
            raise ValueError(f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`."
                             f"Please flatten variable-length inputs before processing.")
        if not (cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1):
            raise ValueError(f"`cu_seqlens` must be a 1D tensor of N+1 offsets (got shape {_shape(cu_seqlens)}).")
        check_index_dtype("cu_seqlens", cu_seqlens)
        N = cu_seqlens.numel() - 1
    else:
        if not (B == 1):
            raise ValueError(f"recurrent_forward takes one flattened batch [1, T, ...] (got batch size {B}). "
                             f"Reshape the inputs to [1, B*T, ...] and pass cu_seqlens = arange(0, B*T+1, T).")
        N = 1
    if not (slot_indices.dim() in (1, 2)):
        raise ValueError(f"`slot_indices` must be 1D [N] or 2D [N, T_max] (got ndim={slot_indices.dim()}).")
    if not (slot_indices.shape[0] == N):
        raise ValueError(f"The number of initial states is expected to be equal to the number of input sequences, "
                         f"i.e., {N} rather than {slot_indices.shape[0]}.")
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if not (_shape(k) == _shape(q)):
        raise ValueError(f"`k` must have the shape of `q` {_shape(q)} (got {_shape(k)}).")
    if not (v.shape[:2] == (1, T)):
        raise ValueError(f"`v` must have shape [1, T={T}, HV, V] (got {_shape(v)}).")
    if not (H > 0 and HV % H == 0):
        raise ValueError(f"The number of value heads must be a multiple of the key heads (got H={H}, HV={HV}).")
    if not (_shape(g) == (1, T, HV, K)):
        raise ValueError(f"`g` must have shape {(1, T, HV, K)} [1, T, HV, K] (got {_shape(g)}).")
    if not (_shape(beta) == (1, T, HV)):
        raise ValueError(f"`beta` must have shape {(1, T, HV)} [1, T, HV] (got {_shape(beta)}); "
                         "a per-value-channel (headwise) beta is not supported.")
    if not (_shape(out) == _shape(v)):
        raise ValueError(f"`out` must have the shape of `v` {_shape(v)} (got {_shape(out)}).")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("out", out)):
        if not (t.stride(-1) == 1):
            raise ValueError(f"`{name}` must be contiguous in the last dim.")
    check_head_dims(K, V)
    # The pool, in the caller's layout.
    layout = "[slots, HV, K, V]" if k_major else "[slots, HV, V, K]"
    if not (state.dim() == 4):
        raise ValueError(f"`{state_name}` must be a 4D tensor {layout} (got ndim={state.dim()}).")
    inner = (HV, K, V) if k_major else (HV, V, K)
    if not (tuple(state.shape[1:]) == inner):
        other = "state_v_first=True for a V-major pool" if k_major else "a V-major pool (transpose a K-major one)"
        raise ValueError(f"`{state_name}` must have shape {layout} with HV={HV}, "
                         f"{'K' if k_major else 'V'}={inner[1]}, {'V' if k_major else 'K'}={inner[2]} "
                         f"(got {_shape(state)}); pass {other}.")
    if not (state.stride(-1) == 1 and state.stride(2) == inner[2] and state.stride(1) == inner[1] * inner[2]
            and (state.shape[0] <= 1 or state.stride(0) >= HV * K * V)):
        raise ValueError(f"`{state_name}` must have contiguous inner dims [{layout[8:]} and a slot stride >= "
                         f"HV*K*V (got strides {tuple(state.stride())} for shape {_shape(state)}).")
    if not (state.dtype in STATE_DTYPES):
        raise ValueError(f"`{state_name}` must be float32, bfloat16 or float16 (got {state.dtype}).")
    if slot_indices.dim() == 2 and not (slot_indices.shape[1] >= 1):
        raise ValueError(f"2D `slot_indices` must have at least one column (got {_shape(slot_indices)}).")
    if num_accepted_tokens is not None:
        if not (slot_indices.dim() == 2):
            raise ValueError("`num_accepted_tokens` needs 2D `slot_indices` [N, T_max] (one slot per token); "
                             "with 1D indices each sequence starts from its own slot.")
        if not (_shape(num_accepted_tokens) == (N,)):
            raise ValueError(f"`num_accepted_tokens` must have shape ({N},) (got {_shape(num_accepted_tokens)}).")
        check_index_dtype("num_accepted_tokens", num_accepted_tokens)
    state_layout = (HV, K, V) if k_major else (HV, V, K)
    if token_states is not None:
        _check_strided_states("token_states", token_states, (T, *state_layout), layout.replace("slots", "T"))
    if final_states is not None:
        _check_strided_states("final_states", final_states, (N, *state_layout), layout.replace("slots", "N"))
    if A_log is not None:
        if dt_bias is None:
            raise ValueError("The gate in kernel (`A_log` given) needs `dt_bias` [HV*K] too.")
        if not (A_log.dim() == 1 and A_log.numel() == HV):
            raise ValueError(f"`A_log` must be a 1D tensor of {HV} elements (got shape {_shape(A_log)}).")
        if not (dt_bias.numel() == HV * K and dt_bias.is_contiguous()):
            raise ValueError(f"`dt_bias` must be a contiguous tensor of HV*K={HV * K} elements "
                             f"(got shape {_shape(dt_bias)}).")
        if not (A_log.is_contiguous()):
            raise ValueError("`A_log`/`dt_bias` must be contiguous.")
    elif dt_bias is not None or lower_bound is not None:
        raise ValueError("`dt_bias` and `lower_bound` belong to the gate in kernel: pass `A_log` (and the raw gate "
                         "as `g`), or pass the log-decay as `g` without them.")
    check_lower_bound(lower_bound)
    check_float_dtypes(q=q, k=k, v=v, g=g, beta=beta, out=out)
    if A_log is not None:
        check_float_dtypes(A_log=A_log, dt_bias=dt_bias)
    check_index_dtype("slot_indices", slot_indices)
    check_same_device(q, k, v, g, beta, state, slot_indices, out, cu_seqlens, A_log, dt_bias,
                      num_accepted_tokens, token_states, final_states)
    if full_checks_enabled(full_checks):
        _check_recurrent_forward_values(slot_indices, num_accepted_tokens, cu_seqlens, T, state.shape[0])
        check_finite(True, A_log=A_log, dt_bias=dt_bias)
    return N


def _check_recurrent_forward_values(slot_indices, num_accepted_tokens, cu_seqlens, T, num_slots) -> None:
    """Data checks (syncs): offsets, accepted counts, and the slots each sequence touches."""
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, T]
    if not (bounds[0] == 0 and all(a <= b for a, b in zip(bounds, bounds[1:])) and bounds[-1] <= T):
        raise ValueError(f"`cu_seqlens` must rise from 0 to at most T={T} (got {bounds}).")
    if slot_indices.dim() == 1:
        check_slot_values("slot_indices", slot_indices, num_slots, full_checks=True)
        return
    T_max = slot_indices.shape[1]
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    if not (max(lens, default=0) <= T_max):
        raise ValueError(f"2D `slot_indices` has {T_max} columns but a sequence has {max(lens)} tokens.")
    starts = [0] * len(lens)
    if num_accepted_tokens is not None:
        starts = [int(a) - 1 for a in num_accepted_tokens.tolist()]
        if not all(0 <= s < T_max for s in starts):
            raise ValueError(f"`num_accepted_tokens` must be in [1, {T_max}] (got {[s + 1 for s in starts]}).")
    rows = slot_indices.tolist()
    touched = []
    for row, start, n_tok in zip(rows, starts, lens):
        used = set(row[:n_tok]) | {row[start]}
        touched.extend(s for s in used if s >= 0)
    if touched and not (max(touched) < num_slots):
        raise ValueError(f"`slot_indices` holds slot {max(touched)}, out of range for a pool of {num_slots} slots.")
    if not (len(set(touched)) == len(touched)):
        raise ValueError("`slot_indices` holds the same live slot in two sequences of one batch; "
                         "each sequence needs its own slots.")


def recurrent_forward(q, k, v, g, beta, state, slot_indices, *, cu_seqlens=None, scale=None, use_qk_l2norm=True,
                      A_log=None, dt_bias=None, lower_bound=None, beta_is_logit=False, num_accepted_tokens=None,
                      token_states=None, write_final_state=True, out=None, full_checks=None, backend=None):
    """Varlen multi-token KDA forward over ``state [slots, HV, V, K]`` (see the module doc).

    ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``, ``g [1, T, HV, K]``, ``beta [1, T, HV]``;
    ``cu_seqlens [N+1]`` (None: one sequence of ``T`` tokens). ``g`` is the log-decay,
    or the raw gate when ``A_log [HV]`` (with ``dt_bias [HV*K]``, optional ``lower_bound``
    for the safe gate) is given; ``beta`` is β, or its logit when ``beta_is_logit``.
    ``token_states [T, HV, V, K]`` receives the state after every token. Returns ``out
    [1, T, HV, V]`` (allocated zeroed in ``v``'s dtype when not given; rows of tokens
    outside ``cu_seqlens`` are not written). ``scale`` defaults to ``K ** -0.5``.
    """
    if out is None:
        out = torch.zeros_like(v) if v.dim() == 4 else v.new_zeros(0)
    check_recurrent_forward(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens,
                            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                            num_accepted_tokens=num_accepted_tokens, token_states=token_states,
                            full_checks=full_checks)
    recurrent_forward_op(q, k, v, g, beta, state, slot_indices, out, cu_seqlens, scale, use_qk_l2norm, A_log, dt_bias,
                         lower_bound, BETA_SIGMOID if beta_is_logit else BETA_AS_IS, num_accepted_tokens, token_states,
                         write_final_state, None, True, backend)
    return out


@recurrent_forward_op.register_example
def _example(seed, device="cpu", *, out=True):
    g = example_rng(seed)
    T, H, HV, K, V, slots = 5, 1, 2, 8, 16, 5
    args = (example_randn(g, 1, T, H, K, device=device), example_randn(g, 1, T, H, K, device=device),
            example_randn(g, 1, T, HV, V, device=device), example_randn(g, 1, T, HV, K, device=device),
            example_randn(g, 1, T, HV, device=device), example_pool(g, slots, HV, V, K, device=device),
            example_index(3, -1, 0, device=device))
    kw = dict(cu_seqlens=example_index(0, 2, 3, 5, device=device), A_log=example_rand(g, HV, device=device),
              dt_bias=example_randn(g, HV * K, scale=0.5, device=device), lower_bound=-3.0, beta_is_logit=True,
              token_states=torch.full((T, HV, V, K), 7.0, device=device))
    if out:
        kw["out"] = torch.full((1, T, HV, V), 7.0, device=device)
    return recurrent_forward, args, kw
