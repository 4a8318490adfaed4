"""Packed decode: one token per request over a pool of recurrent states.

``mixed_qkv [B, 2*H*K + HV*V]`` (post-conv ``q | k | v``), raw gate ``a [B, HV*K]``,
raw beta ``b [B, HV]``; ``state[slot_indices[i]]`` is updated in place and
``out [B, 1, HV, V]`` receives ``o``. A slot < 0 is a padding row: zero output,
no pool access; so is a slot past the pool, which is counted (``kdakit.take_errors``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import errors, reference
from ..backends import forced_backend, register, select
from ..contracts import (_shape, check_finite, check_float_dtypes, check_gate_inputs, check_head_dims,
                         check_index_dtype, check_lower_bound, check_same_device, check_slot_values, check_state_pool,
                         full_checks_enabled)
from .launch import CachedKernel, cdiv, next_power_of_2
from .registry import example_index, example_pool, example_rand, example_randn, example_rng, kdakit_op
from .triton_math import count_bad_row, delta_rule_update, kda_log_decay, l2_normalize, mask_if


@triton.jit
def _packed_decode_kernel(
    mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out, errors,
    stride_qkv_row, stride_a_row, stride_b_row, stride_state_slot, num_slots,
    scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, V_TILES: tl.constexpr, EVICT: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, SAFE_GATE: tl.constexpr,
    WAIT_FOR_QKV: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, ERR_INDEX: tl.constexpr,
):
    # One program owns V_TILES tiles of BLOCK_V rows of one (request, value head)
    # state: the rows are independent given q, k, g, beta, so splitting V puts more
    # bytes in flight, and several tiles per program share one q/k/gate prologue.
    # WAIT_FOR_QKV: launched as a programmatic dependent of the kernel that writes
    # mixed_qkv (the conv of the unfused chain): everything else, the first state tile
    # included, loads while that kernel finishes.
    i_v, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    # Every load that does not depend on the slot is issued first, so its latency
    # overlaps the slot -> state chain; no branch, so nothing waits on the slot early.
    row = mixed_qkv + i_b.to(tl.int64) * stride_qkv_row
    a_raw = tl.load(a + i_b.to(tl.int64) * stride_a_row + i_hv * K + offs_k, mask=mask_k, other=0.0)
    bias = tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0)
    b_raw = tl.load(b + i_b.to(tl.int64) * stride_b_row + i_hv)
    A_log_h = tl.load(A_log + i_hv)
    slot = tl.load(slot_indices + i_b).to(tl.int64)
    # Padding rows, and slots past the pool: masked loads and stores never touch the pool.
    live = (slot >= 0) & (slot < num_slots)
    # 64-bit offsets: slot * stride passes 2**31 in real pools.
    head_state = state + slot * stride_state_slot + i_hv * V * K
    first_v = i_v * V_TILES * BLOCK_V + tl.arange(0, BLOCK_V)
    S_next = tl.load(head_state + first_v[:, None] * K + offs_k[None, :],
                     mask=mask_if((first_v < V)[:, None] & mask_k[None, :], live), other=0.0, eviction_policy=EVICT)
    if WAIT_FOR_QKV:
        gdc_wait()
    q = tl.load(row + i_h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(row + (H + i_h) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)

    if USE_QK_L2NORM:
        q = l2_normalize(q)
        k = l2_normalize(k)
    q = q * scale
    g = kda_log_decay(a_raw.to(tl.float32), bias.to(tl.float32), A_log_h.to(tl.float32), lower_bound, SAFE_GATE)
    beta = tl.sigmoid(b_raw.to(tl.float32))

    # The next tile's state rows load while this one computes.
    for tile in tl.static_range(V_TILES):
        offs_v = first_v + tile * BLOCK_V
        mask_v = offs_v < V
        v = tl.load(row + 2 * H * K + i_hv * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        s_ptrs = head_state + offs_v[:, None] * K + offs_k[None, :]
        mask_s = mask_if(mask_v[:, None] & mask_k[None, :], live)
        S = S_next.to(tl.float32)
        if tile + 1 < V_TILES:
            S_next = tl.load(s_ptrs + BLOCK_V * K, mask=mask_if((offs_v + BLOCK_V < V)[:, None] & mask_k[None, :], live),
                             other=0.0, eviction_policy=EVICT)
        S = delta_rule_update(S, k, v, g, beta)
        o = tl.where(live, tl.sum(S * q[None, :], axis=1), 0.0)
        tl.store(s_ptrs, S.to(state.dtype.element_ty), mask=mask_s, eviction_policy=EVICT)
        tl.store(out + (i_b * HV + i_hv) * V + offs_v, o.to(out.dtype.element_ty), mask=mask_v)
    count_bad_row(errors, (slot >= num_slots) & (i_v == 0) & (i_hv == 0), ERR_INDEX)


_packed_decode = CachedKernel(_packed_decode_kernel)


@dataclass(frozen=True)
class PackedDecodeConfig:
    """Launch configuration of one call (``packed_decode_config`` picks it from the shapes)."""
    block_v: int            # state rows (V) per tile
    v_tiles: int = 1        # tiles per program, sharing the q/k/gate prologue
    num_warps: int = 1
    num_stages: int = 1
    evict: str = ""         # cache hint of the state loads ("" or "evict_first")


@functools.lru_cache(maxsize=256)  # pure in its integers; every eager call asks
def packed_decode_config(batch: int, HV: int, V: int, K: int, state_itemsize: int) -> PackedDecodeConfig:
    """Pinned ahead of time from the H200 sweeps in benchmarks/results (no autotuning in a
    serving call).

    One warp streams 4 KB tiles of state rows. A float32 pool: one tile per program at every
    batch (packed_decode_static_prefetch_sweep_h200.json: N = 8 / 128 / 512 10.5 / 138.7 /
    536.2 us against 11.1 / 140.4 / 546.9 for two tiles). A bfloat16 pool: two tiles per
    program sharing the q/k/gate prologue, half tiles at a tiny batch. No cache hint:
    evict_first measured 1-2% slower.
    """
    rows = max(1, min(next_power_of_2(V), 4096 // (next_power_of_2(K) * state_itemsize)))
    if state_itemsize >= 4:
        return PackedDecodeConfig(block_v=rows)
    if batch * HV <= 32:
        return PackedDecodeConfig(block_v=max(1, rows // 2))
    return PackedDecodeConfig(block_v=rows, v_tiles=2 if V >= 2 * rows else 1)


@register("packed_decode", "triton")
def packed_decode_triton(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out, *,
                         scale, use_qk_l2norm, lower_bound, config: PackedDecodeConfig | None = None, wait_for_qkv=False, launch_dependents=False,
                         num_slots=None, err_index=None):
    """``config`` overrides the pinned choice (``packed_decode_config``; sweeps, tests).
    ``wait_for_qkv``: a programmatic dependent launch after the kernel that writes
    ``mixed_qkv`` (``launch.pdl_available``); ``launch_dependents``: let the next kernel
    (launched so) start early. ``num_slots`` (default: the pool's): slots from there on are
    treated as padding and counted on counter ``err_index`` (default: packed_decode's;
    ``errors.NO_COUNT``: not counted)."""
    if err_index is None:
        err_index = errors.INDEX["packed_decode"]
    B = mixed_qkv.shape[0]
    _, HV, V, K = state.shape
    H = reference.infer_packed_heads(mixed_qkv.shape[1], HV, V, K)
    if B == 0:
        return out
    cfg = config or packed_decode_config(B, HV, V, K, state.element_size())
    block_v, v_tiles = cfg.block_v, cfg.v_tiles
    grid = (cdiv(V, block_v * v_tiles), HV, B)
    _packed_decode(
        grid,
        (mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out, errors.counters(mixed_qkv.device),
         mixed_qkv.stride(0), a.stride(0), b.stride(0), state.stride(0),
         state.shape[0] if num_slots is None else num_slots,
         float(scale), float(lower_bound) if lower_bound is not None else 0.0),
        dict(H=H, HV=HV, K=K, V=V, BLOCK_K=next_power_of_2(K), BLOCK_V=block_v, V_TILES=v_tiles,
             EVICT=cfg.evict, USE_QK_L2NORM=bool(use_qk_l2norm), SAFE_GATE=lower_bound is not None,
             WAIT_FOR_QKV=bool(wait_for_qkv), LAUNCH_DEPENDENTS=bool(launch_dependents), ERR_INDEX=err_index),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=bool(wait_for_qkv))
    return out


@register("packed_decode", "reference")
def packed_decode_reference(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out, *,
                            scale, use_qk_l2norm, lower_bound):
    return reference.packed_decode(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out,
                                   scale=scale, use_qk_l2norm=use_qk_l2norm, lower_bound=lower_bound)


@kdakit_op("packed_decode", counts_errors=True, mutates=("state", "out"))
def packed_decode_op(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, state: torch.Tensor, slot_indices: torch.Tensor, out: torch.Tensor,
                     scale: float, use_qk_l2norm: bool, lower_bound: float | None, backend: str | None) -> None:
    _, impl = select("packed_decode", mixed_qkv.device, backend)
    impl(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out,
         scale=scale, use_qk_l2norm=use_qk_l2norm, lower_bound=lower_bound)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
def check_packed_decode(mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices, *,
                        lower_bound=None, helion=False, full_checks=None) -> int:
    """The sglang packed-decode contract, in its order. Returns H."""
    if not (mixed_qkv.dim() == 2):
        raise ValueError(f"`mixed_qkv` must be a 2D tensor (got ndim={mixed_qkv.dim()}).")
    if not (mixed_qkv.stride(-1) == 1):
        raise ValueError("`mixed_qkv` must be contiguous in the last dim.")
    if not (a.dim() == 2 and b.dim() == 2):
        raise ValueError(f"`a` and `b` must be 2D tensors (got a.ndim={a.dim()}, b.ndim={b.dim()}).")
    if not (a.stride(-1) == 1 and b.stride(-1) == 1):
        raise ValueError("`a`/`b` must be contiguous in the last dim.")
    if not (A_log.dim() == 1 and dt_bias.dim() == 1):
        raise ValueError("`A_log`/`dt_bias` must be 1D tensors.")
    if not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        raise ValueError("`A_log`/`dt_bias` must be contiguous.")
    if not (ssm_state_indices.dim() == 1):
        raise ValueError(f"`ssm_state_indices` must be 1D for packed decode (got ndim={ssm_state_indices.dim()}).")
    if not (out.is_contiguous()):
        raise ValueError("`out` must be contiguous.")
    check_same_device(mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices)
    B = mixed_qkv.shape[0]
    if not (a.shape[0] == B and b.shape[0] == B):
        raise ValueError(f"Mismatched batch sizes: mixed_qkv.shape[0]={B}, a.shape[0]={a.shape[0]}, b.shape[0]={b.shape[0]}.")
    if not (_shape(ssm_state_indices) == (B,)):
        raise ValueError(f"`ssm_state_indices` must have shape [B] (got {_shape(ssm_state_indices)}; expected ({B},)).")
    if not (initial_state.dim() == 4):
        raise ValueError(f"`initial_state` must be a 4D tensor (got ndim={initial_state.dim()}).")
    if not (initial_state.stride(-1) == 1):
        raise ValueError("`initial_state` must be contiguous in the last dim.")
    _, HV, V, K = initial_state.shape
    if helion:
        if not (K & (K - 1) == 0 and V & (V - 1) == 0):
            raise ValueError(f"Helion KDA decode requires power-of-two key and value head dimensions (got K={K}, V={V}).")
    check_gate_inputs(a, b, A_log, dt_bias, B, HV, K)
    if not (_shape(out) == (B, 1, HV, V)):
        raise ValueError(f"`out` must have shape {(B, 1, HV, V)} (got out.shape={_shape(out)}).")
    qk_dim = mixed_qkv.shape[1] - HV * V
    if not (qk_dim > 0 and qk_dim % 2 == 0):
        raise ValueError(f"Invalid packed `mixed_qkv` last dim={mixed_qkv.shape[1]} for HV={HV}, V={V}.")
    q_dim = qk_dim // 2
    if not (q_dim % K == 0):
        raise ValueError(f"Invalid packed Q size {q_dim}: must be divisible by K={K}. KDA packed decode requires "
                     "num_q_heads == num_k_heads and head_q_dim == head_k_dim.")
    H = q_dim // K
    if not (H > 0 and HV % H == 0):
        raise ValueError(f"Invalid head config inferred from mixed_qkv: H={H}, HV={HV}.")
    # Beyond the sglang contract: what a kernel would otherwise silently get wrong.
    check_state_pool(initial_state)
    check_head_dims(K, V)
    check_float_dtypes(mixed_qkv=mixed_qkv, a=a, b=b, out=out, A_log=A_log, dt_bias=dt_bias)
    check_index_dtype("ssm_state_indices", ssm_state_indices)
    check_lower_bound(lower_bound)
    if full_checks_enabled(full_checks):
        check_slot_values("ssm_state_indices", ssm_state_indices, initial_state.shape[0], full_checks=True)
        check_finite(True, A_log=A_log, dt_bias=dt_bias)
    return H


def packed_decode(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out=None, *,
                  scale=None, use_qk_l2norm=True, lower_bound=None, backend=None, full_checks=None):
    """One-token KDA decode for ``B`` requests over ``state [slots, HV, V, K]``.

    Updates ``state[slot_indices[i]]`` in place and returns ``out [B, 1, HV, V]``
    (allocated in ``mixed_qkv``'s dtype when not given). ``scale`` defaults to
    ``K ** -0.5``; ``lower_bound`` selects the safe gate.
    """
    if out is None:
        out = (mixed_qkv.new_empty(mixed_qkv.shape[0], 1, state.shape[1], state.shape[2])
               if mixed_qkv.dim() == 2 and state.dim() == 4 else mixed_qkv.new_empty(0))
    check_packed_decode(mixed_qkv, a, b, A_log, dt_bias, state, out, slot_indices, lower_bound=lower_bound,
                        helion=(backend or forced_backend()) == "helion", full_checks=full_checks)
    scale = state.shape[-1] ** -0.5 if scale is None else scale
    packed_decode_op(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out, scale, use_qk_l2norm, lower_bound,
                     backend)
    return out


@packed_decode_op.register_example
def _example(seed, device="cpu", *, act=torch.bfloat16, out=True):
    g = example_rng(seed)
    B, H, HV, K, V, slots = 3, 1, 2, 8, 16, 5
    args = (example_randn(g, B, 2 * H * K + HV * V, dtype=act, device=device),
            example_randn(g, B, HV * K, dtype=act, device=device), example_randn(g, B, HV, dtype=act, device=device),
            example_rand(g, HV, device=device), example_randn(g, HV * K, scale=0.5, device=device),
            example_pool(g, slots, HV, V, K, device=device), example_index(3, -1, 0, device=device))
    kw = dict(lower_bound=-2.0)
    if out:
        kw["out"] = torch.full((B, 1, HV, V), 7.0, dtype=act, device=device)
    return packed_decode, args, kw
