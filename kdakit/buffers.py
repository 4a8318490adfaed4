"""Device buffers kept across calls (built once per device, or per device and stream), so a
call launches no kernel to build them again; used by the ops' launchers and the error
counters alike."""
from __future__ import annotations

import torch

_KEPT: dict = {}  # (kind, device, stream) -> buffers of that kind, the largest last; never freed


def kept_buffer(kind: str, device: torch.device, count: int, make, *, per_stream: bool = True) -> torch.Tensor:
    """A device buffer of at least ``count`` elements, built by ``make(size)`` once and kept
    per (kind, device, stream), or per (kind, device) when not ``per_stream``, so a call
    launches no kernel to build it again. It grows by doubling; a smaller one is never freed
    (a CUDA graph captured with it keeps reading its address). One first needed while a graph
    is being captured belongs to that graph alone (what ``make`` writes is only a node of the
    graph, not run at capture): not kept."""
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device
        device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(device).cuda_stream if per_stream and device.type == "cuda" else 0
    kept = _KEPT.setdefault((kind, device, stream), [])
    if not kept or kept[-1].numel() < count:
        fresh = make(max(count, 2 * kept[-1].numel() if kept else 1024))
        if capturing(device):
            return fresh
        kept.append(fresh)
    return kept[-1]


def kept_buffers(kind: str) -> list:
    """Every buffer of ``kind`` kept so far, on any device and stream, as ((device, stream), buffer)."""
    return [((device, stream), buf) for (k, device, stream), bufs in list(_KEPT.items()) if k == kind
            for buf in bufs]



def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph: what a kernel
    would write now is only recorded, so a buffer made now is not valid outside that graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
