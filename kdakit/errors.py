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

Which ops count, and the counter of each, come from ``kdakit.error_layout``, where the op
registry declares every op registered with ``kdakit_op(..., counts_errors=True)``: ``OPS``
(those ops, sorted by name) and ``INDEX`` (name -> counter, the ``ERR_INDEX`` the kernels take)
are read from it on first use, after ``import kdakit`` has registered every op. The op modules
and their registry sit above this module, so it imports nothing of ``kdakit.ops``.
"""
from __future__ import annotations

import torch

from .buffers import kept_buffer, kept_buffers
from .error_layout import layout as error_counting_ops

NO_COUNT = -1  # the ERR_INDEX of a kernel that runs inside an op whose other kernel counts
_KIND = "index error counters"


def _layout() -> tuple[tuple[str, ...], dict[str, int]]:
    """``(OPS, INDEX)``, set as module attributes on the first call so later reads are plain lookups."""
    if "INDEX" not in globals():
        ops = error_counting_ops()
        globals().update(OPS=ops, INDEX={name: i for i, name in enumerate(ops)})
    return OPS, INDEX


def __getattr__(name: str):
    if name == "OPS":
        return _layout()[0]
    if name == "INDEX":
        return _layout()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def counters(device: torch.device) -> torch.Tensor:
    """The int32 counters of ``device`` (one per op, in ``OPS`` order)."""
    ops, _ = _layout()
    return kept_buffer(_KIND, device, len(ops), lambda size: torch.zeros(size, dtype=torch.int32, device=device),
                       per_stream=False)


def count(op: str, bad: torch.Tensor) -> None:
    """Add the number of True entries of ``bad`` to ``op``'s counter (the reference's side; no sync)."""
    if bad.numel():
        counters(bad.device)[_layout()[1][op]] += bad.sum().to(torch.int32)


def take_errors() -> dict[str, int]:
    """Sync, return ``{op: rows}`` for every op that met an index outside its buffer since the
    last call (ops with no such row are left out: an empty dict means none), and reset the
    counters to zero. Reads every device and stream kdakit has run on."""
    ops, _ = _layout()
    kept = kept_buffers(_KIND)
    for device in {device for (device, _), _ in kept if device.type == "cuda"}:
        torch.cuda.synchronize(device)
    totals = dict.fromkeys(ops, 0)
    for _, buf in kept:
        for name, value in zip(ops, buf[:len(ops)].tolist()):
            totals[name] += value
        buf.zero_()
    for device in {device for (device, _), _ in kept if device.type == "cuda"}:
        torch.cuda.synchronize(device)
    return {name: n for name, n in totals.items() if n}
