"""The short conv of a tree verify, once per channel: the prologue before the recurrence.

Node ``t``'s window is its parent's window after the parent, shifted by one with the
parent's input appended: the last ``W-1`` inputs on the path from the root to the parent,
preceded by the committed window where the path is shorter. So tap ``j`` of node ``t``'s
conv is the input of its ``(W-1-j)``-th ancestor, or a tap of the committed window where
the path runs out: in the numbering of the chain prologue's sequence [committed window,
x_0, x_1, ...], a position ``W-1-j`` parent hops up from ``t``'s own (``tree_tap_position``:
a gathered load of the parents row a hop, for all nodes at once; along a chain, ``t + j``).
The kernel is the chain prologue's (``verify_conv.py``) with those positions: every node's
taps loaded as [nodes, channels] tiles, summed oldest first, so it rounds exactly like the
chain prologue and the unfused conv, and needs no window written by another node.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .launch import CachedKernel, cdiv, next_power_of_2
from .triton_math import mask_if, silu, verify_request
from .verify_conv import _conv_inputs, window_runs


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
def _effective_parent(parents_n, node, T: tl.constexpr):
    """The effective parents of ``node`` (a block of node ids, each in ``[0, T)`` or past T):
    -1 for node 0, for ``p = -1``, for an invalid ``p`` (``p >= node``, ``p < -1``) and past T,
    as ``load_tree_parents`` maps them. One gathered load of the request's parents row."""
    has = (node > 0) & (node < T)
    p = tl.load(parents_n + tl.where(has, node, 0), mask=has, other=-1).to(tl.int32)
    return tl.where(has & (p >= -1) & (p < node), p, -1)


@triton.jit
def tree_tap_position(parents_n, pos, hops: tl.constexpr, T: tl.constexpr, W: tl.constexpr):
    """``hops`` steps up a node's path in the numbering of the chain prologue's sequence
    [committed window (W-1), x_0, x_1, ...] (``verify_conv._conv_inputs``): from position
    ``W-1+a`` (node ``a``'s input) to its parent's input (``W-2``, the window's newest tap, for
    a root), from a window position to the one before it. Starting from node ``t``'s input
    (``W-1+t``), ``W-1-j`` hops give tap ``j`` of its conv; along a chain, ``t+j`` as there."""
    for _ in tl.static_range(hops):
        node = pos - (W - 1)
        pos = tl.where(node >= 0, W - 1 + _effective_parent(parents_n, node, T), pos - 1)
    return pos


@triton.jit
def _tree_conv_silu_steps(x, stride_x_t, window, stride_win_c, stride_win_w, weight, bias, ch, mask, live, dst,
                          stride_dst_t, parents_n, t0, T: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr,
                          HAS_BIAS: tl.constexpr, WINDOW_RUNS: tl.constexpr):
    """``verify_conv._conv_silu_steps`` with each node's taps at its path's positions
    (``tree_tap_position``): [BLOCK_T, channels] SiLU(conv) of every node at once, taps summed
    oldest first, the same loads and sums (so a chain-shaped tree rounds as the chain does).
    Nodes t0 .. t0 + BLOCK_T. Without WINDOW_RUNS, taps 1 .. W-1 of node t are stored as
    they are read: its window."""
    nodes = t0 + tl.arange(0, BLOCK_T)[:, None]
    pos0 = W - 1 + nodes  # tap W-1: the node's own input
    acc = tl.zeros_like(nodes.to(tl.float32) + ch[None, :].to(tl.float32))
    for j in tl.static_range(W):
        w = tl.load(weight + ch * W + j, mask=mask, other=0.0)
        pos = tree_tap_position(parents_n, pos0, W - 1 - j, T, W)
        tap = _conv_inputs(x, stride_x_t, window, stride_win_c, stride_win_w, ch, mask, live, pos, T, W)
        acc += w[None, :] * tap
        if not WINDOW_RUNS and j >= 1:
            tl.store(dst + nodes * stride_dst_t + ch[None, :] * (W - 1) + (j - 1), tap.to(dst.dtype.element_ty),
                     mask=(nodes < T) & mask_if(mask, live)[None, :])
    if HAS_BIAS:
        acc += tl.load(bias + ch, mask=mask, other=0.0)[None, :]
    return silu(acc)


@triton.jit
def _tree_store_windows(x, stride_x_t, window, stride_win_c, stride_win_w, c0, C, live, dst, stride_dst_t,
                        parents_n, t0, T: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_F: tl.constexpr):
    """``verify_conv._store_windows`` on the tree's positions: the windows after each node of
    channels c0 .. c0 + BLOCK_C as the contiguous runs they are in ``dst``; flat element f is
    window tap f % (W-1) of channel f // (W-1), conv tap 1 + f % (W-1) of the node."""
    nodes = t0 + tl.arange(0, BLOCK_T)[:, None]
    pos0 = W - 1 + nodes
    f = tl.arange(0, BLOCK_F)
    c = c0 + f // (W - 1)
    valid = (f < BLOCK_C * (W - 1)) & (c < C)
    tap = (1 + f % (W - 1))[None, :]
    src = tl.where(tap == W - 1, pos0, 0)
    for j in tl.static_range(1, W - 1):
        src = tl.where(tap == j, tree_tap_position(parents_n, pos0, W - 1 - j, T, W), src)
    vals = _conv_inputs(x, stride_x_t, window, stride_win_c, stride_win_w, c, valid, live, src, T, W)
    tl.store(dst + nodes * stride_dst_t + c0 * (W - 1) + f[None, :], vals.to(dst.dtype.element_ty),
             mask=(nodes < T) & mask_if(valid, live)[None, :])


@triton.jit
def _tree_conv_part(x, window, weight, bias, inter, post, parents_n, s_win_slot, s_win_c, s_win_w, s_inter_row,
                    s_inter_t, slot, row, live, n64, i_c, C: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, HAS_BIAS: tl.constexpr,
                    WINDOW_RUNS: tl.constexpr):
    ch = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < C
    x_n = x + n64 * T * C                      # this request's node 0, channel 0
    win = window + slot * s_win_slot
    # Blocks of BLOCK_T nodes in turn: every node's taps come from the parents row and the
    # inputs, never from another node's results, so a block's tiles need not hold every node
    # (16 nodes in one [16, 64] tile spilled: 255 registers, 254 B of spills; as two blocks of 8,
    # 225 registers and none: ptxas, sm_90, H = 32, K = V = 128).
    for t0 in tl.static_range(0, T, BLOCK_T):
        y = _tree_conv_silu_steps(x_n, C, win, s_win_c, s_win_w, weight, bias, ch, mask, live,
                                  inter + row * s_inter_row, s_inter_t, parents_n, t0, T, W, BLOCK_T, HAS_BIAS,
                                  WINDOW_RUNS)
        nodes = t0 + tl.arange(0, BLOCK_T)
        tl.store(post + (n64 * T + nodes[:, None]) * C + ch[None, :], y.to(post.dtype.element_ty),
                 mask=(nodes < T)[:, None] & mask[None, :])
        if WINDOW_RUNS:
            _tree_store_windows(x_n, C, win, s_win_c, s_win_w, i_c * BLOCK_C, C, live, inter + row * s_inter_row,
                                s_inter_t, parents_n, t0, T, W, BLOCK_T, BLOCK_C, BLOCK_F)


@triton.jit
def _tree_conv_kernel(
    x_q, x_k, x_v, w_q, w_k, w_v, bias_q, bias_k, bias_v, cs_q, cs_k, cs_v, ic_q, ic_k, ic_v, post_q, post_k, post_v,
    slot_indices, scratch_indices, parents,
    s_csq_slot, s_csq_c, s_csq_w, s_csk_slot, s_csk_c, s_csk_w, s_csv_slot, s_csv_c, s_csv_w,
    s_icq_row, s_icq_t, s_ick_row, s_ick_t, s_icv_row, s_icv_t, num_slots, num_rows,
    C_QK: tl.constexpr, C_V: tl.constexpr, T: tl.constexpr, W: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, HAS_BIAS: tl.constexpr,
    WINDOW_RUNS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):
    # One program: BLOCK_C channels of q, k or v (program_id 2) of one request, every node,
    # as the chain prologue's program (verify_conv.py) with each tap's positions following
    # the node's path. A padding row (slot or scratch row outside its buffer) reads no window
    # and writes none; its post-conv values are never used (the recurrence writes zeros for it).
    i_c, i_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if LAUNCH_DEPENDENTS:  # the recurrence may start loading its state tiles now
        gdc_launch_dependents()
    slot, row, live = verify_request(slot_indices, scratch_indices, i_n, num_slots, num_rows, True)
    n64 = i_n.to(tl.int64)
    parents_n = parents + n64 * T
    if part == 0:
        _tree_conv_part(x_q, cs_q, w_q, bias_q, ic_q, post_q, parents_n, s_csq_slot, s_csq_c, s_csq_w, s_icq_row,
                        s_icq_t, slot, row, live, n64, i_c, C_QK, T, W, BLOCK_T, BLOCK_C, BLOCK_F, HAS_BIAS,
                        WINDOW_RUNS)
    elif part == 1:
        _tree_conv_part(x_k, cs_k, w_k, bias_k, ic_k, post_k, parents_n, s_csk_slot, s_csk_c, s_csk_w, s_ick_row,
                        s_ick_t, slot, row, live, n64, i_c, C_QK, T, W, BLOCK_T, BLOCK_C, BLOCK_F, HAS_BIAS,
                        WINDOW_RUNS)
    else:
        _tree_conv_part(x_v, cs_v, w_v, bias_v, ic_v, post_v, parents_n, s_csv_slot, s_csv_c, s_csv_w, s_icv_row,
                        s_icv_t, slot, row, live, n64, i_c, C_V, T, W, BLOCK_T, BLOCK_C, BLOCK_F, HAS_BIAS,
                        WINDOW_RUNS)


_tree_conv = CachedKernel(_tree_conv_kernel)

@dataclass(frozen=True)
class TreeConvConfig:
    """Launch configuration of the tree conv: the chain prologue's (``VerifyConvConfig``:
    channels per program, warps, windows stored as runs or tap by tap; not tuned for trees).
    ``window_runs=None``: as the chain prologue picks it for the node count (``window_runs``).
    ``block_t``: nodes a tile (a power of 2), blocks of them in turn."""
    block_c: int = 64
    num_warps: int = 2
    window_runs: bool | None = None
    block_t: int = 8


def _constexprs(C_QK, C_V, T, W, cfg, has_bias, launch_dependents):
    runs = window_runs(T) if cfg.window_runs is None else bool(cfg.window_runs)
    return dict(C_QK=C_QK, C_V=C_V, T=T, W=W, BLOCK_T=min(next_power_of_2(T), cfg.block_t), BLOCK_C=cfg.block_c,
                BLOCK_F=next_power_of_2(cfg.block_c * (W - 1)), HAS_BIAS=has_bias, WINDOW_RUNS=runs,
                LAUNCH_DEPENDENTS=bool(launch_dependents))


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
        _constexprs(H * K, HV * V, T, W, cfg, conv_bias is not None, launch_dependents),
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
        _constexprs(C, C, T, W, cfg, bias is not None, False),
        num_warps=cfg.num_warps, num_stages=1)
    return post
