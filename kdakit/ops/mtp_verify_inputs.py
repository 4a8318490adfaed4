"""Per-step inputs of a verify, prepared for several steps at once: the fused short conv
over [persistent window, tokens], the windows after each step, and exact row picking."""
import triton
import triton.language as tl


@triton.jit
def row_of(tile, t, BLOCK_ROWS: tl.constexpr):
    """Row ``t`` of a [BLOCK_ROWS, X] tile, exactly (the other rows contribute +0.0)."""
    rows = tl.arange(0, BLOCK_ROWS)
    return tl.sum(tl.where(rows[:, None] == t, tile, 0.0), axis=0)


@triton.jit
def _conv_inputs(x, stride_x_t, window, stride_win_c, stride_win_w, ch, mask, live, pos, T, W: tl.constexpr):
    """Positions ``pos`` ([BLOCK_T, 1]) of the sequence [persistent window (W-1), x_0, x_1, ...]."""
    in_window = pos < W - 1
    from_window = tl.load(window + ch[None, :] * stride_win_c + pos * stride_win_w,
                          mask=in_window & (mask & live)[None, :], other=0.0)
    x_pos = pos - (W - 1)
    from_x = tl.load(x + x_pos * stride_x_t + ch[None, :], mask=(x_pos >= 0) & (x_pos < T) & mask[None, :],
                     other=0.0)
    return tl.where(in_window, from_window, from_x).to(tl.float32)


@triton.jit
def conv_silu_steps(x, stride_x_t, window, stride_win_c, stride_win_w, weight, bias, ch, mask, live,
                     t0, T, W: tl.constexpr, BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr):
    """[BLOCK_T, channels] SiLU(conv) of steps t0 .. t0+BLOCK_T-1 at once, all loads in flight
    together, taps summed oldest first as the unfused conv kernel sums them
    (triton_math.short_conv)."""
    pos = t0 + tl.arange(0, BLOCK_T)[:, None]
    acc = tl.zeros_like(pos.to(tl.float32) + ch[None, :].to(tl.float32))
    for j in tl.static_range(W):
        w = tl.load(weight + ch * W + j, mask=mask, other=0.0)
        acc += w[None, :] * _conv_inputs(x, stride_x_t, window, stride_win_c, stride_win_w, ch, mask, live,
                                         pos + j, T, W)
    if HAS_BIAS:
        acc += tl.load(bias + ch, mask=mask, other=0.0)[None, :]
    return acc * tl.sigmoid(acc)


@triton.jit
def store_windows(dst, stride_dst_t, x, stride_x_t, window, stride_win_c, stride_win_w, ch, mask, live,
                   store_mask, t0, T, W: tl.constexpr, BLOCK_T: tl.constexpr):
    """The window after each step t of the chunk (positions t+1 .. t+W-1), into contiguous
    [C, W-1] blocks."""
    pos = t0 + tl.arange(0, BLOCK_T)[:, None]
    for p in tl.static_range(W - 1):
        val = _conv_inputs(x, stride_x_t, window, stride_win_c, stride_win_w, ch, mask, live, pos + 1 + p, T, W)
        tl.store(dst + pos * stride_dst_t + ch[None, :] * (W - 1) + p, val.to(dst.dtype.element_ty),
                 mask=(pos < T) & (store_mask & mask)[None, :])
