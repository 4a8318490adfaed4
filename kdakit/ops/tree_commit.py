"""Ring commit of an accepted tree path: fold the ring entries of the path's nodes, root
first, into the slot's state in place.

A ring-mode ``tree_verify`` stores node ``t``'s raw inputs at ring position ``t``; the
accepted path (node ids from node 0 to the accepted node, as the engine's acceptance walk
finds them) is replayed with the ring commit's step loader and the verify's tile and device
functions, so the result equals, bit for bit, the snapshot a snapshot-mode tree verify
writes for the accepted node. The conv windows are a snapshot commit of the accepted node
(``commit_snapshots(state, None, ..., accepted_node, conv_states=..., intermediate_conv=...)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import contracts, errors, reference
from ..backends import register, select
from .commit import WIDE_COMMIT_TILE_BYTES, _load_ring_step, check_commit_ring
from .launch import CachedKernel, cdiv, next_power_of_2
from .mtp_verify import recurrence_tile
from .triton_math import count_bad_row, delta_rule_update, l2_normalize, mask_if


@triton.jit
def _path_node(nodes, j, BLOCK_P: tl.constexpr):
    """Entry ``j`` of the path vector ``nodes`` (0 past its end; the load it feeds is masked there)."""
    return tl.sum(tl.where(tl.arange(0, BLOCK_P) == j, nodes, 0), axis=0)


@triton.jit
def _fold_path_steps(S, p_k, p_v, p_g, p_b, nodes, num, mask_k, mask_v, K: tl.constexpr, V: tl.constexpr,
                     BLOCK_P: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """Fold the ring entries of the path's first ``num`` nodes into the tile S, root first:
    ``commit._fold_ring_steps`` (two steps ahead) with ring position ``nodes[j]`` for step ``j``.
    Each node's ring rows load two steps before it folds and its k is normalised while the
    step before folds, so neither the loads nor the norm's reduction sit on the chain of state
    updates (the path's node ids come from registers: no load feeds another). The same loads
    and device functions as the verify, in the same order, so the same bits."""
    k_n, v_n, g_n, beta_n = _load_ring_step(p_k, p_v, p_g, p_b, _path_node(nodes, 0, BLOCK_P), num > 0, mask_k,
                                            mask_v, K, V)
    k_nn, v_nn, g_nn, beta_nn = _load_ring_step(p_k, p_v, p_g, p_b, _path_node(nodes, 1, BLOCK_P), num > 1,
                                                mask_k, mask_v, K, V)
    if USE_QK_L2NORM:
        k_n = l2_normalize(k_n)
    t = 0
    while t < num:  # a loaded bound: `while` runs in the interpreter and compiled alike
        k_t, v_t, g_t, beta_t = k_n, v_n, g_n, beta_n
        k_n, v_n, g_n, beta_n = k_nn, v_nn, g_nn, beta_nn
        k_nn, v_nn, g_nn, beta_nn = _load_ring_step(p_k, p_v, p_g, p_b, _path_node(nodes, t + 2, BLOCK_P),
                                                    t + 2 < num, mask_k, mask_v, K, V)
        S = delta_rule_update(S, k_t, v_t, g_t, beta_t)
        if USE_QK_L2NORM:
            k_n = l2_normalize(k_n)
        t += 1
    return S


@triton.jit
def _commit_tree_ring_kernel(
    state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, errors,
    s_state_slot, s_rk_slot, s_rv_slot, s_rg_slot, s_rb_slot, s_path_n, ring_len, path_len, num_slots,
    null_block_id,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    ERR_INDEX: tl.constexpr,
):
    # One program: BLOCK_V state rows of one (request, value head).
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < V
    slot = tl.load(slot_indices + i_n).to(tl.int64)
    steps = tl.load(accept_lens + i_n).to(tl.int64)
    claimed = (slot > null_block_id) & (slot >= 0)
    in_pool = slot < num_slots
    active = claimed & in_pool & (steps > 0)
    num = tl.where(active, tl.minimum(steps, path_len), 0)
    # The path's nodes as one vector (BLOCK_P >= path_len): every node of it inside the rings,
    # else the request is skipped.
    offs_p = tl.arange(0, BLOCK_P)
    on_path = offs_p < num
    nodes = tl.load(paths + i_n.to(tl.int64) * s_path_n + offs_p, mask=on_path, other=0).to(tl.int64)
    outside = tl.sum((on_path & ((nodes < 0) | (nodes >= ring_len))).to(tl.int32), axis=0)
    active = active & (outside == 0)
    # A claimed slot past the pool, or an accepted path with a node outside the rings: one
    # count per request, by its value head 0, V tile 0 program.
    count_bad_row(errors, (claimed & ~in_pool | (num > 0) & ~active) & (i_v == 0) & (i_hv == 0), ERR_INDEX)
    num = tl.where(active, num, 0).to(tl.int32)
    slot = tl.where(active, slot, 0)
    mask_s = mask_if(mask_v[:, None] & mask_k[None, :], active)
    p_k = ring_k + slot * s_rk_slot + i_h * ring_len * K + offs_k
    p_v = ring_v + slot * s_rv_slot + i_hv * ring_len * V + offs_v
    p_g = ring_g + slot * s_rg_slot + i_hv * ring_len * K + offs_k
    p_b = ring_beta + slot * s_rb_slot + i_hv * ring_len
    s_ptrs = state + slot * s_state_slot + i_hv * V * K + offs_v[:, None] * K + offs_k[None, :]
    S = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    S = _fold_path_steps(S, p_k, p_v, p_g, p_b, nodes, num, mask_k, mask_v, K, V, BLOCK_P, USE_QK_L2NORM)
    tl.store(s_ptrs, S.to(state.dtype.element_ty), mask=mask_s)


_commit_tree_ring = CachedKernel(_commit_tree_ring_kernel)


@dataclass(frozen=True)
class TreeCommitConfig:
    """Launch configuration of one path commit (``tree_commit_config`` picks it). ``block_v``
    state rows on ``num_warps`` warps a program. Each row is reduced over K exactly as the
    verify's one-warp tile reduces it whatever the rows a program holds (its K across one
    warp's lanes, as in the verify), which keeps the commit bitwise the verify's snapshot:
    the benchmark checks that on the GPU for every config it times."""
    block_v: int
    num_warps: int = 1


def tree_commit_config(V: int, K: int) -> TreeCommitConfig:
    """The path commit's pinned config: 8 KB of float32 state rows on one warp, twice the
    verify's tile (16 rows at K = 128; results/tree_verify_hints_h200.json and
    tree_verify_depth_first_h200.json, N = 64 / 256, 8 nodes: 75.0-76.0 / 283.1-285.5 us against
    78.6-81.5 / 300.6-323.5 with the verify's 8 rows; 32 rows were slower, 4 slower still)."""
    block_v, num_warps = recurrence_tile(V, K, WIDE_COMMIT_TILE_BYTES)
    return TreeCommitConfig(block_v=block_v, num_warps=num_warps)


@register("commit_tree_ring", "triton")
def commit_tree_ring_triton(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, *,
                            use_qk_l2norm, null_block_id, config: TreeCommitConfig | None = None):
    """``config`` overrides the pinned choice (``tree_commit_config``; sweeps, tests)."""
    N = slot_indices.shape[0]
    if N == 0:
        return
    _, HV, V, K = state.shape
    H, ring_len = ring_k.shape[1], ring_k.shape[2]
    cfg = config or tree_commit_config(V, K)
    block_v, num_warps = cfg.block_v, cfg.num_warps
    _commit_tree_ring(
        (cdiv(V, block_v), HV, N),
        (state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, errors.counters(state.device),
         state.stride(0),
         ring_k.stride(0), ring_v.stride(0), ring_g.stride(0), ring_beta.stride(0), paths.stride(0), ring_len,
         paths.shape[1], state.shape[0], int(null_block_id)),
        dict(H=H, HV=HV, K=K, V=V, BLOCK_K=next_power_of_2(K), BLOCK_V=block_v,
             BLOCK_P=max(2, next_power_of_2(paths.shape[1])), USE_QK_L2NORM=bool(use_qk_l2norm),
             ERR_INDEX=errors.INDEX["commit_tree_ring"]), num_warps=num_warps, num_stages=1)


@register("commit_tree_ring", "reference")
def commit_tree_ring_reference(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, **kwargs):
    reference.commit_tree_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, **kwargs)


from .registry import example_index, example_rand, example_randn, example_rng, kdakit_op  # noqa: E402


@kdakit_op("commit_tree_ring", counts_errors=True, mutates=("state",))
def commit_tree_ring_op(state: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, ring_g: torch.Tensor,
                        ring_beta: torch.Tensor, slot_indices: torch.Tensor, paths: torch.Tensor,
                        accept_lens: torch.Tensor, use_qk_l2norm: bool, null_block_id: int,
                        backend: str | None) -> None:
    _, impl = select("commit_tree_ring", state.device, backend)
    impl(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, use_qk_l2norm=use_qk_l2norm,
         null_block_id=null_block_id)


def commit_tree_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, *,
                     use_qk_l2norm=True, null_block_id=-1, backend=None, full_checks=None):
    """Fold the accepted path of request ``n`` (``paths[n, :accept_lens[n]]``: node ids, node
    0 first, each node's parent before it) from the rings of a ring-mode ``tree_verify`` into
    ``state[slot_indices[n]]``. Rings as ``commit_ring`` takes them (one layer). Rows with
    slot ``<= null_block_id`` (or outside the pool), ``accept_lens <= 0`` or a path node
    outside the rings are skipped (nothing read or written; full-check mode raises). A
    claimed slot past the pool, or an accepted path with a node outside the rings, is counted
    once per request (``kdakit.take_errors``)."""
    check_commit_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, None, None,
                      full_checks=False)
    if state.dim() != 4:
        raise ValueError(f"`state` must be [slots, HV, V, K] (got shape {tuple(state.shape)}).")
    N = slot_indices.shape[0]
    if paths.dim() != 2 or paths.shape[0] != N or paths.stride(1) != 1:
        raise ValueError(f"`paths` must be [N={N}, P] node ids, contiguous in the last dim "
                       f"(got shape {tuple(paths.shape)}).")
    contracts.check_index_dtype("paths", paths)
    contracts.check_same_device(state, paths)
    if contracts.full_checks_enabled(full_checks):
        contracts.check_slot_values("slot_indices", slot_indices, state.shape[0], full_checks=True)
        L = ring_k.shape[2]
        for n in range(N):
            steps = int(accept_lens[n])
            if int(slot_indices[n]) < 0 or steps <= 0:
                continue
            if steps > paths.shape[1]:
                raise ValueError(f"`accept_lens` holds {steps} for request {n}, longer than its path ({paths.shape[1]}).")
            nodes = paths[n, :steps]
            if bool(((nodes < 0) | (nodes >= L)).any()):
                raise ValueError(f"`paths` holds node ids {nodes.tolist()} for request {n}, outside the rings (L={L}).")
    commit_tree_ring_op(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, use_qk_l2norm,
                        null_block_id, backend)


@commit_tree_ring_op.register_example
def _example(seed, device="cpu"):
    """Accepted paths of 3, 2 and 1 nodes, and a padding row."""
    g = example_rng(seed)
    H, HV, K, V, slots, L = 1, 2, 8, 16, 6, 5
    bf16 = torch.bfloat16
    args = (example_randn(g, slots, HV, V, K, scale=0.5, device=device),
            example_randn(g, slots, H, L, K, dtype=bf16, device=device),
            example_randn(g, slots, HV, L, V, dtype=bf16, device=device), -example_rand(g, slots, HV, L, K, device=device),
            example_rand(g, slots, HV, L, device=device), example_index(4, -1, 1, 2, device=device),
            torch.tensor([[0, 1, 3, -1], [0, 2, 4, -1], [0, 2, -1, -1], [0, -1, -1, -1]], dtype=torch.int32,
                         device=device), example_index(3, 4, 2, 1, device=device))
    return commit_tree_ring, args, dict(null_block_id=-1)
