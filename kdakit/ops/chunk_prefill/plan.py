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

from .config import CHUNK_SIZE


def chunk_plan(cu_seqlens: torch.Tensor, chunk: int, max_chunks: int, T: int | None = None):
    """On the device, no sync: ``chunk_first [N+1]`` (the first global chunk of each
    sequence; ``chunk_first[N]`` is the chunk count) and ``chunk_seq [max_chunks]`` (the
    sequence of each global chunk; ``N`` for chunks past the end), int32. Offsets are
    clamped into ``[0, T]`` as the kernels clamp them."""
    cu = cu_seqlens.to(torch.int64)
    if T is not None:
        cu = cu.clamp(0, T)
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    first = torch.zeros(cu.numel(), dtype=torch.int64, device=cu.device)
    torch.cumsum((lens + chunk - 1) // chunk, 0, out=first[1:])
    ids = torch.arange(max_chunks, dtype=torch.int64, device=cu.device)
    seq = torch.searchsorted(first[1:].contiguous(), ids, right=True)
    return first.to(torch.int32), seq.to(torch.int32)


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
