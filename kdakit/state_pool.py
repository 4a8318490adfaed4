"""The per-request caches of a KDA model: recurrent states, conv windows, speculative scratch.

One ``StatePool`` holds every layer's buffers, layer first, so a request owns the same
slot index in every layer:

- ``state [L, slots, HV, V, K]`` (float32 by default), V-major; ``state[l]`` is the
  ``[slots, HV, V, K]`` pool the ops take.
- ``conv [L, slots, C, W-1]`` in the activation dtype, the short-conv windows of the
  packed channels ``q | k | v`` (``C = 2*H*K + HV*V``), oldest input first. ``fused_decode``
  takes ``conv[l]`` whole; ``mtp_verify`` takes the channel slices ``conv_qkv(l)`` (views:
  conv states may have any strides).
- ``spec="snapshot"``: ``snapshots [L, scratch, 1+num_spec, HV, V, K]`` (the state after
  every verify step); ``spec="ring"``: ``ring_k [L, slots, H, 1+num_spec, K]``,
  ``ring_v [L, slots, HV, 1+num_spec, V]`` (activation dtype), ``ring_g [L, slots, HV,
  1+num_spec, K]`` and ``ring_beta [L, slots, HV, 1+num_spec]`` (float32). Both modes also
  hold ``intermediate_conv [L, scratch, 1+num_spec, C, W-1]`` (the windows after every
  step; ``intermediate_conv_qkv(l)`` are its channel slices).

Slots are handed out by ``alloc()`` (the lowest free one; its state and windows zeroed)
and given back by ``free(slot)``. ``PAD = -1`` is the padding index of a batch row that
has no request (CUDA-graph padding): the ops write zeros for it and touch no pool.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

PAD = -1
SPEC_MODES = (None, "snapshot", "ring")


class PoolExhausted(RuntimeError):
    """Every slot of the pool is in use."""


@dataclass(frozen=True)
class LayerCache:
    """The views of one layer's buffers, as the ops take them (None where not allocated)."""
    state: torch.Tensor                      # [slots, HV, V, K]
    conv: torch.Tensor                       # [slots, C, W-1], packed q | k | v
    conv_qkv: tuple                          # three channel views of ``conv``
    intermediate_conv: torch.Tensor | None   # [scratch, 1+num_spec, C, W-1]
    intermediate_conv_qkv: tuple | None      # three channel views of it
    snapshots: torch.Tensor | None           # [scratch, 1+num_spec, HV, V, K]
    rings: tuple | None                      # (ring_k, ring_v, ring_g, ring_beta)


class StatePool:
    PAD = PAD

    def __init__(self, num_layers: int, num_slots: int, *, num_heads: int, head_k_dim: int, head_v_dim: int,
                 num_v_heads: int | None = None, conv_width: int = 4, state_dtype=torch.float32,
                 act_dtype=torch.bfloat16, device="cpu", spec: str | None = None, num_spec: int = 0,
                 scratch_rows: int | None = None):
        H, HV = num_heads, num_v_heads or num_heads
        K, V, W = head_k_dim, head_v_dim, conv_width
        if num_layers < 1 or num_slots < 1:
            raise ValueError(f"a pool needs >= 1 layer and >= 1 slot (got {num_layers}, {num_slots}).")
        if H < 1 or HV % H:
            raise ValueError(f"value heads must be a multiple of key heads (got H={H}, HV={HV}).")
        if W < 2:
            raise ValueError(f"the short conv needs a width >= 2 (got {W}).")
        if spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {SPEC_MODES} (got {spec!r}).")
        if spec is not None and num_spec < 1:
            raise ValueError(f"speculative buffers need num_spec >= 1 (got {num_spec}).")
        self.num_layers, self.num_slots = num_layers, num_slots
        self.H, self.HV, self.K, self.V, self.W = H, HV, K, V, W
        self.C = 2 * H * K + HV * V
        self.spec, self.num_spec = spec, num_spec if spec is not None else 0
        self.scratch_rows = (scratch_rows if scratch_rows is not None else num_slots) if spec else 0
        self.device = torch.device(device)
        L, T, dev = num_layers, 1 + self.num_spec, self.device
        self.state = torch.zeros(L, num_slots, HV, V, K, dtype=state_dtype, device=dev)
        self.conv = torch.zeros(L, num_slots, self.C, W - 1, dtype=act_dtype, device=dev)
        self.snapshots = self.intermediate_conv = None
        self.ring_k = self.ring_v = self.ring_g = self.ring_beta = None
        if spec is not None:
            self.intermediate_conv = torch.zeros(L, self.scratch_rows, T, self.C, W - 1, dtype=act_dtype, device=dev)
        if spec == "snapshot":
            self.snapshots = torch.zeros(L, self.scratch_rows, T, HV, V, K, dtype=torch.float32, device=dev)
        elif spec == "ring":
            self.ring_k = torch.zeros(L, num_slots, H, T, K, dtype=act_dtype, device=dev)
            self.ring_v = torch.zeros(L, num_slots, HV, T, V, dtype=act_dtype, device=dev)
            self.ring_g = torch.zeros(L, num_slots, HV, T, K, dtype=torch.float32, device=dev)
            self.ring_beta = torch.zeros(L, num_slots, HV, T, dtype=torch.float32, device=dev)
        self._free = list(range(num_slots))  # a min-heap: alloc hands out the lowest free slot
        self._used: set[int] = set()

    # ------------------------------------------------------------------ slots
    def alloc(self) -> int:
        """A free slot, its recurrent state and conv windows zeroed in every layer."""
        if not self._free:
            raise PoolExhausted(f"all {self.num_slots} slots of the state pool are in use; free one first.")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        self.state[:, slot].zero_()
        self.conv[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back; freeing a slot that is not in use is an error."""
        slot = int(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not a slot of this pool (0 .. {self.num_slots - 1}).")
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not in use (double free?).")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> list[int]:
        return sorted(self._used)

    # ------------------------------------------------------------------ views
    def _split_channels(self, t: torch.Tensor, dim: int) -> tuple:
        HK = self.H * self.K
        return (t.narrow(dim, 0, HK), t.narrow(dim, HK, HK), t.narrow(dim, 2 * HK, self.HV * self.V))

    def conv_qkv(self, layer: int) -> tuple:
        """``(conv_q, conv_k, conv_v)`` channel views of ``conv[layer]``: ``[slots, H*K | HV*V, W-1]``."""
        return self._split_channels(self.conv[layer], 1)

    def intermediate_conv_qkv(self, layer: int) -> tuple | None:
        if self.intermediate_conv is None:
            return None
        return self._split_channels(self.intermediate_conv[layer], 2)

    def rings(self, layer: int) -> tuple | None:
        if self.ring_k is None:
            return None
        return (self.ring_k[layer], self.ring_v[layer], self.ring_g[layer], self.ring_beta[layer])

    def layer(self, layer: int) -> LayerCache:
        """Every buffer of ``layer``, as views."""
        return LayerCache(
            state=self.state[layer], conv=self.conv[layer], conv_qkv=self.conv_qkv(layer),
            intermediate_conv=None if self.intermediate_conv is None else self.intermediate_conv[layer],
            intermediate_conv_qkv=self.intermediate_conv_qkv(layer),
            snapshots=None if self.snapshots is None else self.snapshots[layer], rings=self.rings(layer))

    def nbytes(self) -> int:
        bufs = (self.state, self.conv, self.snapshots, self.intermediate_conv, self.ring_k, self.ring_v,
                self.ring_g, self.ring_beta)
        return sum(t.numel() * t.element_size() for t in bufs if t is not None)

    def __repr__(self) -> str:
        return (f"StatePool(layers={self.num_layers}, slots={self.num_slots}, H={self.H}, HV={self.HV}, "
                f"K={self.K}, V={self.V}, W={self.W}, spec={self.spec!r}, num_spec={self.num_spec}, "
                f"free={self.num_free}, {self.nbytes() / 2**20:.1f} MiB)")
