"""Causal short conv of the tokens of several sequences (the extend / prefill path).

``x [T, C]`` holds the pre-conv inputs of ``N`` sequences back to back, split by
``cu_seqlens [N+1]`` (any strides: the transposed ``[C, T]`` view engines keep works);
``conv_state [slots, C, W-1]`` is the pool of windows (any strides; a pool stored as
``[slots, W-1, C]`` and passed as ``.transpose(1, 2)`` works); ``weight [C, W]`` float32.
Sequence ``n`` starts from ``conv_state[slot_indices[n]]`` when that slot is in the pool and
``has_initial_state[n]`` (all True when not given), from zeros otherwise; every token's
``SiLU(conv)`` goes to ``out`` rounded to x's dtype; afterwards the slot holds the last
``W-1`` entries of [starting window, the sequence's inputs] (a sequence shorter than ``W-1``
keeps the tail of its starting window). A slot < 0 (padding) or >= the pool's slot count
starts from zeros and is neither read nor written; a sequence of length 0 writes nothing. A
slot >= the pool's slot count of a sequence with tokens is counted once per call
(``kdakit.take_errors``), by the program whose tile holds the sequence's first token, channel
block 0.

The kernel needs no host sync (no ``.item()``, no allocation that depends on data): its grid
is (channel blocks x tiles of ``BLOCK_T`` tokens) from the shapes alone. Each program computes its
tile from x alone, with 16-byte loads along x's contiguous axis (channels for ``[T, C]`` rows,
tokens for the transposed view) and the taps picked from registers; one binary search over
``cu_seqlens`` per tile tells whether a sequence start reaches its taps. Only the first ``W-1``
tokens of each sequence need its window (or zeros): the program whose tile holds the sequence's
first token computes them again, then writes the window. It can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import errors, reference
from ..backends import register, select
from ..contracts import (_shape, check_conv_bias, check_conv_pool, check_conv_weight, check_dim, check_finite,
                         check_float_dtype, check_index_dtype, check_non_overlapping, check_same_device, check_shape,
                         check_slot_values, full_checks_enabled)
from .launch import CachedKernel, cdiv, next_power_of_2
from .registry import example_index, example_randn, example_rng, kdakit_op
from .triton_math import count_bad_row, silu


@triton.jit
def _count_below(cu_seqlens, N, v, BLOCK_N: tl.constexpr):
    """How many of ``cu_seqlens[0 .. N)`` are ``< v`` (offsets never decreasing: the first ``count``),
    ``BLOCK_N`` offsets a load: one round trip up to ``BLOCK_N`` sequences, where a binary search
    waits for log2(N) loads one after another. Loads stay inside ``cu_seqlens[0 .. N)``."""
    count = v * 0
    i = v * 0
    while i < N:
        offs = i + tl.arange(0, BLOCK_N)
        in_range = offs < N
        vals = tl.load(cu_seqlens + offs, mask=in_range, other=0)
        count += tl.sum(((vals < v) & in_range).to(tl.int32), axis=0)
        i += BLOCK_N
    return count


@triton.jit
def _halves(v, R: tl.constexpr, S: tl.constexpr, L: tl.constexpr):
    """``v [R, S, L]`` -> its even and its odd entries along the last axis, each ``[R, S, L // 2]``."""
    return tl.split(tl.reshape(v, (R, S, L // 2, 2)))


@triton.jit
def _columns(v, R: tl.constexpr, S: tl.constexpr, VEC: tl.constexpr):
    """``v [R, S, VEC]`` -> the tuple of its ``VEC`` columns ``v[:, :, e]``, each ``[R, S]``. The last
    axis lies in each thread's registers, so the splits move no data between threads."""
    if VEC == 1:
        cols = (tl.reshape(v, (R, S)),)
    elif VEC == 2:
        c0, c1 = tl.split(v)
        cols = (c0, c1)
    elif VEC == 4:
        e, o = _halves(v, R, S, 4)
        c0, c2 = tl.split(e)
        c1, c3 = tl.split(o)
        cols = (c0, c1, c2, c3)
    else:
        e, o = _halves(v, R, S, 8)
        ee, eo = _halves(e, R, S, 4)
        oe, oo = _halves(o, R, S, 4)
        c0, c4 = tl.split(ee)
        c2, c6 = tl.split(eo)
        c1, c5 = tl.split(oe)
        c3, c7 = tl.split(oo)
        cols = (c0, c1, c2, c3, c4, c5, c6, c7)
    return cols


@triton.jit
def _rejoin(c, R: tl.constexpr, S: tl.constexpr, VEC: tl.constexpr):
    """The inverse of ``_columns``: ``VEC`` columns ``[R, S]`` -> ``[R, S, VEC]``."""
    if VEC == 1:
        v = tl.reshape(c[0], (R, S, 1))
    elif VEC == 2:
        v = tl.join(c[0], c[1])
    elif VEC == 4:
        v = tl.reshape(tl.join(tl.join(c[0], c[2]), tl.join(c[1], c[3])), (R, S, 4))
    else:
        e = tl.reshape(tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6])), (R, S, 4))
        o = tl.reshape(tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7])), (R, S, 4))
        v = tl.reshape(tl.join(e, o), (R, S, 8))
    return v


@triton.jit
def _tap(cols, d: tl.constexpr, VEC: tl.constexpr):
    """The inputs ``d`` tokens after each vector's first (``d < 0``: in the vector ``q`` before,
    ``cols[q]``), from ``cols`` as the tile's loads give them."""
    return cols[(VEC - 1 - d) // VEC][d + (VEC - 1 - d) // VEC * VEC]


@triton.jit
def _first_outputs(x, weight, bias, out, win, seq_start, n_first, old_taps, ch, C,
                   stride_x_t, stride_x_c, stride_out_t, stride_out_c, stride_conv_chan, stride_conv_tap,
                   W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The outputs of a sequence's first ``n_first`` (<= W-1) tokens, whose taps reach back before
    its first token: into its starting window ``win`` (taps below ``old_taps``), zeros past those.
    A token at a time, so this path needs fewer registers than the tile."""
    ch64 = ch.to(tl.int64)
    mask_c = ch < C
    r = n_first * 0
    while r < n_first:
        tok = seq_start + r
        acc = tl.zeros([ch.shape[0]], dtype=tl.float32)
        for j in tl.static_range(W):
            pos = tok - (W - 1) + j
            in_x = pos >= seq_start
            # scalar conditions folded into the channel bound: no block & scalar masks
            val = tl.load(x + pos * stride_x_t + ch64 * stride_x_c, mask=ch < tl.where(in_x, C, 0),
                          other=0.0).to(tl.float32)
            if j < W - 1:
                tap = r + j                            # index into the window, oldest first
                from_win = tl.load(win + ch64 * stride_conv_chan + tap * stride_conv_tap,
                                   mask=ch < tl.where((~in_x) & (tap < old_taps), C, 0), other=0.0).to(tl.float32)
                val = tl.where(in_x, val, from_win)
            acc += tl.load(weight + ch * W + j, mask=mask_c, other=0.0) * val
        if HAS_BIAS:
            acc += tl.load(bias + ch, mask=mask_c, other=0.0)
        if SILU:
            acc = silu(acc)
        tl.store(out + tok * stride_out_t + ch64 * stride_out_c, acc.to(out.dtype.element_ty), mask=mask_c)
        r += 1


@triton.jit
def _owned_sequences(x, conv_state, weight, bias, cu_seqlens, slot_indices, has_initial_state, out, errors,
                     first_owned, end, ch, i_c, T, C, num_slots, stride_x_t, stride_x_c, stride_out_t, stride_out_c,
                     stride_conv_slot, stride_conv_chan, stride_conv_tap, W: tl.constexpr, BLOCK_TAPS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, SILU: tl.constexpr,
                     ERR_INDEX: tl.constexpr):
    """Sequences ``first_owned .. end`` (those whose first token is in the caller's tile): the
    outputs of their first W-1 tokens from the old window, then their new windows (taps
    k = 0 .. W-2 are entries len+k of [old window (W-1), the sequence's inputs])."""
    mask_c = ch < C
    k = tl.arange(0, BLOCK_TAPS)
    ch64 = ch.to(tl.int64)
    n = first_owned
    while n < end:
        # Offsets clamped into [0, T], the end at least the start: whatever cu_seqlens holds (its
        # values are checked only with full checks), no tap reaches outside x or the window.
        seq_start = tl.minimum(tl.maximum(tl.load(cu_seqlens + n).to(tl.int64), 0), T)
        length = tl.minimum(tl.maximum(tl.load(cu_seqlens + n + 1).to(tl.int64), seq_start), T) - seq_start
        slot = tl.load(slot_indices + n).to(tl.int64)
        live = (slot >= 0) & (slot < num_slots) & (length > 0)
        # a slot past the pool (a sequence with tokens): counted once, by channel block 0
        count_bad_row(errors, (slot >= num_slots) & (length > 0) & (i_c == 0), ERR_INDEX)
        num_taps = tl.where(live, W - 1, 0)            # folded into the bounds: no block & scalar masks
        old_taps = num_taps
        if HAS_INIT_FLAGS:
            old_taps = tl.where(tl.load(has_initial_state + n).to(tl.int32) != 0, num_taps, 0)
        win = conv_state + slot * stride_conv_slot
        _first_outputs(x, weight, bias, out, win, seq_start, tl.minimum(length, W - 1), old_taps, ch, C,
                       stride_x_t, stride_x_c, stride_out_t, stride_out_c, stride_conv_chan, stride_conv_tap,
                       W, HAS_BIAS, SILU)
        src = length + k                               # [BLOCK_TAPS]
        pos = seq_start + src - (W - 1)
        win_rows = win + ch64[None, :] * stride_conv_chan
        from_x = tl.load(x + pos[:, None] * stride_x_t + ch64[None, :] * stride_x_c,
                         mask=((src >= W - 1) & (k < num_taps) & (pos >= 0) & (pos < T))[:, None] & mask_c[None, :],
                         other=0.0)
        from_old = tl.load(win_rows + src[:, None] * stride_conv_tap,
                           mask=(src < old_taps)[:, None] & mask_c[None, :], other=0.0)
        new = tl.where((src >= W - 1)[:, None], from_x.to(conv_state.dtype.element_ty), from_old)
        tl.debug_barrier()  # every read of this slot's old window (above) before any store
        tl.store(win_rows + k[:, None] * stride_conv_tap, new, mask=(k < num_taps)[:, None] & mask_c[None, :])
        n += 1


@triton.jit
def _causal_conv1d_varlen_kernel(
    x, conv_state, weight, bias, cu_seqlens, slot_indices, has_initial_state, out, errors,
    T, C, N, num_slots,
    stride_x_t, stride_x_c, stride_out_t, stride_out_c, stride_conv_slot, stride_conv_chan, stride_conv_tap,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr, BLOCK_TAPS: tl.constexpr,
    BLOCK_N: tl.constexpr, TOKEN_MAJOR: tl.constexpr, OUT_TOKENS_INNER: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, SILU: tl.constexpr, ERR_INDEX: tl.constexpr,
):
    # One program per (block of channels, tile of BLOCK_T tokens), the tile held as
    # [BLOCK_C, BLOCK_T // VEC, VEC]: token t0 + VEC*b + e. Every thread holds whole vectors of
    # VEC consecutive tokens of its channels, so the taps x[t-W+1 .. t] are register picks from its
    # own vector and the vector(s) just before it (loaded shifted by VEC tokens: aligned, and L1
    # hits but for the first). The compiler lays the tile out from the strides: with tokens
    # contiguous (the transposed view) a thread's vector is one 16-byte load; with channels
    # contiguous it is VEC loads of 8 channels each, the tile's tokens all in its registers.
    #
    # Every token is first computed from x alone; that is its output unless its taps reach back
    # before its sequence's first token (a token within W-1 of a sequence start: "near" it).
    # The outputs of near tokens, and the windows, come from one program per sequence: the one
    # whose tile holds the sequence's first token, which computes the sequence's first W-1 tokens
    # (even those past its tile) from the old window, then, after a barrier that orders those
    # reads before the stores, writes the new window. So every window has one reader and one
    # writer, and reads come first. (Two sequences of one batch with the same live slot are outside
    # the contract; full-check mode rejects them.) x is read-only and never aliases out.
    pid = tl.program_id(0)
    if TOKEN_MAJOR:  # consecutive programs: consecutive tiles of one channel block
        num_tiles = tl.cdiv(T, BLOCK_T)
        i_c, i_t = pid // num_tiles, pid % num_tiles
    else:            # consecutive programs: the channel blocks of one tile
        num_blocks = tl.cdiv(C, BLOCK_C)
        i_c, i_t = pid % num_blocks, pid // num_blocks
    NB: tl.constexpr = BLOCK_T // VEC
    NQ: tl.constexpr = (W - 2 + VEC) // VEC            # vectors before each one that its taps reach
    t0 = i_t * BLOCK_T
    ch = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = ch < C
    tok = t0 + tl.arange(0, BLOCK_T)[None, :]
    x_chan = x + ch[:, None].to(tl.int64) * stride_x_c
    # Loads as [BLOCK_C, BLOCK_T], the layout the compiler picks for the strides (16-byte vectors
    # along the contiguous axis), then viewed as [BLOCK_C, NB, VEC], splitting the token axis.
    cols = ()                                          # cols[q][e]: token t0 + VEC*(b-q) + e
    for q in tl.static_range(NQ + 1):
        tap_tok = tok - q * VEC
        v = tl.load(x_chan + tap_tok.to(tl.int64) * stride_x_t,
                    mask=(tap_tok >= 0) & (tap_tok < T) & mask_c[:, None], other=0.0)
        cols = cols + (_columns(tl.reshape(v, (BLOCK_C, NB, VEC)), BLOCK_C, NB, VEC),)

    # Sequence starts that reach this tile's taps, in (t0 - (W-1), t0 + BLOCK_T): none in most
    # tiles, found by one search per tile; the starts that follow, when there are some, one by one.
    lo = _count_below(cu_seqlens, N, t0 - (W - 2), BLOCK_N)
    busy = (lo < N) & (tl.load(cu_seqlens + tl.minimum(lo, N - 1)) < t0 + BLOCK_T)
    near = tok < 0
    end = lo
    first_owned = lo                                   # the first sequence starting at t0 or later
    if busy:
        end = _count_below(cu_seqlens, N, t0 + BLOCK_T, BLOCK_N)
        n = lo
        while n < end:
            start = tl.load(cu_seqlens + n)
            near = near | ((tok >= start) & (tok < start + (W - 1)))
            first_owned += (start < t0).to(tl.int32)
            n += 1

    # Taps summed oldest first, then the bias: the order of the one-token conv
    # (triton_math.conv_apply), so chaining causal_conv1d_update gives the same numbers.
    w_taps = ()
    for j in tl.static_range(W):
        w_taps = w_taps + (tl.load(weight + ch * W + j, mask=mask_c, other=0.0)[:, None],)
    if HAS_BIAS:
        b = tl.load(bias + ch, mask=mask_c, other=0.0)[:, None]
    ys = ()
    for e in tl.static_range(VEC):
        acc = tl.zeros([BLOCK_C, NB], dtype=tl.float32)
        for j in tl.static_range(W):
            acc += w_taps[j] * _tap(cols, e - (W - 1) + j, VEC).to(tl.float32)
        if HAS_BIAS:
            acc += b
        if SILU:
            acc = silu(acc)
        ys = ys + (acc.to(out.dtype.element_ty),)
    y = tl.reshape(_rejoin(ys, BLOCK_C, NB, VEC), (BLOCK_C, BLOCK_T))
    out_ptrs = out + ch[:, None].to(tl.int64) * stride_out_c + tok.to(tl.int64) * stride_out_t
    keep = (tok < T) & mask_c[:, None]
    if OUT_TOKENS_INNER:  # a store vector spans tokens: a mask per token would split every one
        if busy:
            tl.store(out_ptrs, y, mask=keep & (~near))
        else:
            tl.store(out_ptrs, y, mask=keep)
    else:
        tl.store(out_ptrs, y, mask=keep & (~near))

    # The sequences whose first token is in this tile: their first W-1 tokens' outputs, then their
    # new windows.
    _owned_sequences(x, conv_state, weight, bias, cu_seqlens, slot_indices, has_initial_state, out, errors,
                     first_owned, end, ch, i_c, T, C, num_slots, stride_x_t, stride_x_c, stride_out_t, stride_out_c,
                     stride_conv_slot, stride_conv_chan, stride_conv_tap, W, BLOCK_TAPS, HAS_BIAS, HAS_INIT_FLAGS,
                     SILU, ERR_INDEX)


_causal_conv1d_varlen = CachedKernel(_causal_conv1d_varlen_kernel)


@triton.jit
def _causal_conv1d_varlen_rows_kernel(
    x, conv_state, weight, bias, cu_seqlens, slot_indices, has_initial_state, out, errors,
    T, C, N, num_slots,
    stride_x_t, stride_x_c, stride_out_t, stride_out_c, stride_conv_slot, stride_conv_chan, stride_conv_tap,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_TAPS: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, SILU: tl.constexpr, ERR_INDEX: tl.constexpr,
):
    # The "rows" form: one program per (block of channels, tile of BLOCK_T tokens) streams the
    # tile's tokens one row at a time (a row: BLOCK_C channels of one token, contiguous when x's
    # channels are), keeping the last W-1 rows in registers. Each input row is loaded once, plus
    # W-1 rows before the tile (the tile form loads every tap vector again, shifted). The loop is
    # unrolled, so every row's load can be in flight at once.
    #
    # Every token of the tile is computed from x alone and stored, but those within W-1 of a
    # sequence start that lies before the tile (that sequence's owner, the program before,
    # writes them). Then the sequences whose first token is in the tile: their first W-1
    # tokens again from the old window (overwriting, after a barrier, what the loop stored),
    # and their windows. Each output is written last by its owner; x is read-only.
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(C, BLOCK_C)
    i_c, i_t = pid % num_blocks, pid // num_blocks     # consecutive programs: the channel blocks of one tile
    t0 = i_t * BLOCK_T
    ch = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = ch < C
    x_chan = x + ch.to(tl.int64) * stride_x_c
    out_chan = out + ch.to(tl.int64) * stride_out_c

    first_owned = _count_below(cu_seqlens, N, t0, BLOCK_N)   # sequences starting before t0
    end = first_owned
    if (first_owned < N) & (tl.load(cu_seqlens + tl.minimum(first_owned, N - 1)) < t0 + BLOCK_T):
        end = _count_below(cu_seqlens, N, t0 + BLOCK_T, BLOCK_N)
    # The latest start before the tile: its first W-1 tokens belong to its owner.
    last_start = tl.load(cu_seqlens + tl.maximum(first_owned - 1, 0)).to(tl.int32)
    skip_below = tl.where(first_owned > 0, tl.maximum(last_start + (W - 1), t0), t0)

    w_taps = ()
    for j in tl.static_range(W):
        w_taps = w_taps + (tl.load(weight + ch * W + j, mask=mask_c, other=0.0),)
    if HAS_BIAS:
        b = tl.load(bias + ch, mask=mask_c, other=0.0)
    rows = ()                                          # the last W-1 rows, oldest first
    for j in tl.static_range(W - 1):
        tap_tok = t0 - (W - 1) + j
        # scalar conditions folded into the channel bound: no block & scalar masks
        rows = rows + (tl.load(x_chan + tap_tok.to(tl.int64) * stride_x_t,
                               mask=ch < tl.where((tap_tok >= 0) & (tap_tok < T), C, 0), other=0.0),)
    for i in tl.static_range(BLOCK_T):
        t = t0 + i
        cur = tl.load(x_chan + t.to(tl.int64) * stride_x_t, mask=ch < tl.where(t < T, C, 0), other=0.0)
        # Taps summed oldest first, then the bias: the order of the one-token conv
        # (triton_math.conv_apply), so chaining causal_conv1d_update gives the same numbers.
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(W - 1):
            acc += w_taps[j] * rows[j].to(tl.float32)
        acc += w_taps[W - 1] * cur.to(tl.float32)
        if HAS_BIAS:
            acc += b
        if SILU:
            acc = silu(acc)
        tl.store(out_chan + t.to(tl.int64) * stride_out_t, acc.to(out.dtype.element_ty),
                 mask=ch < tl.where((t < T) & (t >= skip_below), C, 0))
        shifted = ()
        for j in tl.static_range(1, W - 1):
            shifted = shifted + (rows[j],)
        rows = shifted + (cur,)

    tl.debug_barrier()  # the loop's stores of this tile before the owned sequences' first outputs
    _owned_sequences(x, conv_state, weight, bias, cu_seqlens, slot_indices, has_initial_state, out, errors,
                     first_owned, end, ch, i_c, T, C, num_slots, stride_x_t, stride_x_c, stride_out_t, stride_out_c,
                     stride_conv_slot, stride_conv_chan, stride_conv_tap, W, BLOCK_TAPS, HAS_BIAS, HAS_INIT_FLAGS,
                     SILU, ERR_INDEX)


_causal_conv1d_varlen_rows = CachedKernel(_causal_conv1d_varlen_rows_kernel)


@dataclass(frozen=True)
class Conv1dVarlenConfig:
    """Launch configuration of one call (``conv1d_varlen_config`` picks it from the shapes)."""
    block_t: int            # tokens per tile (a power of two)
    block_c: int            # channels per tile (a power of two)
    num_warps: int = 4
    token_major: bool = False   # programs in token order (the tiles of a channel block in a row)
    form: str = "tile"          # "tile" (each thread a vector of tokens, taps picked from registers) or
    #                             "rows" (a program streams its tokens a row of channels at a time, the
    #                             last W-1 rows in registers: each input row loaded once)

    def __post_init__(self):
        if self.form not in ("tile", "rows"):
            raise ValueError(f"Conv1dVarlenConfig.form must be 'tile' or 'rows' (got {self.form!r}).")


def conv1d_varlen_config(x: torch.Tensor, channels: int) -> Conv1dVarlenConfig:
    """Pinned (no autotune) from x's layout and the channels (H100 sweep,
    results/conv1d_varlen_sweep_h100.log; C = 12288, bf16, 1 x 8192, 8 x 1024, 8 mixed lengths).

    Tokens contiguous (the transposed view): 64 tokens x 64 channels, 4 warps; each thread one
    16-byte vector of 8 tokens, 8 threads one channel's 128-byte line; programs in channel order
    (the tiles in flight are one token block of neighbouring channels): 156.8 / 175.9 / 176.1 µs
    against 198.6 / 176.9 / 178.2 in token order. Channels contiguous: 16 tokens x 1024 channels,
    4 warps side by side along the channels; each thread 8 channels (16 bytes) of the tile's
    tokens; programs in channel order (the tiles in flight read whole rows): 211.1 / 203.2 /
    203.2 µs against 256.2 / 257.1 / 253.1 for 8-token tiles, whose taps reread half the tile."""
    if x.stride(0) == 1 and x.shape[0] > 1:
        return Conv1dVarlenConfig(block_t=64, block_c=min(64, next_power_of_2(channels)), num_warps=4)
    block_c = min(1024, next_power_of_2(channels))
    return Conv1dVarlenConfig(block_t=16, block_c=block_c, num_warps=max(1, min(4, block_c // 256)))


@register("causal_conv1d_varlen", "triton")
def causal_conv1d_varlen_triton(x, conv_state, weight, cu_seqlens, slot_indices, out, *, has_initial_state=None,
                                bias=None, activation=True, config: Conv1dVarlenConfig | None = None):
    """``config`` overrides the pinned choice (``conv1d_varlen_config``; sweeps, tests)."""
    T, C = x.shape
    if T == 0:
        return out
    W = weight.shape[1]
    N = cu_seqlens.numel() - 1
    cfg = config or conv1d_varlen_config(x, C)
    block_t, block_c, num_warps = cfg.block_t, cfg.block_c, cfg.num_warps
    if not (block_t >= 1 and block_t & (block_t - 1) == 0 and block_c >= 1 and block_c & (block_c - 1) == 0):
        raise ValueError(f"block_t={block_t} and block_c={block_c} must be powers of two.")
    if cfg.form == "rows":
        _causal_conv1d_varlen_rows(
            (cdiv(C, block_c) * cdiv(T, block_t), 1, 1),
            (x, conv_state, weight, bias if bias is not None else weight, cu_seqlens, slot_indices,
             has_initial_state if has_initial_state is not None else slot_indices, out, errors.counters(x.device),
             T, C, N, conv_state.shape[0],
             x.stride(0), x.stride(1), out.stride(0), out.stride(1),
             conv_state.stride(0), conv_state.stride(1), conv_state.stride(2)),
            dict(W=W, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_TAPS=next_power_of_2(W - 1), BLOCK_N=256,
                 HAS_BIAS=bias is not None, HAS_INIT_FLAGS=has_initial_state is not None, SILU=bool(activation),
                 ERR_INDEX=errors.INDEX["causal_conv1d_varlen"]),
            num_warps=num_warps, num_stages=1)
        return out
    _causal_conv1d_varlen(
        (cdiv(C, block_c) * cdiv(T, block_t), 1, 1),
        (x, conv_state, weight, bias if bias is not None else weight, cu_seqlens, slot_indices,
         has_initial_state if has_initial_state is not None else slot_indices, out, errors.counters(x.device),
         T, C, N, conv_state.shape[0],
         x.stride(0), x.stride(1), out.stride(0), out.stride(1),
         conv_state.stride(0), conv_state.stride(1), conv_state.stride(2)),
        dict(W=W, BLOCK_T=block_t, BLOCK_C=block_c, VEC=min(8, block_t), BLOCK_TAPS=next_power_of_2(W - 1),
             BLOCK_N=256, TOKEN_MAJOR=cfg.token_major, OUT_TOKENS_INNER=out.stride(0) == 1 and T > 1,
             HAS_BIAS=bias is not None, HAS_INIT_FLAGS=has_initial_state is not None, SILU=bool(activation),
             ERR_INDEX=errors.INDEX["causal_conv1d_varlen"]),
        num_warps=num_warps, num_stages=1)
    return out


@register("causal_conv1d_varlen", "reference")
def causal_conv1d_varlen_reference(x, conv_state, weight, cu_seqlens, slot_indices, out, *,
                                   has_initial_state=None, bias=None, activation=True):
    return reference.causal_conv1d_varlen(x, conv_state, weight, cu_seqlens, slot_indices, out,
                                          has_initial_state=has_initial_state, bias=bias, activation=activation)


@kdakit_op("causal_conv1d_varlen", counts_errors=True, mutates=("conv_state", "out"))
def causal_conv1d_varlen_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                            cu_seqlens: torch.Tensor, slot_indices: torch.Tensor, out: torch.Tensor,
                            has_initial_state: torch.Tensor | None, bias: torch.Tensor | None, activation: bool,
                            backend: str | None) -> None:
    """``activation``: SiLU on (the public entry's ``"silu"``/``"swish"``) or off (``None``)."""
    _, impl = select("causal_conv1d_varlen", x.device, backend)
    impl(x, conv_state, weight, cu_seqlens, slot_indices, out, has_initial_state=has_initial_state, bias=bias,
         activation=activation)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
CONV_ACTIVATIONS = ("silu", "swish", None)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two plain eager tensors share bytes (a conservative span test; False while
    tracing, where fake tensors have no memory)."""
    if torch.compiler.is_compiling() or type(a) is not torch.Tensor or type(b) is not torch.Tensor:
        return False
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        lo = t.storage_offset() * t.element_size()
        hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        return lo, hi
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_causal_conv1d_varlen(x, conv_state, weight, cu_seqlens, slot_indices, out, *, has_initial_state=None,
                               bias=None, activation="silu", full_checks=None) -> int:
    """``x [T, C]`` (any strides), ``conv_state [slots, C, W-1]`` (any non-overlapping strides),
    ``weight [C, W]`` float32, ``cu_seqlens [N+1]``, ``slot_indices [N]``, ``has_initial_state [N]``
    bool, ``bias [C]`` float32, ``out [T, C]`` in x's dtype (any non-overlapping strides, not
    sharing memory with x). Returns W.

    The values of ``cu_seqlens`` (0 first, never decreasing, T last) and the slot range are data:
    reading them is a device sync, so they are checked in full-check mode only (by default a
    slot outside the pool is padding, and the kernel never reads outside the offsets' buffers).
    """
    check_dim("x", x, 2, "[T, C]")
    check_float_dtype("x", x)
    check_same_device(x, conv_state, weight, cu_seqlens, slot_indices, out, has_initial_state, bias)
    T, C = x.shape
    W = check_conv_weight("weight", weight, C)
    check_conv_bias("bias", bias, C)
    check_conv_pool("conv_state", conv_state, C, W)
    if not (cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1):
        raise ValueError(f"`cu_seqlens` must be a 1D tensor of N+1 offsets [0, .., T] (got shape "
                         f"{_shape(cu_seqlens)}).")
    check_index_dtype("cu_seqlens", cu_seqlens)
    N = cu_seqlens.numel() - 1
    if not (T == 0 or N >= 1):
        raise ValueError(f"`cu_seqlens` must hold at least 2 offsets [0, .., T] for T={T} tokens (got shape "
                         f"{_shape(cu_seqlens)}).")
    if not (slot_indices.dim() == 1 and slot_indices.shape[0] == N):
        raise ValueError(f"`slot_indices` must have shape [N] = ({N},), one slot per sequence of `cu_seqlens` "
                         f"(got {_shape(slot_indices)}).")
    check_index_dtype("slot_indices", slot_indices)
    if has_initial_state is not None:
        if not (has_initial_state.dim() == 1 and has_initial_state.shape[0] == N):
            raise ValueError(f"`has_initial_state` must have shape [N] = ({N},), one flag per sequence (got "
                             f"{_shape(has_initial_state)}).")
        if not (has_initial_state.dtype == torch.bool):
            raise ValueError(f"`has_initial_state` must be a bool tensor (got {has_initial_state.dtype}); "
                             "pass has_initial_state.bool().")
    check_shape("out", out, (T, C), "[T, C]")
    if not (out.dtype == x.dtype):
        raise ValueError(f"`out` must have x's dtype {x.dtype}: post-conv values are rounded to the activation "
                         f"dtype (got {out.dtype}).")
    check_non_overlapping("out", out)
    if _overlaps(out, x):
        raise ValueError("`out` shares memory with `x`; the conv of a token reads its neighbours, which other "
                         "programs may already have overwritten, so it cannot run in place: pass a separate `out`.")
    if not (activation in CONV_ACTIVATIONS):
        raise ValueError(f"`activation` must be 'silu', 'swish' or None (got {activation!r}).")
    if full_checks_enabled(full_checks):
        bounds = cu_seqlens.tolist()
        if not (bounds[0] == 0 and all(a <= b for a, b in zip(bounds, bounds[1:])) and bounds[-1] == T):
            raise ValueError(f"`cu_seqlens` must rise from 0 to T={T} without decreasing (got {bounds}).")
        check_slot_values("slot_indices", slot_indices, conv_state.shape[0], full_checks=True)
        check_finite(True, weight=weight, bias=bias)
    return W


def causal_conv1d_varlen(x, conv_state, weight, cu_seqlens, slot_indices, *, has_initial_state=None, bias=None,
                         activation="silu", out=None, backend=None, full_checks=None):
    """Short conv of the tokens of ``N`` sequences; the slots' windows are left after each one's last token.

    ``x [T, C]`` (float32/bfloat16/float16, any strides), ``conv_state [slots, C, W-1]`` (any
    strides, updated in place), ``weight [C, W]`` and ``bias [C]`` float32, ``cu_seqlens [N+1]``
    and ``slot_indices [N]`` int32/int64, ``has_initial_state [N]`` bool (None: every sequence
    starts from its slot's window), ``activation`` ``"silu"`` (or ``"swish"``) or None.
    Returns ``out [T, C]`` in x's dtype (allocated like x when not given; it must not share
    memory with x).
    """
    if out is None:
        out = torch.empty_like(x)
    check_causal_conv1d_varlen(x, conv_state, weight, cu_seqlens, slot_indices, out,
                               has_initial_state=has_initial_state, bias=bias, activation=activation,
                               full_checks=full_checks)
    causal_conv1d_varlen_op(x, conv_state, weight, cu_seqlens, slot_indices, out, has_initial_state, bias,
                            activation is not None, backend)
    return out


@causal_conv1d_varlen_op.register_example
def _example(seed, device="cpu", *, out=True):
    g = example_rng(seed)
    T, C, W, slots = 9, 24, 4, 5
    bf16 = torch.bfloat16
    # x as the transposed [C, T] view engines hold, the pool as sglang's [slots, W-1, C] transposed
    args = (example_randn(g, C, T, dtype=bf16, device=device).t(),
            example_randn(g, slots, W - 1, C, dtype=bf16, device=device).transpose(1, 2),
            example_randn(g, C, W, scale=0.5, device=device), example_index(0, 4, 5, 9, device=device),
            example_index(3, -1, 0, dtype=torch.int64, device=device))
    kw = dict(has_initial_state=torch.tensor([True, True, False], device=device),
              bias=example_randn(g, C, scale=0.1, device=device))
    if out:
        kw["out"] = torch.full((T, C), 7.0, dtype=bf16, device=device)
    return causal_conv1d_varlen, args, kw
