"""The short conv of a verify, once per channel: a prologue kernel before the recurrence.

Fused into the recurrence kernel, the q/k conv of a key head is recomputed by every
V-tile program of the head (16 at K = V = 128) and the chain's loads queue behind it;
run here once per channel, it writes the post-conv q, k, v of every step (rounded to the
activation dtype, exactly as the fused path and an unfused conv round them) and the
windows after each step, and the recurrence reads the post-conv tokens like inputs that
came already convolved. From 8 steps on, the windows are stored as whole contiguous runs
(``_store_windows``) rather than tap by tap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .launch import CachedKernel, cdiv, next_power_of_2
from .triton_math import mask_if, silu, verify_request


@triton.jit
def _conv_inputs(x, stride_x_t, window, stride_win_c, stride_win_w, ch, mask, live, pos, T, W: tl.constexpr):
    """Positions ``pos`` ([BLOCK_T, 1]) of the sequence [persistent window (W-1), x_0, x_1, ...]."""
    in_window = pos < W - 1
    from_window = tl.load(window + ch[None, :] * stride_win_c + pos * stride_win_w,
                          mask=in_window & mask_if(mask, live)[None, :], other=0.0)
    x_pos = pos - (W - 1)
    from_x = tl.load(x + x_pos * stride_x_t + ch[None, :], mask=(x_pos >= 0) & (x_pos < T) & mask[None, :],
                     other=0.0)
    return tl.where(in_window, from_window, from_x).to(tl.float32)


@triton.jit
def _conv_silu_steps(x, stride_x_t, window, stride_win_c, stride_win_w, weight, bias, ch, mask, live,
                     dst, stride_dst_t,
                     T, W: tl.constexpr, BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr, WINDOW_RUNS: tl.constexpr):
    """[BLOCK_T, channels] SiLU(conv) of every step at once, all loads in flight together,
    taps summed oldest first as the unfused conv kernel sums them (triton_math.short_conv).
    Without WINDOW_RUNS, taps 1 .. W-1 of step t are stored as they are read: they are the
    window after step t (into the [C, W-1] blocks of ``dst``; none for a padding row)."""
    pos = tl.arange(0, BLOCK_T)[:, None]
    acc = tl.zeros_like(pos.to(tl.float32) + ch[None, :].to(tl.float32))
    for j in tl.static_range(W):
        w = tl.load(weight + ch * W + j, mask=mask, other=0.0)
        tap = _conv_inputs(x, stride_x_t, window, stride_win_c, stride_win_w, ch, mask, live, pos + j, T, W)
        acc += w[None, :] * tap
        if not WINDOW_RUNS and j >= 1:
            tl.store(dst + pos * stride_dst_t + ch[None, :] * (W - 1) + (j - 1), tap.to(dst.dtype.element_ty),
                     mask=(pos < T) & mask_if(mask, live)[None, :])
    if HAS_BIAS:
        acc += tl.load(bias + ch, mask=mask, other=0.0)[None, :]
    return silu(acc)


@triton.jit
def _store_windows(x, stride_x_t, window, stride_win_c, stride_win_w, c0, C, live, dst, stride_dst_t, T,
                   W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr):
    """The windows after each step of channels c0 .. c0 + BLOCK_C, as the contiguous runs
    they are in ``dst`` ([C, W-1] per step): flat element f is tap f % (W-1) of channel
    f // (W-1), position t + 1 + tap of [window, x_0, x_1, ...] (the loads hit the lines
    the conv just read; the stores are whole runs, where per-tap stores wrote every sector
    W-1 times in part)."""
    pos = tl.arange(0, BLOCK_T)[:, None]
    f = tl.arange(0, BLOCK_F)
    c = c0 + f // (W - 1)
    valid = (f < BLOCK_C * (W - 1)) & (c < C)
    src = pos + 1 + (f % (W - 1))[None, :]
    vals = _conv_inputs(x, stride_x_t, window, stride_win_c, stride_win_w, c, valid, live, src, T, W)
    tl.store(dst + pos * stride_dst_t + c0 * (W - 1) + f[None, :], vals.to(dst.dtype.element_ty),
             mask=(pos < T) & mask_if(valid, live)[None, :])


@triton.jit
def _conv_part(x, window, weight, bias, inter, post, s_win_slot, s_win_c, s_win_w, s_inter_row, s_inter_t,
               slot, row, live, n64, i_c, C: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, HAS_BIAS: tl.constexpr,
               WINDOW_RUNS: tl.constexpr):
    ch = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < C
    x_n = x + n64 * T * C                      # this request's token 0, channel 0
    win = window + slot * s_win_slot
    y = _conv_silu_steps(x_n, C, win, s_win_c, s_win_w, weight, bias, ch, mask, live, inter + row * s_inter_row,
                         s_inter_t, T, W, BLOCK_T, HAS_BIAS, WINDOW_RUNS)
    steps = tl.arange(0, BLOCK_T)
    tl.store(post + (n64 * T + steps[:, None]) * C + ch[None, :], y.to(post.dtype.element_ty),
             mask=(steps < T)[:, None] & mask[None, :])
    if WINDOW_RUNS:
        _store_windows(x_n, C, win, s_win_c, s_win_w, i_c * BLOCK_C, C, live, inter + row * s_inter_row, s_inter_t,
                       T, W, BLOCK_T, BLOCK_C, BLOCK_F)


@triton.jit
def _verify_conv_kernel(
    x_q, x_k, x_v, w_q, w_k, w_v, bias_q, bias_k, bias_v, cs_q, cs_k, cs_v, ic_q, ic_k, ic_v, post_q, post_k, post_v,
    slot_indices, scratch_indices,
    s_csq_slot, s_csq_c, s_csq_w, s_csk_slot, s_csk_c, s_csk_w, s_csv_slot, s_csv_c, s_csv_w,
    s_icq_row, s_icq_t, s_ick_row, s_ick_t, s_icv_row, s_icv_t, num_slots, num_rows,
    C_QK: tl.constexpr, C_V: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr,
    HAS_BIAS: tl.constexpr, WINDOW_RUNS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):
    # One program: BLOCK_C channels of q, k or v (program_id 2) of one request, all steps.
    # A padding row (slot < 0, or a slot or scratch row past its buffer, as the recurrence
    # kernels decide it too) reads no window and writes none; its post-conv tokens are never
    # used (the recurrence writes zeros for it).
    i_c, i_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if LAUNCH_DEPENDENTS:  # the recurrence may start loading its state tiles now
        gdc_launch_dependents()
    slot, row, live = verify_request(slot_indices, scratch_indices, i_n, num_slots, num_rows, True)
    n64 = i_n.to(tl.int64)
    if part == 0:
        _conv_part(x_q, cs_q, w_q, bias_q, ic_q, post_q, s_csq_slot, s_csq_c, s_csq_w, s_icq_row, s_icq_t,
                   slot, row, live, n64, i_c, C_QK, T, W, BLOCK_T, BLOCK_C, BLOCK_F, HAS_BIAS, WINDOW_RUNS)
    elif part == 1:
        _conv_part(x_k, cs_k, w_k, bias_k, ic_k, post_k, s_csk_slot, s_csk_c, s_csk_w, s_ick_row, s_ick_t,
                   slot, row, live, n64, i_c, C_QK, T, W, BLOCK_T, BLOCK_C, BLOCK_F, HAS_BIAS, WINDOW_RUNS)
    else:
        _conv_part(x_v, cs_v, w_v, bias_v, ic_v, post_v, s_csv_slot, s_csv_c, s_csv_w, s_icv_row, s_icv_t,
                   slot, row, live, n64, i_c, C_V, T, W, BLOCK_T, BLOCK_C, BLOCK_F, HAS_BIAS, WINDOW_RUNS)


_verify_conv = CachedKernel(_verify_conv_kernel)

@dataclass(frozen=True)
class VerifyConvConfig:
    """Launch configuration of the conv prologue (``verify_conv_config`` picks it from the
    steps). Channels per program and warps: [steps, block_c] tiles (a benchmark sweep passes
    its own: bench_mtp.py --conv-configs); 64 channels on 2 warps and 128 on 4 tied from 2 to 4
    steps, 64 on 2 was 7% faster at 8 (results/mtp_conv_coalesced_ab_h200.json).
    ``window_runs``: the windows after each step stored as whole runs (``_store_windows``),
    else tap by tap (``window_runs``)."""
    block_c: int = 64
    num_warps: int = 2
    window_runs: bool = False


# The windows after each step stored as whole runs from this many steps, per tap below:
# ring verify with the conv at N = 64, 8 steps 135-145 us against 160-162, but 2 and 4
# steps 5-8% slower (results/mtp_conv_coalesced_ab_h200.json).
WINDOW_RUNS_FROM_STEPS = 8


def window_runs(T: int) -> bool:
    return T >= WINDOW_RUNS_FROM_STEPS


def verify_conv_config(T: int) -> VerifyConvConfig:
    """The conv prologue's pinned config for ``T`` steps."""
    return VerifyConvConfig(window_runs=window_runs(T))


def verify_conv(q, k, v, conv_weights, conv_bias, conv_states, intermediate_conv, slot_indices, scratch_indices,
                bounds, *, launch_dependents=False, config: VerifyConvConfig | None = None):
    """Post-conv ``(q, k, v)`` of every step (new tensors shaped like the inputs); the windows
    after each step go to ``intermediate_conv[i][scratch_indices[n], t]``. ``bounds = (slots,
    scratch rows)``: rows whose slot or scratch row is outside them are padding. ``launch_dependents``:
    the next kernel, a programmatic dependent launch, may start early. ``config`` (default
    ``verify_conv_config``): the launch configuration."""
    N, T, H, K = q.shape
    HV, V = v.shape[2:]
    post = tuple(torch.empty_like(t) for t in (q, k, v))
    bias = conv_bias if conv_bias is not None else conv_weights
    W = conv_weights[0].shape[1]
    cfg = config or verify_conv_config(T)
    block_c = cfg.block_c
    _verify_conv(
        (cdiv(max(H * K, HV * V), block_c), N, 3),
        (q, k, v, *conv_weights, *bias, *conv_states, *intermediate_conv, *post, slot_indices, scratch_indices,
         *(cs.stride(d) for cs in conv_states for d in (0, 1, 2)),
         *(ic.stride(d) for ic in intermediate_conv for d in (0, 1)), *bounds),
        dict(C_QK=H * K, C_V=HV * V, T=T, W=W, BLOCK_T=next_power_of_2(T), BLOCK_C=block_c,
             BLOCK_F=next_power_of_2(block_c * (W - 1)), HAS_BIAS=conv_bias is not None,
             WINDOW_RUNS=bool(cfg.window_runs),
             LAUNCH_DEPENDENTS=bool(launch_dependents)),
        num_warps=cfg.num_warps, num_stages=1)
    return post
