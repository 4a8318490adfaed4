"""The chunk plan of ``chunk_prefill``: which global chunk belongs to which sequence.

The plan is built on the device from ``cu_seqlens`` by a few torch ops (no ``.item()``, no
host sync), for ``max_chunks = T // C + N`` chunks, a bound on ``Σ ceil(len_n / C)`` computed
from shapes alone: a call of fixed ``T`` and ``N`` is CUDA-graph capturable (an engine pads its
token count and sequence count to its capture sizes; padding sequences may be empty, with
slot -1). The kernels read it back with ``_chunk_tokens``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import CachedKernel, compile_only_target, interpreting
from .config import CHUNK_SIZE


def chunk_plan(cu_seqlens: torch.Tensor, chunk: int, max_chunks: int, T: int | None = None):
    """On the device, no sync: ``chunk_first [N+1]`` (the first global chunk of each
    sequence; ``chunk_first[N]`` is the chunk count) and ``chunk_seq [max_chunks]`` (the
    sequence of each global chunk; ``N`` for chunks past the end), int32. Offsets are
    clamped into ``[0, T]`` as the kernels clamp them. On a GPU (and under the interpreter) one
    launch of ``_chunk_plan_kernel`` (compiled, not run, in compile-only mode): the dozen torch ops
    of ``chunk_plan_torch`` cost an eager call that many kernel launches of host time; elsewhere
    those ops."""
    if not (cu_seqlens.is_cuda or interpreting() or compile_only_target() is not None):
        return chunk_plan_torch(cu_seqlens, chunk, max_chunks, T)
    N = cu_seqlens.numel() - 1
    first = torch.empty(N + 1, dtype=torch.int32, device=cu_seqlens.device)
    seq = torch.empty(max_chunks, dtype=torch.int32, device=cu_seqlens.device)
    _chunk_plan((1,), (cu_seqlens, first, seq, N, -1 if T is None else T, max_chunks, N.bit_length() + 1),
                dict(C=chunk, BLOCK=_PLAN_BLOCK), num_warps=4, num_stages=1)
    return first, seq


def chunk_plan_torch(cu_seqlens: torch.Tensor, chunk: int, max_chunks: int, T: int | None = None):
    """``chunk_plan`` as torch ops (CPU tensors outside the interpreter; the tests' reference)."""
    cu = cu_seqlens.to(torch.int64)
    if T is not None:
        cu = cu.clamp(0, T)
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    first = torch.zeros(cu.numel(), dtype=torch.int64, device=cu.device)
    torch.cumsum((lens + chunk - 1) // chunk, 0, out=first[1:])
    ids = torch.arange(max_chunks, dtype=torch.int64, device=cu.device)
    seq = torch.searchsorted(first[1:].contiguous(), ids, right=True)
    return first.to(torch.int32), seq.to(torch.int32)


_PLAN_BLOCK = 1024  # sequences, then chunk ids, a pass of the plan kernel's one program


@triton.jit
def _chunk_plan_kernel(cu_seqlens, chunk_first, chunk_seq, N, T, max_chunks, search_steps, C: tl.constexpr,
                       BLOCK: tl.constexpr):
    """One program: ``chunk_first`` as a running sum of each sequence's chunk count (offsets
    clamped into [0, T] where T >= 0, lengths at least 0), then each chunk id's sequence by a
    binary search of ``chunk_first[1:]`` (the count of sequences whose chunks end at or before
    it: ``searchsorted(..., right=True)``), ``search_steps`` halvings of [0, N]."""
    # (while loops: Triton 3.6's interpreter cannot bound a range() by an integer argument)
    offs = tl.arange(0, BLOCK)
    tl.store(chunk_first + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs == 0)
    running = tl.zeros([], dtype=tl.int64)
    start = tl.zeros([], dtype=tl.int64)
    while start < N:
        n = start + offs
        live = n < N
        a = tl.load(cu_seqlens + n, mask=live, other=0).to(tl.int64)
        b = tl.load(cu_seqlens + n + 1, mask=live, other=0).to(tl.int64)
        if T >= 0:
            a = tl.minimum(tl.maximum(a, 0), T)
            b = tl.minimum(tl.maximum(b, 0), T)
        chunks = tl.where(live, (tl.maximum(b - a, 0) + C - 1) // C, 0)
        tl.store(chunk_first + n + 1, (tl.cumsum(chunks, axis=0) + running).to(tl.int32), mask=live)
        running += tl.sum(chunks, axis=0)
        start += BLOCK
    tl.debug_barrier()  # the searches below read what every thread stored above
    start = tl.zeros([], dtype=tl.int64)
    while start < max_chunks:
        ids = start + offs
        lo = tl.zeros([BLOCK], dtype=tl.int64)
        hi = tl.zeros([BLOCK], dtype=tl.int64) + N
        step = tl.zeros([], dtype=tl.int32)
        while step < search_steps:
            active = lo < hi
            mid = (lo + hi) // 2
            ends = tl.load(chunk_first + mid + 1, mask=active, other=0).to(tl.int64)
            right = active & (ends <= ids)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & ~right, mid, hi)
            step += 1
        tl.store(chunk_seq + ids, lo.to(tl.int32), mask=ids < max_chunks)
        start += BLOCK


_chunk_plan = CachedKernel(_chunk_plan_kernel)


def max_chunks_for(T: int, N: int, chunk: int = CHUNK_SIZE) -> int:
    """An upper bound on ``Σ_n ceil(len_n / chunk)`` from shapes alone (``Σ len_n <= T``)."""
    return T // chunk + N


@triton.jit
def _chunk_tokens(chunk_seq, chunk_first, cu_seqlens, i_c, num_seqs, T, C: tl.constexpr):
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
