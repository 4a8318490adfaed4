"""Fused decode: the whole KDA decode step of one token per request in one kernel.

Short conv (SiLU) of the pre-conv projection ``qkv [B, 2*H*K + HV*V]`` against the
window pool ``conv_state [slots, 2*H*K + HV*V, W-1]`` (any strides, shifted in
place), L2 norm of q and k, gate (default, or safe with ``lower_bound``),
``β = sigmoid(b)``, the delta-rule recurrence on ``state [slots, HV, V, K]`` (in
place), and an optional gated RMSNorm over V. Post-conv values are rounded to
``qkv``'s dtype exactly as ``causal_conv1d_update`` stores them, so this kernel and
the unfused chain ``causal_conv1d_update -> packed_decode -> gated_rmsnorm`` see the
same numbers. A slot < 0 is a padding row: zero output, no pool access; so is a slot past
either pool, which is counted (``kdakit.take_errors``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .. import errors, reference
from ..backends import register, select
from ..contracts import (_shape, check_conv_bias, check_conv_pool, check_conv_weight, check_dim, check_finite,
                         check_float_dtype, check_float_dtypes, check_gate_inputs, check_head_dims,
                         check_last_dim_contiguous, check_lower_bound, check_same_device, check_slot_indices,
                         check_slot_values, check_state_pool, full_checks_enabled)
from .conv1d_update import Conv1dUpdateConfig, causal_conv1d_update_triton
from .gated_rmsnorm import GatedRMSNormConfig, gated_rmsnorm_after
from .launch import CachedKernel, arrival_counters, cdiv, next_power_of_2, pdl_available
from .packed_decode import PackedDecodeConfig, packed_decode_config, packed_decode_triton
from .registry import example_index, example_rand, example_randn, example_rng, kdakit_op
from .triton_math import (conv_apply, conv_inputs, count_bad_row, delta_rule_update, gated_rmsnorm_rows,
                          kda_log_decay, l2_normalize, mask_if, shift_window, short_conv)


@triton.jit
def _load_tile(head_state, offs_v, offs_k, mask_k, in_use, V: tl.constexpr, K: tl.constexpr):
    """State rows ``offs_v`` (none past V) as stored; nothing read where not ``in_use``."""
    return tl.load(head_state + offs_v[:, None] * K + offs_k[None, :],
                   mask=mask_if((offs_v < V)[:, None] & mask_k[None, :], in_use), other=0.0)


@triton.jit
def _store_tile(head_state, offs_v, offs_k, mask_k, S, in_use, V: tl.constexpr, K: tl.constexpr):
    """``_load_tile``'s rows back, in the pool's dtype; nothing written where not ``in_use``."""
    tl.store(head_state + offs_v[:, None] * K + offs_k[None, :], S.to(head_state.dtype.element_ty),
             mask=mask_if((offs_v < V)[:, None] & mask_k[None, :], in_use))


@triton.jit
def _v_conv_inputs(row, win_row, conv_weight, conv_bias, stride_conv_chan, stride_conv_tap, v_chan0, offs_v,
                   in_use, live, V: tl.constexpr, W: tl.constexpr, BLOCK_TAPS: tl.constexpr,
                   HAS_CONV_BIAS: tl.constexpr):
    """The v-conv loads of state rows ``offs_v`` (``conv_inputs``); nothing read where not ``in_use``."""
    v_chan = v_chan0 + offs_v
    return conv_inputs(row + v_chan, win_row + v_chan.to(tl.int64) * stride_conv_chan, conv_weight + v_chan * W,
                       conv_bias + v_chan, stride_conv_tap, mask_if(offs_v < V, in_use), live, W, BLOCK_TAPS,
                       HAS_CONV_BIAS)


@triton.jit
def _fused_decode_kernel(
    qkv, conv_weight, conv_bias, conv_state, a, b, A_log, dt_bias, state, slot_indices, norm_gate, norm_weight, out,
    arrivals, errors,
    stride_qkv_row, stride_conv_slot, stride_conv_chan, stride_conv_tap, stride_a_row, stride_b_row,
    stride_state_slot, stride_gate_row, num_slots,
    scale, lower_bound, norm_eps,
    H: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, V_TILES: tl.constexpr, PROGRAMS_PER_HEAD: tl.constexpr,
    BLOCK_V_ROW: tl.constexpr, BLOCK_TAPS: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr, SAFE_GATE: tl.constexpr, HAS_NORM: tl.constexpr, ERR_INDEX: tl.constexpr,
):
    # A program owns V_TILES tiles of BLOCK_V state rows of one (request, value head) and
    # streams them, the next tile's state rows and v-conv inputs loading while this tile
    # computes. The q/k conv of a key head is needed by every program of its group, and
    # their windows are shifted in place: the shifted q/k windows may be written only once
    # every program of the key head has read the old ones. With one program per key head
    # that program does it all. Split over several programs (more bytes in flight), each
    # computes the q/k conv itself and counts its arrival on `arrivals[request, key head]`
    # once its window reads and o stores are done; the LAST to arrive writes the shifted q/k
    # windows, norms the o rows (which need all of V) and resets the counter. Its last
    # state tile is stored after the arrival, so the ordering fence waits for less.
    SPLIT: tl.constexpr = GROUP * PROGRAMS_PER_HEAD > 1
    # One tile holds the whole row of V: the norm runs on registers, no o round trip.
    FULL_ROW: tl.constexpr = (not SPLIT) and V_TILES == 1 and BLOCK_V >= V
    i_v, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    row = qkv + i_b.to(tl.int64) * stride_qkv_row
    slot = tl.load(slot_indices + i_b).to(tl.int64)
    # Padding rows, and slots past either pool: masked loads and stores never touch the pools.
    live = (slot >= 0) & (slot < num_slots)
    # 64-bit offsets: slot * stride passes 2**31 in real pools.
    win_row = conv_state + slot * stride_conv_slot
    head_state = state + slot * stride_state_slot + i_hv * V * K
    v_chan0 = 2 * H * K + i_hv * V
    first_row = i_v * (V_TILES * BLOCK_V)

    # The first tile's loads are issued before the q/k conv, so their latency overlaps it.
    offs_v = first_row + tl.arange(0, BLOCK_V)
    S_next = _load_tile(head_state, offs_v, offs_k, mask_k, live, V, K)
    vx, vwin, vw, vw_x, vbias = _v_conv_inputs(row, win_row, conv_weight, conv_bias, stride_conv_chan,
                                               stride_conv_tap, v_chan0, offs_v, True, live, V, W, BLOCK_TAPS,
                                               HAS_CONV_BIAS)
    if FULL_ROW and HAS_NORM:
        gate_row = tl.load(norm_gate + i_b.to(tl.int64) * stride_gate_row + i_hv * V + offs_v, mask=offs_v < V,
                           other=0.0).to(tl.float32)
        weight_row = tl.load(norm_weight + offs_v, mask=offs_v < V, other=0.0)

    q_chan = i_h * K + offs_k
    k_chan = (H + i_h) * K + offs_k
    q_win = win_row + q_chan.to(tl.int64) * stride_conv_chan
    k_win = win_row + k_chan.to(tl.int64) * stride_conv_chan
    q, q_old, q_x = short_conv(row + q_chan, q_win, conv_weight + q_chan * W, conv_bias + q_chan, stride_conv_tap,
                               mask_k, live, W, BLOCK_TAPS, HAS_CONV_BIAS)
    k, k_old, k_x = short_conv(row + k_chan, k_win, conv_weight + k_chan * W, conv_bias + k_chan, stride_conv_tap,
                               mask_k, live, W, BLOCK_TAPS, HAS_CONV_BIAS)
    q = l2_normalize(q) * scale
    k = l2_normalize(k)
    a_raw = tl.load(a + i_b.to(tl.int64) * stride_a_row + i_hv * K + offs_k, mask=mask_k, other=0.0)
    bias = tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0)
    b_raw = tl.load(b + i_b.to(tl.int64) * stride_b_row + i_hv)
    A_log_h = tl.load(A_log + i_hv)
    g = kda_log_decay(a_raw.to(tl.float32), bias.to(tl.float32), A_log_h.to(tl.float32), lower_bound, SAFE_GATE)
    beta = tl.sigmoid(b_raw.to(tl.float32))
    o_row_ptrs = out + (i_b * HV + i_hv) * V

    S = tl.zeros([BLOCK_V, BLOCK_K], dtype=tl.float32)
    for tile in range(V_TILES):
        offs_v = first_row + tile * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        S_cur, x_cur, win_cur, w_cur, w_x_cur, bias_cur = S_next, vx, vwin, vw, vw_x, vbias
        has_next = tile + 1 < V_TILES
        S_next = _load_tile(head_state, offs_v + BLOCK_V, offs_k, mask_k, live & has_next, V, K)
        vx, vwin, vw, vw_x, vbias = _v_conv_inputs(row, win_row, conv_weight, conv_bias, stride_conv_chan,
                                                   stride_conv_tap, v_chan0, offs_v + BLOCK_V, has_next, live, V,
                                                   W, BLOCK_TAPS, HAS_CONV_BIAS)
        v = conv_apply(x_cur, win_cur, w_cur, w_x_cur, bias_cur, W, BLOCK_TAPS, HAS_CONV_BIAS)
        S = delta_rule_update(S_cur.to(tl.float32), k, v, g, beta)
        o = tl.where(live, tl.sum(S * q[None, :], axis=1), 0.0)
        # A window tap may be held by several threads (replicated layouts): every thread has
        # read this tile's old v windows before any thread writes the shifted ones.
        tl.debug_barrier()
        v_chan = v_chan0 + offs_v
        shift_window(win_row + v_chan.to(tl.int64) * stride_conv_chan, win_cur, x_cur, stride_conv_tap, mask_v, live,
                     W, BLOCK_TAPS)
        if FULL_ROW and HAS_NORM:  # o rounded to out's dtype first, as the unfused chain stores it
            o = gated_rmsnorm_rows(o.to(out.dtype.element_ty).to(tl.float32), gate_row, weight_row, norm_eps, V)
        # With the norm on a split row this is o before it, rounded as the unfused chain does.
        tl.store(o_row_ptrs + offs_v, o.to(out.dtype.element_ty), mask=mask_v)
        store_now = live
        if SPLIT:  # the last tile is stored after the arrival
            store_now = live & (tile < V_TILES - 1)
        _store_tile(head_state, offs_v, offs_k, mask_k, S, store_now, V, K)

    if SPLIT:
        # Every thread's window reads and o stores precede the arrival (release); the last
        # program's reads of the other programs' o follow it (acquire).
        tl.debug_barrier()
        counter = arrivals + i_b * H + i_h
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        _store_tile(head_state, first_row + (V_TILES - 1) * BLOCK_V + tl.arange(0, BLOCK_V), offs_k, mask_k, S, live,
                    V, K)
        is_last = arrived == GROUP * PROGRAMS_PER_HEAD - 1
    else:
        tl.debug_barrier()  # the norm below reads o rows that other threads stored
        is_last = True
    if is_last:
        shift_window(q_win, q_old, q_x, stride_conv_tap, mask_k, live, W, BLOCK_TAPS)
        shift_window(k_win, k_old, k_x, stride_conv_tap, mask_k, live, W, BLOCK_TAPS)
        if HAS_NORM and not FULL_ROW:
            offs_row = tl.arange(0, BLOCK_V_ROW)
            mask_row = offs_row < V
            w = tl.load(norm_weight + offs_row, mask=mask_row, other=0.0)
            for j in range(GROUP):
                o_ptrs = out + (i_b * HV + i_h * GROUP + j) * V + offs_row
                # .cg: the rows were written by other programs, maybe of this SM; read from L2.
                o_row = tl.load(o_ptrs, mask=mask_row, other=0.0, cache_modifier=".cg").to(tl.float32)
                gate = tl.load(norm_gate + i_b.to(tl.int64) * stride_gate_row + (i_h * GROUP + j) * V + offs_row,
                               mask=mask_row, other=0.0)
                o_row = gated_rmsnorm_rows(o_row, gate.to(tl.float32), w, norm_eps, V)
                tl.store(o_ptrs, o_row.to(out.dtype.element_ty), mask=mask_row)
        if SPLIT:
            tl.store(arrivals + i_b * H + i_h, 0)
    count_bad_row(errors, (slot >= num_slots) & (i_v == 0) & (i_hv == 0), ERR_INDEX)


_fused_decode = CachedKernel(_fused_decode_kernel)


@dataclass(frozen=True)
class FusedDecodeConfig:
    """Launch configuration of one step (``fused_decode_config`` picks it from the shapes).
    ``chain=False``: the one-kernel step, each program streaming ``v_tiles`` tiles of
    ``block_v`` rows, as many programs per head as cover V. ``chain=True``: the unfused
    chain (conv update -> packed decode -> gated norm) with those kernels' configs
    (None: their own pickers; the decode's is ``chain_decode_config``)."""
    block_v: int = 0
    v_tiles: int = 1
    num_warps: int = 1
    chain: bool = False
    conv: Conv1dUpdateConfig | None = None
    decode: PackedDecodeConfig | None = None
    norm: GatedRMSNormConfig | None = None


def one_kernel_config(batch: int, H: int, HV: int, V: int, K: int) -> FusedDecodeConfig:
    """The one-kernel step's tiles, pinned from the H200 sweeps
    (benchmarks/results/fused_decode_*sweep_h200.json; the last, fused_decode_tiles_sweep_h200):
    up to 64 (request, head) pairs, V split over programs of one 8 KB tile (N = 1: 7.7 us
    against 18.9 us for one program per head); up to 256, over four programs of four 4 KB
    tiles each (N = 8: 15.5 us against 20.0 split in 8 KB tiles and 21.3 one program per
    head); beyond, one one-warp program per head streams its 4 KB tiles (N = 32: 44.1 us
    against 46.2 for two programs per head). GVA shares a key head's q/k windows between
    value heads, so it always splits; past 256 pairs in one 4 KB tile per program."""
    rows = max(1, min(next_power_of_2(V), 4096 // (next_power_of_2(K) * 4)))
    pairs = batch * HV
    if pairs <= 64:
        return FusedDecodeConfig(block_v=2 * rows, v_tiles=1, num_warps=1)
    if pairs <= 256:
        return FusedDecodeConfig(block_v=rows, v_tiles=4, num_warps=1)
    if HV != H:
        return FusedDecodeConfig(block_v=rows, v_tiles=1, num_warps=1)
    return FusedDecodeConfig(block_v=rows, v_tiles=cdiv(V, rows), num_warps=1)


# Above this many (request, value head) pairs the three-kernel chain (conv update, packed
# decode, gated norm) beats the fused kernel on the H200 (fused_decode_final2_h200.json:
# N = 128 156.2 vs 162.4 us, N = 512 592.5 vs 623.1 us; N = 32 44.7 vs 45.0), so the op runs
# the chain there: the same numbers (both round the post-conv values and o alike). The
# picker's default (a sweep or a test passes its own ``chain_above_pairs``, or a config).
CHAIN_ABOVE_PAIRS = 1024


def fused_decode_config(batch: int, H: int, HV: int, V: int, K: int, *, pdl: bool,
                        chain_above_pairs: int = CHAIN_ABOVE_PAIRS) -> FusedDecodeConfig:
    """Which kernels run the step: the chain, or the one-kernel step (``one_kernel_config``).
    With programmatic dependent launches the chain won at every batch on the H200
    (fused_decode_pdl_h200.json, fused_decode_two_kernels_sweep_h200.json: N = 1 5.7-5.8 us
    against 7.6-7.7 for the one-kernel step and 6.0 for the best two-kernel plan, measured
    and removed). Without them (before Hopper, or KDAKIT_PDL=0), the one-kernel step up to
    ``chain_above_pairs`` (request, value head) pairs."""
    if pdl or batch * HV > chain_above_pairs:
        return FusedDecodeConfig(chain=True)
    return one_kernel_config(batch, H, HV, V, K)


def chain_decode_config(batch: int, HV: int, V: int, K: int, state_itemsize: int) -> PackedDecodeConfig:
    """The chain's packed-decode launch config: packed decode's own, except that from 33 to
    1024 (request, head) pairs a one-tile program streams two half tiles instead
    (fused_decode_chain_sweep_h200.json, where the decode starts before the conv ends and
    its first state tile loads before it waits: N = 8 13.8 against 14.7 us, N = 32 41.3
    against 41.5; one 4 KB tile was best at N = 1, 128 and 512)."""
    config = packed_decode_config(batch, HV, V, K, state_itemsize)
    if 32 < batch * HV <= 1024 and config.v_tiles == 1 and config.block_v > 1:
        return replace(config, block_v=config.block_v // 2, v_tiles=2)
    return config


def _unfused_chain(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, *, conv_bias,
                   scale, lower_bound, norm_gate, norm_weight, norm_eps, pdl=None,
                   conv_config: Conv1dUpdateConfig | None = None, decode_config: PackedDecodeConfig | None = None,
                   norm_config: GatedRMSNormConfig | None = None):
    """conv -> packed decode (-> gated norm). ``pdl`` (default: ``pdl_available``): each
    kernel after the first is a programmatic dependent launch of the one before, so its
    launch and its loads of what the one before does not write (the state tiles, the
    gate) overlap that kernel's tail; the conv itself waits for the whole stream.
    ``conv_config``, ``decode_config``, ``norm_config``: the kernels' launch configs (sweeps)."""
    B, HV, V, K = qkv.shape[0], *state.shape[1:]
    pdl = pdl_available(qkv.device) if pdl is None else pdl
    has_norm = norm_weight is not None
    # Both kernels treat a slot past either pool as padding; the conv counts it.
    num_slots = min(state.shape[0], conv_state.shape[0])
    mixed = causal_conv1d_update_triton(qkv, conv_state, conv_weight, slot_indices, torch.empty_like(qkv),
                                        bias=conv_bias, config=conv_config, launch_dependents=pdl,
                                        num_slots=num_slots, err_index=errors.INDEX["fused_decode"])
    o = torch.empty(out.shape, dtype=out.dtype, device=out.device) if has_norm else out
    packed_decode_triton(mixed, a, b, A_log, dt_bias, state, slot_indices, o, scale=scale, use_qk_l2norm=True,
                         lower_bound=lower_bound, wait_for_qkv=pdl,
                         config=decode_config or chain_decode_config(B, HV, V, K, state.element_size()),
                         launch_dependents=pdl and has_norm, num_slots=num_slots, err_index=errors.NO_COUNT)
    if has_norm:
        gated_rmsnorm_after(o, norm_gate.unflatten(-1, (HV, V)).unsqueeze(1), norm_weight, out, eps=norm_eps,
                            wait_for_x=pdl, config=norm_config)
    return out


@register("fused_decode", "triton")
def fused_decode_triton(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, *,
                        conv_bias, scale, lower_bound, norm_gate, norm_weight, norm_eps,
                        config: FusedDecodeConfig | None = None, pdl=None):
    """``config`` overrides the pinned choice (``fused_decode_config``; sweeps, tests): the
    one-kernel step with its tiles, or the unfused chain. ``pdl`` (default
    ``pdl_available``): the chain's later kernels start while the one before ends."""
    B = qkv.shape[0]
    _, HV, V, K = state.shape
    H = reference.infer_packed_heads(qkv.shape[1], HV, V, K)
    if B == 0:
        return out
    pdl = pdl_available(qkv.device) if pdl is None else pdl
    plan = config or fused_decode_config(B, H, HV, V, K, pdl=pdl)
    if plan.chain:
        return _unfused_chain(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out,
                              conv_bias=conv_bias, scale=scale, lower_bound=lower_bound, norm_gate=norm_gate,
                              norm_weight=norm_weight, norm_eps=norm_eps, pdl=pdl, conv_config=plan.conv,
                              decode_config=plan.decode, norm_config=plan.norm)
    has_norm = norm_weight is not None
    block_v, v_tiles, num_warps = plan.block_v, plan.v_tiles, plan.num_warps
    v_tiles = min(v_tiles, cdiv(V, block_v))  # no program streams tiles past V
    programs_per_head = cdiv(V, block_v * v_tiles)
    split = programs_per_head * (HV // H) > 1
    W = conv_weight.shape[1]
    _fused_decode(
        (programs_per_head, HV, B),
        (qkv, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_state, a, b, A_log, dt_bias,
         state, slot_indices, norm_gate if has_norm else qkv, norm_weight if has_norm else conv_weight, out,
         arrival_counters(qkv.device, B * H) if split else slot_indices, errors.counters(qkv.device),
         qkv.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), a.stride(0), b.stride(0),
         state.stride(0), norm_gate.stride(0) if has_norm else 0, min(state.shape[0], conv_state.shape[0]),
         float(scale), float(lower_bound) if lower_bound is not None else 0.0, float(norm_eps)),
        dict(H=H, HV=HV, GROUP=HV // H, K=K, V=V, W=W, BLOCK_K=next_power_of_2(K), BLOCK_V=block_v,
             V_TILES=v_tiles, PROGRAMS_PER_HEAD=programs_per_head, BLOCK_V_ROW=next_power_of_2(V),
             BLOCK_TAPS=next_power_of_2(W - 1), HAS_CONV_BIAS=conv_bias is not None,
             SAFE_GATE=lower_bound is not None, HAS_NORM=has_norm, ERR_INDEX=errors.INDEX["fused_decode"]),
        num_warps=num_warps, num_stages=1)
    return out


@register("fused_decode", "reference")
def fused_decode_reference(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, *,
                           conv_bias, scale, lower_bound, norm_gate, norm_weight, norm_eps):
    return reference.fused_decode(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out,
                                  conv_bias=conv_bias, scale=scale, lower_bound=lower_bound, norm_gate=norm_gate,
                                  norm_weight=norm_weight, norm_eps=norm_eps)


@kdakit_op("fused_decode", counts_errors=True, mutates=("conv_state", "state", "out"))
def fused_decode_op(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                    slot_indices: torch.Tensor, out: torch.Tensor, conv_bias: torch.Tensor | None, scale: float,
                    lower_bound: float | None, norm_gate: torch.Tensor | None, norm_weight: torch.Tensor | None,
                    norm_eps: float, backend: str | None) -> None:
    _, impl = select("fused_decode", qkv.device, backend)
    impl(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, conv_bias=conv_bias,
         scale=scale, lower_bound=lower_bound, norm_gate=norm_gate, norm_weight=norm_weight, norm_eps=norm_eps)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
def check_fused_decode(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, *,
                       conv_bias=None, lower_bound=None, norm_gate=None, norm_weight=None, norm_eps=1e-6,
                       full_checks=None) -> tuple:
    """The fused decode step. Returns ``(H, W)``."""
    check_dim("qkv", qkv, 2, "[B, 2*H*K + HV*V]")
    check_last_dim_contiguous("qkv", qkv)
    check_dim("a", a, 2, "[B, HV*K]")
    check_dim("b", b, 2, "[B, HV]")
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("b", b)
    if not (A_log.dim() == 1 and dt_bias.dim() == 1):
        raise ValueError(f"`A_log`/`dt_bias` must be 1D tensors (got A_log.ndim={A_log.dim()}, "
                         f"dt_bias.ndim={dt_bias.dim()}).")
    if not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        raise ValueError("`A_log`/`dt_bias` must be contiguous.")
    if (norm_gate is None) != (norm_weight is None):
        raise ValueError("the fused output norm needs both `norm_gate` and `norm_weight` "
                         f"(got norm_gate={'a tensor' if norm_gate is not None else None}, "
                         f"norm_weight={'a tensor' if norm_weight is not None else None}).")
    check_same_device(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out,
                      conv_bias, norm_gate, norm_weight)
    B, D = qkv.shape
    if not (a.shape[0] == B and b.shape[0] == B):
        raise ValueError(f"Mismatched batch sizes: qkv.shape[0]={B}, a.shape[0]={a.shape[0]}, b.shape[0]={b.shape[0]}.")
    check_slot_indices("slot_indices", slot_indices, B)
    check_state_pool(state, "state")
    _, HV, V, K = state.shape
    check_head_dims(K, V)
    check_gate_inputs(a, b, A_log, dt_bias, B, HV, K)
    qk_dim = D - HV * V
    if not (qk_dim > 0 and qk_dim % 2 == 0):
        raise ValueError(f"Invalid packed `qkv` last dim={D} for HV={HV}, V={V}; expected 2*H*K + HV*V.")
    if not ((qk_dim // 2) % K == 0):
        raise ValueError(f"Invalid packed Q size {qk_dim // 2} in `qkv` (last dim={D}): must be divisible by K={K}.")
    H = qk_dim // 2 // K
    if not (HV % H == 0):
        raise ValueError(f"Invalid head config inferred from qkv: H={H}, HV={HV}.")
    W = check_conv_weight("conv_weight", conv_weight, D)
    check_conv_bias("conv_bias", conv_bias, D)
    check_conv_pool("conv_state", conv_state, D, W)
    if not (_shape(out) == (B, 1, HV, V)):
        raise ValueError(f"`out` must have shape {(B, 1, HV, V)} (got out.shape={_shape(out)}).")
    if not (out.is_contiguous()):
        raise ValueError("`out` must be contiguous.")
    if norm_gate is not None:
        if not (_shape(norm_gate) == (B, HV * V)):
            raise ValueError(f"`norm_gate` must have shape [B, HV*V] = ({B}, {HV * V}) (got {_shape(norm_gate)}).")
        check_last_dim_contiguous("norm_gate", norm_gate)
        check_float_dtype("norm_gate", norm_gate)
        if not (_shape(norm_weight) == (V,)):
            raise ValueError(f"`norm_weight` must have shape [V] = ({V},) (got {_shape(norm_weight)}).")
        if not (norm_weight.dtype == torch.float32):
            raise ValueError(f"`norm_weight` must be float32 (got {norm_weight.dtype}).")
        if not (norm_weight.is_contiguous()):
            raise ValueError("`norm_weight` must be contiguous.")
        if not (float(norm_eps) > 0.0):
            raise ValueError(f"`norm_eps` must be > 0 (got {norm_eps}).")
    check_float_dtypes(qkv=qkv, a=a, b=b, out=out, A_log=A_log, dt_bias=dt_bias)
    check_lower_bound(lower_bound)
    if full_checks_enabled(full_checks):
        check_slot_values("slot_indices", slot_indices, min(state.shape[0], conv_state.shape[0]), full_checks=True)
        check_finite(True, A_log=A_log, dt_bias=dt_bias, conv_weight=conv_weight, conv_bias=conv_bias,
                     norm_weight=norm_weight)
    return H, W


def fused_decode(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, *, conv_bias=None,
                 scale=None, lower_bound=None, norm_gate=None, norm_weight=None, norm_eps=1e-6, out=None,
                 backend=None, full_checks=None):
    """One decode token for ``B`` requests: conv + L2 norm + gate + recurrence (+ gated RMSNorm).

    ``qkv [B, 2*H*K + HV*V]`` pre-conv projection; ``conv_weight [C, W]`` (and
    ``conv_bias [C]``) float32; ``conv_state [slots, C, W-1]`` (any strides) and
    ``state [slots, HV, V, K]`` updated in place at ``slot_indices [B]``; raw gate
    ``a [B, HV*K]``, raw beta ``b [B, HV]``, ``A_log [HV]``, ``dt_bias [HV*K]``.
    ``norm_gate [B, HV*V]`` with ``norm_weight [V]`` float32 turn on the output norm.
    ``scale`` defaults to ``K ** -0.5``; ``lower_bound`` selects the safe gate.
    Returns ``out [B, 1, HV, V]`` (allocated in ``qkv``'s dtype when not given).
    """
    if out is None:
        out = (qkv.new_empty(qkv.shape[0], 1, state.shape[1], state.shape[2])
               if qkv.dim() == 2 and state.dim() == 4 else qkv.new_empty(0))
    check_fused_decode(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out,
                       conv_bias=conv_bias, lower_bound=lower_bound, norm_gate=norm_gate,
                       norm_weight=norm_weight, norm_eps=norm_eps, full_checks=full_checks)
    scale = state.shape[-1] ** -0.5 if scale is None else scale
    fused_decode_op(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, conv_bias, scale,
                    lower_bound, norm_gate, norm_weight, norm_eps, backend)
    return out


@fused_decode_op.register_example
def _example(seed, device="cpu", *, out=True):
    g = example_rng(seed)
    B, H, HV, K, V, W, slots = 3, 1, 2, 8, 16, 4, 5
    C = 2 * H * K + HV * V
    bf16 = torch.bfloat16
    args = (example_randn(g, B, C, dtype=bf16, device=device), example_randn(g, C, W, scale=0.5, device=device),
            example_randn(g, slots, C, W - 1, dtype=bf16, device=device),
            example_randn(g, B, HV * K, dtype=bf16, device=device), example_randn(g, B, HV, dtype=bf16, device=device),
            example_rand(g, HV, device=device), example_randn(g, HV * K, scale=0.5, device=device),
            example_randn(g, slots, HV, V, K, scale=0.5, device=device), example_index(-1, 4, 1, device=device))
    kw = dict(conv_bias=example_randn(g, C, scale=0.1, device=device),
              norm_gate=example_randn(g, B, HV * V, dtype=bf16, device=device),
              norm_weight=example_rand(g, V, device=device) + 0.5)
    if out:
        kw["out"] = torch.full((B, 1, HV, V), 7.0, dtype=bf16, device=device)
    return fused_decode, args, kw
