"""Tree verify: speculative trees (EAGLE top-k > 1), snapshot and ring modes.

Request ``n`` brings ``T`` nodes; node ``t`` has parent ``p = parents[n, t]``. Node 0 starts
from the committed state ``state[slot]`` and conv windows whatever ``parents[n, 0]``
holds; node ``t > 0`` from the post-state and windows of node ``p`` when ``0 <= p < t``,
from the committed ones when ``p = -1``. An invalid parent (``p >= t`` or ``p < -1``) is a
ValueError in full-check mode and is treated as ``p = -1`` otherwise (never an unwritten
snapshot), and counted (``kdakit.take_errors``, once per such node of a live request). Each
node applies its own token with the one-token math; its post-state goes to
``snapshots[row, t]`` and its windows to ``intermediate_conv[i][row, t]``
(``row = scratch_indices[n]``). Committing accepted node ``a`` is ``commit_snapshots`` with
``a`` as the accepted step.

The recurrence kernel walks the nodes in order, one program per (request, value head, V
tile) with the chain verify's tile (``mtp_verify.recurrence_tile``) and its step loader, so
a tree whose parents form a chain computes exactly what ``mtp_verify`` computes: while
``p == t - 1`` the state stays in registers; otherwise the program reloads its own tile of
node ``p``'s snapshot (or of the committed state), after a barrier that makes its threads'
snapshot stores visible. The short conv runs first as its own kernel (``tree_conv.py``).

Ring mode (``rings=``, no snapshots) stores node ``t``'s raw inputs at ring position ``t`` of
the slot, and ``commit_tree_ring`` (``tree_commit.py``) folds the accepted path into the slot.
Its outputs come, as the chain verify's do (``mtp_verify.ring_form``), from the chunk form
(``ring_verify.py`` with the pairs masked to each node's ancestors: one read of the state
for all nodes) beyond a few requests and up to ``MAX_TREE_NODES`` nodes, the same numbers
up to float32 rounding; otherwise from the recurrence here, where a node whose parent is
not the node before it refolds the parent's path from the committed tile and the inputs,
so its outputs equal snapshot mode's bit for bit. The ring entries are the same bits
either way, and so is every commit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import contracts, errors, reference
from ..backends import register, select
from .gated_rmsnorm import gated_rmsnorm_after
from .launch import CachedKernel, cdiv, next_power_of_2, pdl_available
from .mtp_verify import VerifyConfig, _load_step, check_mtp_verify, recurrence_tile, ring_form, unroll_steps
from .ring_verify import MAX_TREE_NODES, ring_verify, ring_verify_config
from .tree_conv import count_invalid_parents, load_tree_parents, tree_conv, tree_parent
from .triton_math import count_bad_rows, delta_rule_update, l2_normalize, mask_if


@triton.jit
def _refold_path(S, s_ptrs, mask_s, par, p, x_q, x_k, x_v, a, b, n64, i_hv, ch_qk, ch_v, offs_k, mask_k,
                 mask_v, bias, A_log_h, lower_bound, T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, SAFE_GATE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Node p's post-state tile (the committed tile for p = -1): the committed tile with the
    nodes of p's path folded in, root first. Parent look-ups run in registers
    (``load_tree_parents``): node i of the path (depth i) is p's ancestor depth(p) - 1 - i steps up."""
    depth = 0
    node = p
    while node >= 0:
        depth += 1
        node = tree_parent(par, node, BLOCK_T)
    S = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    i = 0
    while i < depth:
        node = p
        j = 0
        while j < depth - 1 - i:
            node = tree_parent(par, node, BLOCK_T)
            j += 1
        _, k_i, v_i, g_i, beta_i = _load_step(x_q, x_k, x_v, a, b, node, n64, i_hv, ch_qk, ch_v, offs_k, mask_k,
                                              mask_v, bias, A_log_h, lower_bound, T, H, HV, K, V, SAFE_GATE)
        S = delta_rule_update(S, l2_normalize(k_i), v_i, g_i, beta_i)
        i += 1
    return S


@triton.jit
def _node_start(S, t, par, s_ptrs, state_h, snap_h, tile, mask_s, s_snap_t, x_q, x_k, x_v, a, b, n64, i_hv, ch_qk,
                ch_v, offs_k, mask_k, mask_v, bias, A_log_h, lower_bound, T: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SAFE_GATE: tl.constexpr,
                BLOCK_T: tl.constexpr, RING: tl.constexpr):
    """Node t's starting tile (t > 0): the registers' tile when its parent is node t - 1."""
    p = tree_parent(par, t, BLOCK_T)  # an invalid parent starts from the committed state
    if p != t - 1:
        if RING:
            S = _refold_path(S, s_ptrs, mask_s, par, p, x_q, x_k, x_v, a, b, n64, i_hv, ch_qk, ch_v, offs_k, mask_k,
                             mask_v, bias, A_log_h, lower_bound, T, H, HV, K, V, SAFE_GATE, BLOCK_T)
        elif p < 0:
            S = tl.load(state_h + tile, mask=mask_s, other=0.0).to(tl.float32)
        else:  # stored by this program, behind the barrier after each snapshot store
            S = tl.load(snap_h + p * s_snap_t + tile, mask=mask_s, other=0.0).to(tl.float32)
    return S


@triton.jit
def _node_step(S, cur, t, live, slot, n64, i_h, i_hv, i_v, offs_k, offs_v, mask_v, mask_s, mask_v_live, mask_k_head,
               mask_k_key_head, tile, snap_h, s_snap_t, out, snapshots, ring_k, ring_v, ring_g, ring_beta, s_rk_slot,
               s_rv_slot, s_rg_slot, s_rb_slot, ring_len, scale, T: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, RING: tl.constexpr):
    """Node t from its starting tile: its ring entries, the update, its output row and snapshot."""
    q_t, k_t, v_t, g_t, beta_t = cur
    if RING:  # the raw per-node inputs of the commit's replay
        tl.store(ring_k + slot * s_rk_slot + (i_h * ring_len + t) * K + offs_k, k_t.to(ring_k.dtype.element_ty),
                 mask=mask_k_key_head)
        tl.store(ring_v + slot * s_rv_slot + (i_hv * ring_len + t) * V + offs_v,
                 v_t.to(ring_v.dtype.element_ty), mask=mask_v_live)
        tl.store(ring_g + slot * s_rg_slot + (i_hv * ring_len + t) * K + offs_k,
                 g_t.to(ring_g.dtype.element_ty), mask=mask_k_head)
        tl.store(ring_beta + slot * s_rb_slot + i_hv * ring_len + t, beta_t.to(ring_beta.dtype.element_ty),
                 mask=live & (i_v == 0))
    q_hat = l2_normalize(q_t) * scale
    S = delta_rule_update(S, l2_normalize(k_t), v_t, g_t, beta_t)
    o = tl.where(live, tl.sum(S * q_hat[None, :], axis=1), 0.0)
    tl.store(out + ((n64 * T + t) * HV + i_hv) * V + offs_v, o.to(out.dtype.element_ty), mask=mask_v)
    if not RING:
        tl.store(snap_h + t * s_snap_t + tile, S.to(snapshots.dtype.element_ty), mask=mask_s)
    return S


@triton.jit
def _tree_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out, snapshots,
    ring_k, ring_v, ring_g, ring_beta, errors,
    stride_state_slot, s_snap_row, s_snap_t, s_rk_slot, s_rv_slot, s_rg_slot, s_rb_slot, ring_len,
    num_slots, num_rows, scale, lower_bound,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, SAFE_GATE: tl.constexpr,
    RING: tl.constexpr,
    WAIT_FOR_TOKENS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, ERR_INDEX: tl.constexpr,
    UNROLL_STEPS: tl.constexpr, PREFETCH_PARENT: tl.constexpr,
):
    # One program: BLOCK_V state rows of one (request, value head), through the T nodes.
    # RING (no snapshots): a node whose parent is not the previous node starts again from
    # the committed tile and refolds its parent's path from the inputs (the same loads and
    # device functions in the same order, so the same bits as had it stayed in registers);
    # node t's raw inputs go to ring position t, one writer per datum as in mtp_verify.
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if LAUNCH_DEPENDENTS:  # the output norm may start loading its gate now
        gdc_launch_dependents()
    G: tl.constexpr = HV // H
    i_h = i_hv // G
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < V
    slot = tl.load(slot_indices + i_n).to(tl.int64)
    row = tl.load(scratch_indices + i_n).to(tl.int64)
    # padding rows (a slot or scratch row outside its buffer): zero output, nothing else read or written
    live = (slot >= 0) & (slot < num_slots) & (row >= 0) & (row < num_rows)
    # Counted by the request's value head 0, V tile 0 program (the conv prologue counts
    # nothing): a claimed slot (>= 0) whose slot or row is outside its buffer, once; for a
    # live request, each node whose parent is invalid (treated as p = -1).
    if ERR_INDEX >= 0:
        if (i_v == 0) & (i_hv == 0):
            n_bad = ((slot >= 0) & ~live).to(tl.int32)
            if live:
                n_bad = count_invalid_parents(parents + i_n.to(tl.int64) * T, T, BLOCK_T)
            count_bad_rows(errors, n_bad, ERR_INDEX)
    slot = tl.where(live, slot, 0)
    row = tl.where(live, row, 0)
    # The scalars as selects (mask_if: Triton 3.9 rejects block & scalar masks), as the chain
    # verify writes them: with K and V whole tiles the state's mask folds to one predicate, where
    # a bound compare (offs_v < where(live, V, 0)) kept a predicate a row (16 more registers).
    mask_s = mask_if(mask_v[:, None] & mask_k[None, :], live)
    mask_v_live = mask_if(mask_v, live)
    mask_k_head = mask_if(mask_k, live & (i_v == 0))                      # g, β: V tile 0 of the head
    mask_k_key_head = mask_if(mask_k, live & (i_v == 0) & (i_hv % G == 0))  # k: the group's first head
    # Pointers as scalar bases plus the tile's int32 offsets, each pointer block formed where it
    # is used: [BLOCK_V, BLOCK_K] blocks of 64-bit pointers kept across the node loop (one to
    # reload the committed tile, one for the snapshots) held 2 registers an element each.
    tile = offs_v[:, None] * K + offs_k[None, :]
    state_h = state + slot * stride_state_slot + i_hv * V * K   # this head's committed [V, K] block
    snap_h = snapshots + row * s_snap_row + i_hv * V * K        # its node-0 snapshot block
    s_ptrs = state_h + tile
    S = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)

    n64 = i_n.to(tl.int64)
    x_q = q + n64 * T * H * K                     # this request's node 0, channel 0
    x_k = k + n64 * T * H * K
    x_v = v + n64 * T * HV * V
    ch_qk = i_h * K + offs_k
    ch_v = i_hv * V + offs_v
    bias = tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    A_log_h = tl.load(A_log + i_hv).to(tl.float32)
    par = load_tree_parents(parents + n64 * T, T, BLOCK_T)  # once: every look-up after it in registers
    if WAIT_FOR_TOKENS:
        gdc_wait()

    nxt = _load_step(x_q, x_k, x_v, a, b, 0, n64, i_hv, ch_qk, ch_v, offs_k, mask_k, mask_v, bias, A_log_h,
                     lower_bound, T, H, HV, K, V, SAFE_GATE)
    if UNROLL_STEPS:
        for t in tl.static_range(T):
            cur = nxt
            # Node t's starting tile first, then the next node's inputs (in this order the
            # unrolled loop holds 96 registers, not 128: ptxas, sm_90, K = V = 128).
            if t > 0:
                S = _node_start(S, t, par, s_ptrs, state_h, snap_h, tile, mask_s, s_snap_t, x_q, x_k, x_v, a, b, n64,
                                i_hv, ch_qk, ch_v, offs_k, mask_k, mask_v, bias, A_log_h, lower_bound, T, H, HV, K,
                                V, SAFE_GATE, BLOCK_T, RING)
            if t + 1 < T:
                nxt = _load_step(x_q, x_k, x_v, a, b, t + 1, n64, i_hv, ch_qk, ch_v, offs_k, mask_k, mask_v, bias,
                                 A_log_h, lower_bound, T, H, HV, K, V, SAFE_GATE)
            S = _node_step(S, cur, t, live, slot, n64, i_h, i_hv, i_v, offs_k, offs_v, mask_v, mask_s, mask_v_live,
                           mask_k_head, mask_k_key_head, tile, snap_h, s_snap_t, out, snapshots, ring_k, ring_v,
                           ring_g, ring_beta, s_rk_slot, s_rv_slot, s_rg_slot, s_rb_slot, ring_len, scale, T, HV,
                           K, V, RING)
            if not RING:
                if t + 1 < T:
                    # A later node may reload this snapshot, and another thread of the program may
                    # have stored elements that one reloads. After every store rather than before each
                    # reload: a barrier inside the reload branch held 128 registers instead of 96.
                    tl.debug_barrier()
    else:
        # Many nodes as a loop: unrolled, the code of 16 nodes outgrows the instruction cache.
        # The last node loads node T - 1's inputs again rather than branch. PREFETCH_PARENT
        # (snapshot mode): node t + 1's starting tile, when its parent is not node t, is the
        # committed tile or a snapshot stored behind an earlier barrier, so it loads while node
        # t computes (one more tile in registers: 128 against 80 at K = V = 128).
        PREFETCH: tl.constexpr = PREFETCH_PARENT and not RING
        start = S
        for t in range(T):
            cur = nxt
            if t > 0:
                if PREFETCH:
                    if tree_parent(par, t, BLOCK_T) != t - 1:
                        S = start
                else:
                    S = _node_start(S, t, par, s_ptrs, state_h, snap_h, tile, mask_s, s_snap_t, x_q, x_k, x_v, a, b,
                                    n64, i_hv, ch_qk, ch_v, offs_k, mask_k, mask_v, bias, A_log_h, lower_bound, T, H,
                                    HV, K, V, SAFE_GATE, BLOCK_T, RING)
            if PREFETCH:
                p_next = tree_parent(par, tl.minimum(t + 1, T - 1), BLOCK_T)
                if (t + 1 < T) & (p_next != t):
                    if p_next < 0:
                        start = tl.load(state_h + tile, mask=mask_s, other=0.0).to(tl.float32)
                    else:
                        start = tl.load(snap_h + p_next * s_snap_t + tile, mask=mask_s, other=0.0).to(tl.float32)
            nxt = _load_step(x_q, x_k, x_v, a, b, tl.minimum(t + 1, T - 1), n64, i_hv, ch_qk, ch_v, offs_k, mask_k,
                             mask_v, bias, A_log_h, lower_bound, T, H, HV, K, V, SAFE_GATE)
            S = _node_step(S, cur, t, live, slot, n64, i_h, i_hv, i_v, offs_k, offs_v, mask_v, mask_s, mask_v_live,
                           mask_k_head, mask_k_key_head, tile, snap_h, s_snap_t, out, snapshots, ring_k, ring_v,
                           ring_g, ring_beta, s_rk_slot, s_rv_slot, s_rg_slot, s_rb_slot, ring_len, scale, T, HV,
                           K, V, RING)
            if not RING:
                tl.debug_barrier()  # node t's snapshot visible to every thread before a later load of it


_tree_verify = CachedKernel(_tree_verify_kernel)


def _num_rows(snapshots, intermediate_conv) -> int:
    """Scratch rows every per-request buffer holds: a row at or past it is padding (None: no
    per-request scratch, ring mode without the conv)."""
    rows = ([snapshots.shape[0]] if snapshots is not None else []) + [ic.shape[0] for ic in (intermediate_conv or ())]
    return min(rows) if rows else None


def tree_verify_config(N: int, T: int, HV: int, V: int, K: int, lower_bound) -> VerifyConfig:
    """The tree verify's pinned config: the chain verify's recurrence tile and ring forms
    (its ``conv`` unused: the tree conv's is ``tree_conv.TreeConvConfig``)."""
    block_v, num_warps = recurrence_tile(V, K)
    unrolled = unroll_steps(T, TREE_UNROLL_NODES_MAX)
    return VerifyConfig(block_v=block_v, num_warps=num_warps, ring_form=ring_form(N, HV, T),
                        ring=ring_verify_config(T, lower_bound, tree=True), unroll_steps=unrolled,
                        prefetch_parent=not unrolled)


# A tree's node loop is unrolled up to this many nodes; beyond, a loop that loads each node's
# parent tile a node early (docs/tuning.md, section "tree_verify": at 8 and 16 nodes the loop with
# the prefetch runs 1.01-1.04x the chain verify for top-2 trees, 1.02-1.15x for random ones).
TREE_UNROLL_NODES_MAX = 4


@register("tree_verify", "triton")
def tree_verify_triton(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out, *,
                       conv_weights, conv_states, intermediate_conv, conv_bias, snapshots, scale, lower_bound,
                       norm_gate, norm_weight, norm_eps, rings=None, config: VerifyConfig | None = None):
    """``config`` overrides the pinned choice (``tree_verify_config``; sweeps, tests)."""
    N, T, H, K = q.shape
    HV, V = v.shape[-2:]
    if N == 0:
        return out
    cfg = config or tree_verify_config(N, T, HV, V, K, lower_bound)
    pdl = pdl_available(q.device)
    num_rows = _num_rows(snapshots, intermediate_conv if conv_weights is not None else None)
    rows_in = scratch_indices
    if num_rows is None:  # ring mode without the conv: no per-request scratch, the rows are not looked at
        rows_in, num_rows = slot_indices, state.shape[0]
    dummy = state  # never dereferenced: the constexpr RING compiles the other mode's uses away
    ring_k, ring_v, ring_g, ring_beta = rings if rings is not None else (dummy,) * 4
    ring = rings is not None
    conv = conv_weights is not None
    if conv:  # its own kernel first; the recurrence reads the post-conv tokens
        q, k, v = tree_conv(q, k, v, conv_weights, conv_bias, conv_states, intermediate_conv, slot_indices,
                            scratch_indices, parents, num_rows=num_rows, launch_dependents=pdl)
    norm = norm_weight is not None
    raw_out = torch.empty(out.shape, dtype=torch.float32, device=out.device) if norm else out
    if ring and T <= MAX_TREE_NODES and cfg.ring_form == "chunked":
        # Every node's output from one read of the state (ring_verify.py, ancestor-masked),
        # where the recurrence would refold each off-chain node's path tile by tile.
        ring_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, rows_in, (state.shape[0], num_rows),
                    raw_out, rings, scale=scale, lower_bound=lower_bound, wait_for_tokens=conv,
                    launch_dependents=norm, pdl=pdl, parents=parents, config=cfg.ring)
    else:
        block_v, num_warps = cfg.block_v, cfg.num_warps
        _tree_verify(
            (cdiv(V, block_v), HV, N),
            (q, k, v, a, b, A_log, dt_bias, state, slot_indices, rows_in, parents, raw_out,
             snapshots if not ring else dummy, ring_k, ring_v, ring_g, ring_beta, errors.counters(q.device),
             state.stride(0), *((0, 0) if ring else (snapshots.stride(0), snapshots.stride(1))),
             *((ring_k.stride(0), ring_v.stride(0), ring_g.stride(0), ring_beta.stride(0), ring_k.shape[2]) if ring
               else (0,) * 5), state.shape[0], num_rows, float(scale),
             float(lower_bound) if lower_bound is not None else 0.0),
            dict(T=T, H=H, HV=HV, K=K, V=V, BLOCK_K=next_power_of_2(K), BLOCK_V=block_v,
                 BLOCK_T=next_power_of_2(T), SAFE_GATE=lower_bound is not None, RING=ring, WAIT_FOR_TOKENS=conv and pdl,
                 LAUNCH_DEPENDENTS=norm and pdl, ERR_INDEX=errors.INDEX["tree_verify"],
                 UNROLL_STEPS=bool(cfg.unroll_steps), PREFETCH_PARENT=bool(cfg.prefetch_parent)),
            num_warps=num_warps, num_stages=1, launch_pdl=conv and pdl)
    if norm:  # padding rows stay zero: their raw output is zero, and so is its norm
        gated_rmsnorm_after(raw_out, norm_gate, norm_weight, out, eps=norm_eps, wait_for_x=pdl)
    return out


@register("tree_verify", "reference")
def tree_verify_reference(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out,
                          **kwargs):
    return reference.tree_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out,
                                 **kwargs)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
def check_tree_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out, *,
                      conv_weights, conv_states, intermediate_conv, conv_bias, snapshots, lower_bound, norm_gate,
                      norm_weight, rings=None, full_checks=None):
    """The chain verify's checks, then ``parents``; raises before anything runs."""
    if (snapshots is None) == (rings is None):
        raise ValueError("a tree verify needs `snapshots` ([scratch, >=T, HV, V, K]: every node's post-state, which "
                       "commit_snapshots of the accepted node copies) or `rings` (ring mode, commit_tree_ring), "
                       f"exactly one of them (got {'neither' if snapshots is None else 'both'}).")
    check_mtp_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out,
                     conv_weights=conv_weights, conv_states=conv_states, intermediate_conv=intermediate_conv,
                     conv_bias=conv_bias, snapshots=snapshots, rings=rings, lower_bound=lower_bound,
                     norm_gate=norm_gate, norm_weight=norm_weight, full_checks=full_checks)
    N, T = q.shape[:2]
    if parents.dim() != 2 or tuple(parents.shape) != (N, T) or not parents.is_contiguous():
        raise ValueError(f"`parents` must be a contiguous [N, T] = {(N, T)} tensor of parent node ids "
                       f"(got shape {tuple(parents.shape)}).")
    contracts.check_index_dtype("parents", parents)
    contracts.check_same_device(q, parents)
    if contracts.full_checks_enabled(full_checks) and T > 1:
        live = slot_indices >= 0
        p = parents[live, 1:].long()
        t = torch.arange(1, T, device=p.device)
        bad = (p < -1) | (p >= t)
        if bool(bad.any()):
            n, i = (int(x) for x in torch.nonzero(bad)[0])
            n = int(torch.nonzero(live).flatten()[n])
            raise ValueError(f"`parents` holds an invalid parent {int(parents[n, i + 1])} for node {i + 1} of request "
                           f"{n}: a node's parent must be -1 (the committed state) or an earlier node (0 <= p < t).")


from .mtp_verify import optional_tuple, verify_example_inputs, verify_schema_args  # noqa: E402
from .registry import example_rng, kdakit_op  # noqa: E402


def run_tree_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out, conv_weights,
                    conv_states, intermediate_conv, conv_bias, snapshots, rings, scale, lower_bound, norm_gate,
                    norm_weight, norm_eps, backend):
    """Dispatch after validation, the tuples as the public entry takes them."""
    _, impl = select("tree_verify", q.device, backend)
    impl(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out,
         conv_weights=conv_weights, conv_states=conv_states, intermediate_conv=intermediate_conv,
         conv_bias=conv_bias, snapshots=snapshots, rings=rings, scale=scale, lower_bound=lower_bound,
         norm_gate=norm_gate, norm_weight=norm_weight, norm_eps=norm_eps)


@kdakit_op("tree_verify", mutates=("out", "ic_q", "ic_k", "ic_v", "snapshots", "ring_k", "ring_v", "ring_g",
                                   "ring_beta"), counts_errors=True, dispatch=run_tree_verify,
           flatten=verify_schema_args(12))
def tree_verify_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slot_indices: torch.Tensor,
                   scratch_indices: torch.Tensor, parents: torch.Tensor, out: torch.Tensor,
                   w_q: torch.Tensor | None, w_k: torch.Tensor | None, w_v: torch.Tensor | None,
                   cs_q: torch.Tensor | None, cs_k: torch.Tensor | None, cs_v: torch.Tensor | None,
                   ic_q: torch.Tensor | None, ic_k: torch.Tensor | None, ic_v: torch.Tensor | None,
                   bias_q: torch.Tensor | None, bias_k: torch.Tensor | None, bias_v: torch.Tensor | None,
                   snapshots: torch.Tensor | None, ring_k: torch.Tensor | None, ring_v: torch.Tensor | None,
                   ring_g: torch.Tensor | None, ring_beta: torch.Tensor | None, scale: float,
                   lower_bound: float | None, norm_gate: torch.Tensor | None, norm_weight: torch.Tensor | None,
                   norm_eps: float, backend: str | None) -> None:
    """The tensors as ``mtp_verify``'s (``mtp_verify_tensors``), then the same scalars."""
    run_tree_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out,
                    optional_tuple(w_q, w_k, w_v), optional_tuple(cs_q, cs_k, cs_v), optional_tuple(ic_q, ic_k, ic_v),
                    optional_tuple(bias_q, bias_k, bias_v), snapshots,
                    optional_tuple(ring_k, ring_v, ring_g, ring_beta), scale, lower_bound, norm_gate, norm_weight,
                    norm_eps, backend)


def tree_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out=None, *,
                conv_weights=None, conv_states=None, intermediate_conv=None, conv_bias=None, snapshots=None,
                norm_gate=None, norm_weight=None, norm_eps=1e-6, scale=None, lower_bound=None, full_checks=None,
                backend=None, rings=None):
    """Verify a tree of ``T`` nodes per request without touching the persistent pools.

    Layouts of ``mtp_verify``: ``q, k [N, T, H, K]``, ``v [N, T, HV, V]`` (pre-conv when
    ``conv_weights=(w_q, w_k, w_v)`` is given), ``a [N, T, HV, K]``, ``b [N, T, HV]``,
    ``state [slots, HV, V, K]`` read-only, ``snapshots [scratch, >=T, HV, V, K]`` or, in ring
    mode, ``rings=(ring_k, ring_v, ring_g, ring_beta)`` (``mtp_verify``'s ring layouts; node
    ``t`` at ring position ``t``; commit with ``commit_tree_ring``),
    ``intermediate_conv[i] [scratch, >=T, C_i, W-1]``; ``parents [N, T]`` int32/int64 (node
    0's entry is ignored; -1: the committed state). Node ``t``'s post-state goes to
    ``snapshots[scratch_indices[n], t]``. A slot or scratch row outside its buffer is a
    padding row (zero output, nothing read or written; counted once per request, and so is
    each invalid parent of a live request, ``kdakit.take_errors``). Returns ``out [N, T, HV, V]``.
    """
    if out is None and q.dim() == 4 and v.dim() == 4:
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    check_tree_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out,
                      conv_weights=conv_weights, conv_states=conv_states, intermediate_conv=intermediate_conv,
                      conv_bias=conv_bias, snapshots=snapshots, lower_bound=lower_bound, norm_gate=norm_gate,
                      norm_weight=norm_weight, rings=rings, full_checks=full_checks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tree_verify_op(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out, conv_weights,
                   conv_states, intermediate_conv, conv_bias, snapshots, rings, scale, lower_bound, norm_gate,
                   norm_weight, norm_eps, backend)
    return out


@tree_verify_op.register_example
def _example(seed, device="cpu", *, mode="snapshot"):
    """A 4-node tree per request (node 0, two children, a grandchild), the conv prologue; ``mode``:
    ``"snapshot"`` (conv bias too) or ``"ring"`` (the output norm too)."""
    T = 4
    args, kw = verify_example_inputs(example_rng(seed), T, T, mode, device)
    args += (torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 2]], dtype=torch.int32, device=device),)
    kw["out"] = torch.full((3, T, 2, 16), 7.0, dtype=torch.bfloat16, device=device)
    return tree_verify, args, kw
