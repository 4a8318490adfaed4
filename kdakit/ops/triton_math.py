"""The math of one KDA token as Triton device functions, shared by every kernel.

Every kernel calls these same functions in the same order, so two kernels that
compute the same step (a snapshot verify and a ring commit, say) round alike.
"""
import triton
import triton.language as tl


@triton.jit
def mask_if(mask, flag):
    """``mask & flag`` for a block ``mask`` and a scalar ``flag``. Written as a select: Triton
    3.9's interpreter rejects a block & scalar mask, and the compiler folds this to the same
    ``and``."""
    return tl.where(flag, mask, False)


@triton.jit
def verify_request(slot_indices, scratch_indices, i_n, num_slots, num_rows, CHECK_ROWS: tl.constexpr):
    """Request ``i_n``'s slot and scratch row, and whether it is live: slot in ``[0, num_slots)``
    and, with CHECK_ROWS (the call writes a scratch buffer), row in ``[0, num_rows)``. Every
    kernel of a verify decides it so; without CHECK_ROWS the row is not even loaded (0)."""
    slot = tl.load(slot_indices + i_n).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)
    if CHECK_ROWS:
        row = tl.load(scratch_indices + i_n).to(tl.int64)
        live = live & (row >= 0) & (row < num_rows)
    else:
        row = slot * 0
    return slot, row, live


@triton.jit
def count_bad_row(errors, bad, ERR_INDEX: tl.constexpr):
    """One count on counter ``ERR_INDEX`` of ``errors`` (kdakit/errors.py) where ``bad``, a row
    whose index fell outside its buffer; the atomic runs only for such a row. A negative
    ERR_INDEX counts nothing (another kernel of the op counts)."""
    if ERR_INDEX >= 0:
        if bad:
            tl.atomic_add(errors + ERR_INDEX, 1, sem="relaxed")


@triton.jit
def count_bad_rows(errors, n, ERR_INDEX: tl.constexpr):
    """``n`` (a scalar count of bad rows or entries) added to counter ``ERR_INDEX``; the atomic
    runs only where ``n > 0``. A negative ERR_INDEX counts nothing."""
    if ERR_INDEX >= 0:
        if n > 0:
            tl.atomic_add(errors + ERR_INDEX, n, sem="relaxed")


@triton.jit
def softplus(x):
    # The threshold keeps exp() finite; above it softplus(x) == x in float32.
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def kda_log_decay(a, dt_bias, A_log_h, lower_bound, SAFE_GATE: tl.constexpr):
    """Log-decay g per key channel from the raw gate ``a`` (float32 vectors)."""
    x = a + dt_bias
    A = tl.exp(A_log_h)
    if SAFE_GATE:
        g = lower_bound * tl.sigmoid(A * x)
    else:
        g = -A * softplus(x)
    return g


@triton.jit
def l2_normalize(x):
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def delta_rule_update(S, k, v, g, beta):
    """S [BLOCK_V, BLOCK_K] rows of a V-major state; k, g [BLOCK_K]; v [BLOCK_V]; beta scalar."""
    S = S * tl.exp(g)[None, :]
    u = beta * (v - tl.sum(S * k[None, :], axis=1))
    return S + u[:, None] * k[None, :]


@triton.jit
def gated_rmsnorm_rows(o, gate, weight, eps, V: tl.constexpr):
    """o, gate, weight [BLOCK_V] (a full row of V, masked lanes zero)."""
    inv_rms = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / V + eps)
    return o * inv_rms * weight * tl.sigmoid(gate)


@triton.jit
def gated_rmsnorm_tile(o, gate, weight, eps, V: tl.constexpr):
    """o, gate [ROWS, BLOCK_V] (full rows of V, masked lanes zero), weight [BLOCK_V]."""
    inv_rms = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / V + eps)
    return o * inv_rms[:, None] * weight[None, :] * tl.sigmoid(gate)


@triton.jit
def silu(x):
    """``x · sigmoid(x)`` for every conv kernel (one form, so that their chains stay bitwise):
    ``x / (1 + e^-x)`` with the approximate division (a reciprocal and a product, within 2 ulp
    of the rounded quotient, far below the bf16 rounding of the outputs); ``tl.sigmoid``'s
    IEEE division is most of the conv's instructions."""
    return tl.fdiv(x, 1.0 + tl.exp(-x), ieee_rounding=False)


@triton.jit
def conv_inputs(x_ptrs, win_ptrs, w_ptrs, bias_ptrs, stride_tap, mask, live,
                W: tl.constexpr, BLOCK_TAPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The loads of one token of the causal short conv for a block of channels, apart from
    its arithmetic (``conv_apply``), so a kernel can issue them early.

    ``x_ptrs``: the token's inputs; ``win_ptrs``: tap 0 (oldest) of each channel's window,
    taps ``stride_tap`` apart; ``w_ptrs``: each channel's row of a contiguous ``[C, W]``
    float32 weight; ``bias_ptrs`` read only with ``HAS_BIAS``; ``mask``: channel lanes;
    ``live``: scalar, False for padding rows (no window access). Returns the input, the
    old window, the weights of the window taps, the weight of the input, and the bias.
    """
    taps = tl.arange(0, BLOCK_TAPS)
    tap_mask = mask[:, None] & (taps[None, :] < W - 1)
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    win = tl.load(win_ptrs[:, None] + taps[None, :] * stride_tap, mask=mask_if(tap_mask, live), other=0.0)
    w_taps = tl.load(w_ptrs[:, None] + taps[None, :], mask=tap_mask, other=0.0)
    w_x = tl.load(w_ptrs + (W - 1), mask=mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptrs, mask=mask, other=0.0)
    else:
        bias = tl.zeros_like(w_x)
    return x, win, w_taps, w_x, bias


@triton.jit
def conv_apply(x, win, w_taps, w_x, bias, W: tl.constexpr, BLOCK_TAPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The conv with SiLU from ``conv_inputs``' loads, in float32, rounded to the input dtype
    exactly as an unfused conv stores it."""
    taps = tl.arange(0, BLOCK_TAPS)
    winf = win.to(tl.float32)
    # Taps are summed oldest first in a fixed order (each tap and weight picked out exactly:
    # one value plus zeros), so every kernel that calls this rounds the same whatever tile
    # layout the compiler picks.
    acc = tl.zeros_like(x.to(tl.float32))
    for j in tl.static_range(W - 1):
        tap = tl.sum(tl.where(taps[None, :] == j, winf, 0.0), axis=1)
        acc += tl.sum(tl.where(taps[None, :] == j, w_taps, 0.0), axis=1) * tap
    acc += w_x * x.to(tl.float32)
    if HAS_BIAS:
        acc += bias
    return silu(acc).to(x.dtype).to(tl.float32)


@triton.jit
def short_conv(x_ptrs, win_ptrs, w_ptrs, bias_ptrs, stride_tap, mask, live,
               W: tl.constexpr, BLOCK_TAPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One token of the causal short conv with SiLU (``conv_inputs`` then ``conv_apply``);
    reads only. Returns the post-conv values in float32 and the old window and the input,
    which ``shift_window`` stores."""
    x, win, w_taps, w_x, bias = conv_inputs(x_ptrs, win_ptrs, w_ptrs, bias_ptrs, stride_tap, mask, live,
                                            W, BLOCK_TAPS, HAS_BIAS)
    return conv_apply(x, win, w_taps, w_x, bias, W, BLOCK_TAPS, HAS_BIAS), win, x


@triton.jit
def shift_window(win_ptrs, win, x, stride_tap, mask, store_mask, W: tl.constexpr, BLOCK_TAPS: tl.constexpr):
    """Store the window shifted by one token (``win``, ``x`` from ``short_conv``) where ``store_mask``."""
    taps = tl.arange(0, BLOCK_TAPS)
    win_mask = mask_if(mask, store_mask)[:, None] & (taps[None, :] < W - 1)
    tl.store(win_ptrs[:, None] + (taps[None, :] - 1) * stride_tap, win, mask=win_mask & (taps[None, :] >= 1))
    tl.store(win_ptrs + (W - 2) * stride_tap, x.to(win_ptrs.dtype.element_ty), mask=mask_if(mask, store_mask))


@triton.jit
def short_conv_update(x_ptrs, win_ptrs, w_ptrs, bias_ptrs, stride_tap, mask, live,
                      W: tl.constexpr, BLOCK_TAPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``short_conv`` with the window shifted in place (channels this program alone owns)."""
    y, win, x = short_conv(x_ptrs, win_ptrs, w_ptrs, bias_ptrs, stride_tap, mask, live, W, BLOCK_TAPS, HAS_BIAS)
    # A window tap may be held by several threads (replicated layouts); every thread must
    # have read the old window before any thread writes the shifted one.
    tl.debug_barrier()
    shift_window(win_ptrs, win, x, stride_tap, mask, live, W, BLOCK_TAPS)
    return y
