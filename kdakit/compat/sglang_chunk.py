"""sglang 0.5.23's KDA chunked-prefill entry ``chunk_kda`` (the extend path, with its pool
extension) as a drop-in on ``kdakit.chunk_prefill``: same name, keywords, defaults, return
values; sglang's assertion texts as ValueErrors.

sglang's ``chunk_kda`` (``sglang/kernels/ops/attention/fla/kda.py``, the keywords of its
CPU twins in ``sgl-kernel``) takes ``initial_state`` as the *state pool* itself, V-major
``[slots, HV, V, K]`` (any slot stride, inner dims contiguous), with
``initial_state_indices [N]`` the slot of each sequence (-1: a padding row, neither read nor
written); each sequence's final state is written back into its slot in place. kdakit's
pool has the same layout, so the pool is passed as it is (no transpose, no copy).

- ``beta_is_raw``: beta is a logit, sigmoid inside (kdakit's ``beta_is_logit``).
- ``A_log`` (any shape of HV elements) with ``dt_bias`` ([HV*K] or [HV, K]; None: no bias)
  and ``lower_bound`` (the safe gate): ``g`` is the raw gate; without ``A_log``, ``g`` is the
  log-decay and ``dt_bias`` / ``lower_bound`` are ignored, as in sglang.
- ``output_intermediate_states``: also returns ``h``, the state at the *start* of every
  64-token chunk, ``[1, NT, HV, V, K]`` packed over the sequences in ``cu_seqlens`` order
  (``[B, ceil(T/64), HV, V, K]`` for an equal-length batch), in ``k``'s dtype, as sglang.
  Chunk 0 of a sequence holds its initial state; chunk ``c >= 1`` the state after ``64 c``
  tokens (kdakit's chunk-boundary states, written into a float32 scratch, then cast).
  ``NT = Σ ceil(len_n / 64)`` is a shape that depends on ``cu_seqlens``: a varlen call with
  ``output_intermediate_states`` reads it back to the host (one sync, as sglang's
  ``prepare_chunk_indices`` does); nothing else here syncs.
- ``track_state [N, HV, V, K]`` float32 with ``track_chunk_idx [N]``: ``track_state[n]``
  gets the state at the start of chunk ``track_chunk_idx[n]`` of sequence ``n`` (the initial
  state for 0) when that chunk exists; other rows are left bitwise as they are. Without
  ``output_intermediate_states`` the kernel writes the tracked boundary straight into
  ``track_state`` (no host sync, no data-dependent allocation).

Returns ``o`` (shaped like ``v``, in ``v``'s dtype), or ``(o, h)`` with
``output_intermediate_states``.

Where we differ from sglang:
- ``o`` is a new tensor; ``v`` is not overwritten (sglang writes ``o`` into ``v`` when ``v``
  is contiguous). Use the return value, as sglang's callers do.
- A padding row (slot < 0, or a slot past the pool, which kdakit also counts in
  ``kdakit.take_errors``) gives zero outputs, zero ``h`` entries past its chunk 0, and no
  ``track_state`` write past chunk 0 (sglang computes them from a zero state).
- The final state and the tracked / intermediate states are kept in float32 until stored
  (sglang rounds the final state through ``v``'s dtype).
- ``initial_state`` / ``initial_state_indices`` None raise a ValueError (sglang's GPU path
  would dereference a null pointer; its CPU path raises this text).
"""
from __future__ import annotations

import torch

from ..ops.chunk_prefill import CHUNK_SIZE, chunk_plan, chunk_prefill, max_chunks_for

_H_CHUNK = 64  # sglang's chunk: h entries and track_chunk_idx count 64-token chunks
assert CHUNK_SIZE == _H_CHUNK, "kdakit's chunk_states interval must be sglang's chunk"


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _initial_states(pool, slots, N):
    """``[N, HV, V, K]`` float32: each sequence's initial state, zeros for padding rows."""
    num_slots = pool.shape[0]
    if num_slots == 0:
        return pool.new_zeros(N, *pool.shape[1:], dtype=torch.float32)
    s = slots.to(torch.int64)
    valid = (s >= 0) & (s < num_slots)
    rows = pool.index_select(0, s.clamp(0, num_slots - 1)).float()
    return torch.where(valid[:, None, None, None], rows, torch.zeros((), dtype=torch.float32, device=pool.device))


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float = None,
    initial_state: torch.Tensor = None,
    initial_state_indices: torch.Tensor = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_intermediate_states: bool = False,
    track_state: torch.Tensor | None = None,
    track_chunk_idx: torch.Tensor | None = None,
    beta_is_raw: bool = False,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    **kwargs,
):
    """sglang's KDA extend: ``q, k [1, T, H, K]`` (or ``[B, T, ..]`` without ``cu_seqlens``),
    ``v [.., HV, V]``, ``g [.., HV, K]``, ``beta [.., HV]``; the pool ``initial_state
    [slots, HV, V, K]`` updated in place at ``initial_state_indices`` (see the module doc).
    ``chunk_indices`` / ``chunk_offsets`` (sglang's chunk plan, which a CUDA-graph caller pads)
    are accepted and unused: kdakit plans its chunks on the device from ``cu_seqlens``. With
    ``output_intermediate_states`` they raise ValueError, as ``h``'s row count would follow the
    given (possibly padded) plan in sglang. Other keywords are accepted and ignored, as sglang
    does."""
    del kwargs
    if output_intermediate_states and (chunk_indices is not None or chunk_offsets is not None):
        raise ValueError("kdakit's chunk_kda does not take `chunk_indices`/`chunk_offsets` with "
                         "output_intermediate_states=True: h has one row per 64-token chunk of cu_seqlens "
                         "(sum of ceil(len/64)); pass them as None.")
    if initial_state is None or initial_state_indices is None:
        raise ValueError("chunk_kda requires initial_state and initial_state_indices")
    if (track_state is None) != (track_chunk_idx is None):
        raise ValueError("track_state and track_chunk_idx must be passed together")
    if track_state is not None and track_state.dtype != torch.float32:
        raise ValueError(f"track_state must be fp32, got {track_state.dtype}")
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"`q`/`v` must be 4D [B, T, H, K] / [B, T, HV, V] (got q.ndim={q.dim()}, v.ndim={v.dim()}).")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > 256:
        raise ValueError("current kernel does not support head dimension larger than 256.")
    if scale is None:
        scale = K ** -0.5
    dev = q.device

    fixed = cu_seqlens is None
    if fixed:  # an equal-length batch runs as one flattened varlen batch
        q, k, v_flat, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
        beta = beta.reshape(1, B * T, *beta.shape[2:])
        cu = torch.arange(B + 1, dtype=torch.int32, device=dev) * T
    else:
        v_flat, cu = v, cu_seqlens
    q, k, v_flat, g, beta = (_last_dim_contiguous(x) for x in (q, k, v_flat, g, beta))
    N = cu.numel() - 1
    T_all = q.shape[1]

    if A_log is not None:
        A_log = A_log.reshape(-1).contiguous()
        if dt_bias is None:
            dt_bias = torch.zeros(A_log.numel() * K, dtype=torch.float32, device=dev)
        else:
            dt_bias = dt_bias.reshape(-1).contiguous()
    else:  # g is the log-decay; sglang ignores the gate's parameters
        dt_bias = lower_bound = None

    out = torch.zeros_like(v_flat)
    chunk_states = chunk_state_indices = None
    bound = first = nchunks = NT = None
    pool = initial_state
    if output_intermediate_states or track_state is not None:
        if track_state is not None and not (track_state.dim() == 4 and track_state.shape[0] == N):
            raise ValueError(f"`track_state` must have shape [N={N}, HV, V, K] (got {tuple(track_state.shape)}).")
        if track_chunk_idx is not None and track_chunk_idx.shape != (N,):
            raise ValueError(f"`track_chunk_idx` must have shape ({N},) (got {tuple(track_chunk_idx.shape)}).")
        if initial_state_indices.shape != (N,):
            raise ValueError(f"`initial_state_indices` must have shape ({N},) (got "
                             f"{tuple(initial_state_indices.shape)}).")
        first, _ = chunk_plan(cu, _H_CHUNK, max_chunks_for(T_all, N, _H_CHUNK), T_all)
        first = first.to(torch.int64)
        nchunks = first[1:] - first[:-1]  # chunks of each sequence
        init = _initial_states(pool, initial_state_indices, N)  # before the kernel overwrites the slots
        cols = max(T_all // _H_CHUNK, 1)  # boundaries a sequence can have, from shapes alone
        j = torch.arange(cols, dtype=torch.int64, device=dev)
        if output_intermediate_states:
            NT = B * -(-T // _H_CHUNK) if fixed else int(first[N])  # varlen: the one host sync
            bound = torch.zeros(NT + 1, HV, V, K, dtype=torch.float32, device=dev)  # row NT: a discard row
            bound.index_copy_(0, torch.where(nchunks > 0, first[:-1], NT), init)
            row = first[:-1, None] + j[None, :] + 1  # chunk c = j + 1 starts after (j + 1) * 64 tokens
            chunk_states = bound
            chunk_state_indices = torch.where(row < first[1:, None], row, -1).to(torch.int32)
        else:
            tci = track_chunk_idx.to(torch.int64)
            at_start = ((tci == 0) & (nchunks > 0))[:, None, None, None]
            track_state.copy_(torch.where(at_start, init, track_state))
            hit = (j[None, :] + 1 == tci[:, None]) & (tci < nchunks)[:, None]
            seq = torch.arange(N, dtype=torch.int64, device=dev)
            chunk_states = track_state
            chunk_state_indices = torch.where(hit, seq[:, None], -1).to(torch.int32)

    chunk_prefill(q, k, v_flat, g, beta, pool, initial_state_indices, cu_seqlens=cu, A_log=A_log, dt_bias=dt_bias,
                  lower_bound=lower_bound, beta_is_logit=bool(beta_is_raw), use_qk_l2norm=bool(use_qk_l2norm_in_kernel),
                  scale=scale, chunk_states=chunk_states, chunk_state_indices=chunk_state_indices, out=out)
    o = out.view(B, T, HV, V) if fixed else out

    if not output_intermediate_states:
        return o
    if track_state is not None:
        tci = track_chunk_idx.to(torch.int64)
        sel = (tci >= 0) & (tci < nchunks)
        src = torch.where(sel, first[:-1] + tci.clamp_min(0), NT)
        track_state.copy_(torch.where(sel[:, None, None, None], bound.index_select(0, src), track_state))
    h = bound[:NT].to(k.dtype)
    h = h.view(B, NT // B if B else 0, HV, V, K) if fixed else h.unsqueeze(0)
    return o, h
