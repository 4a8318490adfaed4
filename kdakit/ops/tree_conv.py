"""The short conv of a tree verify, once per channel: the prologue before the recurrence.

Node ``t``'s window is its parent's window after the parent, shifted by one with the
parent's input appended: the last ``W-1`` inputs on the path from the root to the parent,
preceded by the committed window where the path is shorter. The kernel gathers each
node's window straight from its ancestors' inputs (``W-1`` parent look-ups a node, in registers), so it
needs no window written by another node, and rounds exactly like the chain prologue
(``verify_conv.py``) and the unfused conv (``triton_math.conv_apply``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .launch import CachedKernel, cdiv, next_power_of_2
from .triton_math import conv_apply, shift_window


@triton.jit
def load_tree_parents(parents_n, T: tl.constexpr, BLOCK_T: tl.constexpr):
    """A request's effective parents as a [BLOCK_T] int64 vector, loaded once (the ancestor
    walks then run in registers, not as chains of dependent loads): -1 (the committed state)
    for node 0, for ``p = -1``, for an invalid ``p`` (``p >= t``, ``p < -1``) and past T."""
    nodes = tl.arange(0, BLOCK_T)
    p = tl.load(parents_n + nodes, mask=nodes < T, other=-1).to(tl.int64)
    return tl.where((nodes > 0) & (nodes < T) & (p >= -1) & (p < nodes), p, -1)


@triton.jit
def count_invalid_parents(parents_n, T: tl.constexpr, BLOCK_T: tl.constexpr):
    """How many nodes ``t`` in ``1 .. T-1`` of a request have an invalid parent (``p >= t`` or
    ``p < -1``), an int32 scalar (the counting program's side: ``load_tree_parents`` maps them to -1)."""
    nodes = tl.arange(0, BLOCK_T)
    p = tl.load(parents_n + nodes, mask=nodes < T, other=-1).to(tl.int64)
    bad = (nodes > 0) & (nodes < T) & ((p < -1) | (p >= nodes))
    return tl.sum(bad.to(tl.int32), axis=0)


@triton.jit
def tree_parent(par, node, BLOCK_T: tl.constexpr):
    """The effective parent of ``node`` (-1 for node -1) from ``load_tree_parents``' vector."""
    nodes = tl.arange(0, BLOCK_T)
    return tl.max(tl.where(nodes == node, par, -1), axis=0)


@triton.jit
def _tree_conv_part(x, window, weight, bias, inter, post, par, s_win_slot, s_win_c, s_win_w, s_inter_row,
                    s_inter_t, slot, row, live, n64, i_c, C: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_TAPS: tl.constexpr, BLOCK_T: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    ch = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < C
    mask_live = ch < tl.where(live, C, 0)  # the scalar folded into the bound (Triton 3.9 masks)
    taps = tl.arange(0, BLOCK_TAPS)
    tap_ok = taps < W - 1
    x_n = x + n64 * T * C                      # this request's node 0, channel 0
    win = window + slot * s_win_slot + ch[:, None] * s_win_c
    w_taps = tl.load(weight + ch[:, None] * W + taps[None, :], mask=mask[:, None] & tap_ok[None, :], other=0.0)
    w_x = tl.load(weight + ch * W + (W - 1), mask=mask, other=0.0)
    if HAS_BIAS:
        b = tl.load(bias + ch, mask=mask, other=0.0)
    else:
        b = tl.zeros_like(w_x)
    for t in tl.static_range(T):
        # Tap W-2-i of node t's window (oldest first) is the input of its (i+1)-th ancestor;
        # past the root's start, tap j is position j + depth of the committed window.
        src = tl.full([BLOCK_TAPS], -1, tl.int64)
        node = tl.full([], t, tl.int64)
        depth = tl.full([], 0, tl.int64)
        for i in tl.static_range(W - 1):
            node = tree_parent(par, node, BLOCK_T)
            src = tl.where(taps == W - 2 - i, node, src)
            depth += (node >= 0).to(tl.int64)
        from_node = src >= 0
        xs = tl.load(x_n + tl.maximum(src, 0)[None, :] * C + ch[:, None],
                     mask=mask[:, None] & (from_node & tap_ok)[None, :], other=0.0)
        ws = tl.load(win + tl.minimum(taps + depth, W - 2)[None, :] * s_win_w,
                     mask=mask_live[:, None] & ((~from_node) & tap_ok)[None, :], other=0.0)
        pre = tl.where(from_node[None, :], xs, ws.to(xs.dtype))
        x_t = tl.load(x_n + t * C + ch, mask=mask, other=0.0)
        y = conv_apply(x_t, pre, w_taps, w_x, b, W, BLOCK_TAPS, HAS_BIAS)
        tl.store(post + (n64 * T + t) * C + ch, y.to(post.dtype.element_ty), mask=mask)
        shift_window(inter + row * s_inter_row + t * s_inter_t + ch * (W - 1), pre, x_t, 1, mask_live, mask_live,
                     W, BLOCK_TAPS)


@triton.jit
def _tree_conv_kernel(
    x_q, x_k, x_v, w_q, w_k, w_v, bias_q, bias_k, bias_v, cs_q, cs_k, cs_v, ic_q, ic_k, ic_v, post_q, post_k, post_v,
    slot_indices, scratch_indices, parents,
    s_csq_slot, s_csq_c, s_csq_w, s_csk_slot, s_csk_c, s_csk_w, s_csv_slot, s_csv_c, s_csv_w,
    s_icq_row, s_icq_t, s_ick_row, s_ick_t, s_icv_row, s_icv_t, num_slots, num_rows,
    C_QK: tl.constexpr, C_V: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_TAPS: tl.constexpr, BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    # One program: BLOCK_C channels of q, k or v (program_id 2) of one request, every node.
    # A padding row (slot or scratch row outside its buffer) reads no window and writes
    # none; its post-conv values are never used (the recurrence writes zeros for it).
    i_c, i_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if LAUNCH_DEPENDENTS:  # the recurrence may start loading its state tiles now
        gdc_launch_dependents()
    slot = tl.load(slot_indices + i_n).to(tl.int64)
    row = tl.load(scratch_indices + i_n).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots) & (row >= 0) & (row < num_rows)
    slot = tl.where(live, slot, 0)  # no address outside the buffers is even formed
    row = tl.where(live, row, 0)
    n64 = i_n.to(tl.int64)
    par = load_tree_parents(parents + n64 * T, T, BLOCK_T)
    if part == 0:
        _tree_conv_part(x_q, cs_q, w_q, bias_q, ic_q, post_q, par, s_csq_slot, s_csq_c, s_csq_w, s_icq_row,
                        s_icq_t, slot, row, live, n64, i_c, C_QK, T, W, BLOCK_C, BLOCK_TAPS, BLOCK_T, HAS_BIAS)
    elif part == 1:
        _tree_conv_part(x_k, cs_k, w_k, bias_k, ic_k, post_k, par, s_csk_slot, s_csk_c, s_csk_w, s_ick_row,
                        s_ick_t, slot, row, live, n64, i_c, C_QK, T, W, BLOCK_C, BLOCK_TAPS, BLOCK_T, HAS_BIAS)
    else:
        _tree_conv_part(x_v, cs_v, w_v, bias_v, ic_v, post_v, par, s_csv_slot, s_csv_c, s_csv_w, s_icv_row,
                        s_icv_t, slot, row, live, n64, i_c, C_V, T, W, BLOCK_C, BLOCK_TAPS, BLOCK_T, HAS_BIAS)


_tree_conv = CachedKernel(_tree_conv_kernel)

@dataclass(frozen=True)
class TreeConvConfig:
    """Launch configuration of the tree conv: channels per program and warps (the chain
    prologue's tile, ``VerifyConvConfig``; not tuned for trees)."""
    block_c: int = 64
    num_warps: int = 2


def tree_conv(q, k, v, conv_weights, conv_bias, conv_states, intermediate_conv, slot_indices, scratch_indices,
              parents, *, num_rows, launch_dependents=False, config: TreeConvConfig | None = None):
    """Post-conv ``(q, k, v)`` of every node (new tensors shaped like the inputs); the windows
    after each node go to ``intermediate_conv[i][scratch_indices[n], t]``. Requests whose slot
    is outside ``[0, slots)`` or scratch row outside ``[0, num_rows)`` are padding. ``config``
    (default ``TreeConvConfig()``): the launch configuration."""
    cfg = config or TreeConvConfig()
    N, T, H, K = q.shape
    HV, V = v.shape[2:]
    post = tuple(torch.empty_like(t) for t in (q, k, v))
    bias = conv_bias if conv_bias is not None else conv_weights
    W = conv_weights[0].shape[1]
    _tree_conv(
        (cdiv(max(H * K, HV * V), cfg.block_c), N, 3),
        (q, k, v, *conv_weights, *bias, *conv_states, *intermediate_conv, *post, slot_indices, scratch_indices,
         parents, *(cs.stride(d) for cs in conv_states for d in (0, 1, 2)),
         *(ic.stride(d) for ic in intermediate_conv for d in (0, 1)), conv_states[0].shape[0], int(num_rows)),
        dict(C_QK=H * K, C_V=HV * V, T=T, W=W, BLOCK_C=cfg.block_c, BLOCK_TAPS=next_power_of_2(W - 1),
             BLOCK_T=next_power_of_2(T), HAS_BIAS=conv_bias is not None, LAUNCH_DEPENDENTS=bool(launch_dependents)),
        num_warps=cfg.num_warps, num_stages=1)
    return post


def tree_conv_channels(x, conv_state, weight, bias, intermediate, slot_indices, scratch_indices, parents, *,
                       num_rows, config: TreeConvConfig | None = None):
    """The tree conv of one group of channels: ``x [N, T, C]`` contiguous pre-conv inputs,
    ``conv_state [slots, C, W-1]`` (read only), ``weight [C, W]`` float32, ``intermediate
    [scratch, >=T, C, W-1]`` (contiguous inner dims). Returns the post-conv ``[N, T, C]``."""
    cfg = config or TreeConvConfig()
    N, T, C = x.shape
    post = torch.empty_like(x)
    parents = parents.contiguous()  # the kernel reads row n at n * T
    W = weight.shape[1]
    strides = (conv_state.stride(0), conv_state.stride(1), conv_state.stride(2))
    _tree_conv(
        (cdiv(C, cfg.block_c), N, 1),  # part 0 only: the q slot of the kernel carries the group
        (x, x, x, weight, weight, weight, *((bias,) * 3 if bias is not None else (weight,) * 3),
         conv_state, conv_state, conv_state, intermediate, intermediate, intermediate, post, post, post,
         slot_indices, scratch_indices, parents, *strides * 3,
         *((intermediate.stride(0), intermediate.stride(1)) * 3), conv_state.shape[0], int(num_rows)),
        dict(C_QK=C, C_V=C, T=T, W=W, BLOCK_C=cfg.block_c, BLOCK_TAPS=next_power_of_2(W - 1),
             BLOCK_T=next_power_of_2(T), HAS_BIAS=bias is not None, LAUNCH_DEPENDENTS=False),
        num_warps=cfg.num_warps, num_stages=1)
    return post
