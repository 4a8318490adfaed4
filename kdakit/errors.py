"""Counts of indices that fell outside their buffers, per op, kept on the device.

A slot, scratch row or track slot outside its buffer is treated by every op as a padding
row (nothing of that buffer read or written, zero output); the kernels find it with one
scalar compare per program and add one to the op's int32 counter here, with an atomic
only for such a row. Nothing syncs on the hot path: ``take_errors()`` reads the counters
when the caller asks. The counters are a ``buffers.kept_buffer`` per device, shared by its
streams (the kernels only add to them, atomically), never freed, so a CUDA graph keeps
counting into the buffer it captured. They are made on the first call on a device; made
during a graph capture they would belong to that graph alone, so run each op once eagerly
before capturing it (engines warm up so anyway), or call ``counters(device)`` once.
"""
from __future__ import annotations

import torch

from .buffers import kept_buffer, kept_buffers

OPS = ("packed_decode", "fused_decode", "causal_conv1d_update", "mtp_verify", "commit_snapshots", "commit_ring",
       "recurrent_forward", "causal_conv1d_varlen", "chunk_prefill", "tree_verify", "commit_tree_ring")
INDEX = {name: i for i, name in enumerate(OPS)}
NO_COUNT = -1  # the ERR_INDEX of a kernel that runs inside an op whose other kernel counts
_KIND = "index error counters"


def counters(device: torch.device) -> torch.Tensor:
    """The int32 counters of ``device`` (one per op, in ``OPS`` order)."""
    return kept_buffer(_KIND, device, len(OPS), lambda size: torch.zeros(size, dtype=torch.int32, device=device),
                       per_stream=False)


def count(op: str, bad: torch.Tensor) -> None:
    """Add the number of True entries of ``bad`` to ``op``'s counter (the reference's side; no sync)."""
    if bad.numel():
        counters(bad.device)[INDEX[op]] += bad.sum().to(torch.int32)


def take_errors() -> dict[str, int]:
    """Sync, return ``{op: rows}`` for every op that met an index outside its buffer since the
    last call (ops with no such row are left out: an empty dict means none), and reset the
    counters to zero. Reads every device and stream kdakit has run on."""
    kept = kept_buffers(_KIND)
    for device in {device for (device, _), _ in kept if device.type == "cuda"}:
        torch.cuda.synchronize(device)
    totals = dict.fromkeys(OPS, 0)
    for _, buf in kept:
        for name, value in zip(OPS, buf[:len(OPS)].tolist()):
            totals[name] += value
        buf.zero_()
    for device in {device for (device, _), _ in kept if device.type == "cuda"}:
        torch.cuda.synchronize(device)
    return {name: n for name, n in totals.items() if n}
