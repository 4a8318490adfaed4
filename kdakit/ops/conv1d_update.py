"""Causal short conv of one token per request over a pool of conv windows.

``x [B, C]`` is the pre-conv projection; ``conv_state [slots, C, W-1]`` holds each
channel's previous ``W-1`` inputs, oldest first, with any strides (a pool stored as
``[slots, W-1, C]`` and passed as ``.transpose(1, 2)`` works); ``weight [C, W]``
float32. ``out[i] = SiLU(conv)`` rounded to ``x``'s dtype, and ``conv_state[slot]``
shifts left and appends ``x[i]`` in place. A slot < 0 is a padding row: zero
output, no pool access; so is a slot past the pool, which is counted (``kdakit.take_errors``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .. import errors, reference
from ..backends import register, select
from ..contracts import (check_conv_bias, check_conv_pool, check_conv_weight, check_dim, check_finite,
                         check_float_dtype, check_last_dim_contiguous, check_same_device, check_shape,
                         check_slot_indices, check_slot_values, full_checks_enabled)
from .launch import CachedKernel, cdiv, next_power_of_2
from .registry import example_index, example_randn, example_rng, kdakit_op
from .triton_math import count_bad_row, short_conv_update


@triton.jit
def _causal_conv1d_update_kernel(
    x, conv_state, weight, bias, slot_indices, out, errors,
    num_channels, num_slots, stride_x_row, stride_out_row, stride_conv_slot, stride_conv_chan, stride_conv_tap,
    W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_TAPS: tl.constexpr, HAS_BIAS: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr, ERR_INDEX: tl.constexpr,
):
    # One program per (block of channels, request): each channel's window has exactly
    # one reader and writer, so the in-place shift needs no cross-program ordering.
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    if LAUNCH_DEPENDENTS:  # the decode after it may start loading its state now
        gdc_launch_dependents()
    offs_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_channels
    slot = tl.load(slot_indices + i_b).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)  # a slot past the pool: a padding row
    win_ptrs = conv_state + slot * stride_conv_slot + offs_c.to(tl.int64) * stride_conv_chan
    y = short_conv_update(x + i_b.to(tl.int64) * stride_x_row + offs_c, win_ptrs, weight + offs_c * W,
                          bias + offs_c, stride_conv_tap, mask_c, live, W, BLOCK_TAPS, HAS_BIAS)
    y = tl.where(live, y, 0.0)
    tl.store(out + i_b.to(tl.int64) * stride_out_row + offs_c, y.to(out.dtype.element_ty), mask=mask_c)
    count_bad_row(errors, (slot >= num_slots) & (i_c == 0), ERR_INDEX)


_causal_conv1d_update = CachedKernel(_causal_conv1d_update_kernel)


@dataclass(frozen=True)
class Conv1dUpdateConfig:
    """Launch configuration of one call (``conv1d_update_config`` picks it from the shapes)."""
    block_c: int            # channels per program
    num_warps: int = 1


def conv1d_update_config(channels: int) -> Conv1dUpdateConfig:
    """Pinned (no autotune): 256 channels (4 a thread, 2 warps) per program; a few KB of
    window per program keeps many programs in flight at B = 1."""
    block_c = min(256, next_power_of_2(channels))
    return Conv1dUpdateConfig(block_c=block_c, num_warps=2 if block_c >= 256 else 1)


@register("causal_conv1d_update", "triton")
def causal_conv1d_update_triton(x, conv_state, weight, slot_indices, out, *, bias=None,
                                config: Conv1dUpdateConfig | None = None, launch_dependents=False, num_slots=None,
                                err_index=None):
    """``config`` overrides the pinned choice (``conv1d_update_config``; sweeps, tests);
    ``launch_dependents``: the next kernel, a programmatic dependent launch, may start early.
    ``num_slots`` (default: the pool's): slots from there on are padding, counted on
    counter ``err_index`` (default: causal_conv1d_update's; ``errors.NO_COUNT``: not counted)."""
    if err_index is None:
        err_index = errors.INDEX["causal_conv1d_update"]
    B, C = x.shape
    if B == 0:
        return out
    W = weight.shape[1]
    cfg = config or conv1d_update_config(C)
    block_c, num_warps = cfg.block_c, cfg.num_warps
    _causal_conv1d_update(
        (cdiv(C, block_c), B, 1),
        (x, conv_state, weight, bias if bias is not None else weight, slot_indices, out, errors.counters(x.device),
         C, conv_state.shape[0] if num_slots is None else num_slots, x.stride(0), out.stride(0),
         conv_state.stride(0), conv_state.stride(1), conv_state.stride(2)),
        dict(W=W, BLOCK_C=block_c, BLOCK_TAPS=next_power_of_2(W - 1), HAS_BIAS=bias is not None,
             LAUNCH_DEPENDENTS=bool(launch_dependents), ERR_INDEX=err_index),
        num_warps=num_warps, num_stages=1)
    return out


@register("causal_conv1d_update", "reference")
def causal_conv1d_update_reference(x, conv_state, weight, slot_indices, out, *, bias=None):
    return reference.causal_conv1d_update(x, conv_state, weight, slot_indices, out, bias=bias)


@kdakit_op("causal_conv1d_update", counts_errors=True, mutates=("conv_state", "out"))
def causal_conv1d_update_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                            slot_indices: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                            backend: str | None) -> None:
    _, impl = select("causal_conv1d_update", x.device, backend)
    impl(x, conv_state, weight, slot_indices, out, bias=bias)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
def check_causal_conv1d_update(x, conv_state, weight, slot_indices, out, *, bias=None, full_checks=None) -> int:
    """``x [B, C]``, ``conv_state [slots, C, W-1]``, ``weight [C, W]``, ``out [B, C]`` (x's dtype). Returns W."""
    check_dim("x", x, 2, "[B, C]")
    check_last_dim_contiguous("x", x)
    check_float_dtype("x", x)
    check_same_device(x, conv_state, weight, slot_indices, out, bias)
    B, C = x.shape
    W = check_conv_weight("weight", weight, C)
    check_conv_bias("bias", bias, C)
    check_conv_pool("conv_state", conv_state, C, W)
    check_slot_indices("slot_indices", slot_indices, B)
    check_shape("out", out, (B, C), "[B, C]")
    check_last_dim_contiguous("out", out)
    if not (out.dtype == x.dtype):
        raise ValueError(f"`out` must have x's dtype {x.dtype}: post-conv values are rounded to the activation "
                         f"dtype (got {out.dtype}).")
    if full_checks_enabled(full_checks):
        check_slot_values("slot_indices", slot_indices, conv_state.shape[0], full_checks=True)
        check_finite(True, weight=weight, bias=bias)
    return W


def causal_conv1d_update(x, conv_state, weight, slot_indices, *, bias=None, out=None, backend=None,
                         full_checks=None):
    """Short conv (SiLU) of one token for ``B`` requests; shifts ``conv_state[slot_indices[i]]`` in place.

    ``x [B, C]`` (float32/bfloat16/float16), ``conv_state [slots, C, W-1]`` (any strides),
    ``weight [C, W]`` and ``bias [C]`` float32, ``slot_indices [B]`` int32/int64.
    Returns ``out [B, C]`` in ``x``'s dtype (allocated when not given).
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check_causal_conv1d_update(x, conv_state, weight, slot_indices, out, bias=bias,
                               full_checks=full_checks)
    causal_conv1d_update_op(x, conv_state, weight, slot_indices, out, bias, backend)
    return out


@causal_conv1d_update_op.register_example
def _example(seed, device="cpu", *, out=True):
    g = example_rng(seed)
    B, C, W, slots = 3, 24, 4, 4
    bf16 = torch.bfloat16
    args = (example_randn(g, B, C, dtype=bf16, device=device),
            example_randn(g, slots, C, W - 1, dtype=bf16, device=device),
            example_randn(g, C, W, scale=0.5, device=device), example_index(2, -1, 0, dtype=torch.int64, device=device))
    kw = dict(bias=example_randn(g, C, scale=0.1, device=device))
    if out:
        kw["out"] = torch.full((B, C), 7.0, dtype=bf16, device=device)
    return causal_conv1d_update, args, kw
