"""Commit of accepted speculative tokens into the persistent pools.

``commit_snapshots``: copy the accepted step's snapshot (and conv windows) into
the slot. ``commit_ring``: replay the accepted prefix from the rings into the
slot's state in place (one read and one write of each committed state), with an
optional track slot that receives the state after step ``track_steps[n]``. A
state pool with a leading layer dimension commits every layer in one launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import contracts, errors, reference
from ..backends import register, select
from .launch import CachedKernel, cdiv, next_power_of_2
from .mtp_verify import RECURRENCE_TILE_BYTES, recurrence_tile
from .registry import example_index, example_pool, example_rand, example_randn, example_rng, kdakit_op
from .triton_math import count_bad_row, delta_rule_update, l2_normalize, mask_if


@triton.jit
def _load_ring_step(p_k, p_v, p_g, p_b, t, live, mask_k, mask_v, K: tl.constexpr, V: tl.constexpr):
    """Ring position t (float32): raw k, v, log-decay g, β; zeros where not ``live``."""
    k_t = tl.load(p_k + t * K, mask=mask_if(mask_k, live), other=0.0).to(tl.float32)
    v_t = tl.load(p_v + t * V, mask=mask_if(mask_v, live), other=0.0).to(tl.float32)
    g_t = tl.load(p_g + t * K, mask=mask_if(mask_k, live), other=0.0).to(tl.float32)
    beta_t = tl.load(p_b + t, mask=live, other=0.0).to(tl.float32)
    return k_t, v_t, g_t, beta_t


@triton.jit
def _fold_ring_steps(S, p_k, p_v, p_g, p_b, num_steps, mask_k, mask_v, track_ptrs, track_mask, track_step,
                     K: tl.constexpr, V: tl.constexpr, USE_QK_L2NORM: tl.constexpr, TRACK: tl.constexpr,
                     STEPS_AHEAD: tl.constexpr):
    """Fold ``num_steps`` ring steps into the tile S. Each step's ring rows are loaded
    STEPS_AHEAD (1 or 2) steps before it folds, and its k normalised while the step before
    folds: the loads' latency and the norm's reduction stay off the chain of state updates.
    The rows are 1-D exactly as the verify kernel reads its inputs (the same register
    layout of k, so its L2 norm rounds alike and the replayed state equals the verify's
    snapshot bitwise)."""
    k_n, v_n, g_n, beta_n = _load_ring_step(p_k, p_v, p_g, p_b, 0, num_steps > 0, mask_k, mask_v, K, V)
    if STEPS_AHEAD == 2:
        k_nn, v_nn, g_nn, beta_nn = _load_ring_step(p_k, p_v, p_g, p_b, 1, num_steps > 1, mask_k, mask_v, K, V)
    if USE_QK_L2NORM:
        k_n = l2_normalize(k_n)
    t = 0
    while t < num_steps:  # a loaded bound: `while` runs in the interpreter and compiled alike
        k_t, v_t, g_t, beta_t = k_n, v_n, g_n, beta_n
        if STEPS_AHEAD == 2:
            k_n, v_n, g_n, beta_n = k_nn, v_nn, g_nn, beta_nn
            k_nn, v_nn, g_nn, beta_nn = _load_ring_step(p_k, p_v, p_g, p_b, t + 2, t + 2 < num_steps, mask_k,
                                                        mask_v, K, V)
        else:
            k_n, v_n, g_n, beta_n = _load_ring_step(p_k, p_v, p_g, p_b, t + 1, t + 1 < num_steps, mask_k, mask_v,
                                                    K, V)
        S = delta_rule_update(S, k_t, v_t, g_t, beta_t)
        if TRACK:
            tl.store(track_ptrs, S.to(track_ptrs.dtype.element_ty), mask=mask_if(track_mask, t == track_step))
        if USE_QK_L2NORM:
            k_n = l2_normalize(k_n)
        t += 1
    return S


@triton.jit
def _commit_ring_kernel(
    state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, track_slots, track_steps, errors,
    s_state_layer, s_state_slot, s_rk_layer, s_rk_slot, s_rv_layer, s_rv_slot, s_rg_layer, s_rg_slot,
    s_rb_layer, s_rb_slot, ring_len, null_block_id, num_slots,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, TILES: tl.constexpr, STEPS_AHEAD: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, TRACK: tl.constexpr, ERR_INDEX: tl.constexpr,
):
    # Same tile shape and the same device functions as the verify kernel, so the
    # replayed state rounds exactly like the verify's snapshot of the same step. A program
    # folds TILES tiles of one head in turn, the next tile's state in flight while this
    # one folds (a tile's fold is a chain of dependent reductions: without the next load
    # in flight the program moves no bytes while it folds).
    i_v, i_layer_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    layer = (i_layer_hv // HV).to(tl.int64)
    i_hv = i_layer_hv % HV
    i_h = i_hv // (HV // H)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    slot = tl.load(slot_indices + i_n).to(tl.int64)
    steps = tl.load(accept_lens + i_n).to(tl.int32)
    claimed = (slot > null_block_id) & (slot >= 0)
    in_pool = slot < num_slots
    head = state + layer * s_state_layer + i_hv * V * K
    if TRACK:
        track_slot = tl.load(track_slots + i_n).to(tl.int64)
        track_step = tl.load(track_steps + i_n).to(tl.int32)
        track_live = (track_slot > null_block_id) & (track_slot >= 0)
        in_pool = in_pool & (~track_live | (track_slot < num_slots))
    else:
        track_slot, track_step, track_live = slot, steps, claimed & (slot < 0)  # never stores
    # A slot or track slot past the pool: the row is not committed at all (nothing half-written).
    active = claimed & in_pool & (steps > 0)
    num_steps = tl.minimum(tl.where(active, steps, 0), ring_len)  # never past the ring, even unchecked
    p_k = ring_k + layer * s_rk_layer + slot * s_rk_slot + i_h * ring_len * K + offs_k
    p_g = ring_g + layer * s_rg_layer + slot * s_rg_slot + i_hv * ring_len * K + offs_k
    p_b = ring_beta + layer * s_rb_layer + slot * s_rb_slot + i_hv * ring_len
    p_v_head = ring_v + layer * s_rv_layer + slot * s_rv_slot + i_hv * ring_len * V

    offs_v = i_v * TILES * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_s = mask_if((offs_v < V)[:, None] & mask_k[None, :], active)
    S_next = tl.load(head + slot * s_state_slot + offs_v[:, None] * K + offs_k[None, :], mask=mask_s, other=0.0)
    for j in tl.static_range(TILES):
        offs_v = (i_v * TILES + j) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        mask_s = mask_if(mask_v[:, None] & mask_k[None, :], active)
        tile = offs_v[:, None] * K + offs_k[None, :]
        S = S_next.to(tl.float32)
        if j + 1 < TILES:
            offs_next = offs_v + BLOCK_V
            S_next = tl.load(head + slot * s_state_slot + offs_next[:, None] * K + offs_k[None, :],
                             mask=mask_if((offs_next < V)[:, None] & mask_k[None, :], active), other=0.0)
        S = _fold_ring_steps(S, p_k, p_v_head + offs_v, p_g, p_b, num_steps, mask_k, mask_v,
                             head + track_slot * s_state_slot + tile, mask_if(mask_s, track_live), track_step,
                             K, V, USE_QK_L2NORM, TRACK, STEPS_AHEAD)
        tl.store(head + slot * s_state_slot + tile, S.to(state.dtype.element_ty), mask=mask_s)
    count_bad_row(errors, claimed & ~in_pool & (i_v == 0) & (i_layer_hv == 0), ERR_INDEX)


@triton.jit
def _gather_copy_kernel(
    src, dst, slot_indices, scratch_indices, accepted_steps, errors,
    s_src_row, s_src_step, s_src_r, s_src_c, s_dst_slot, s_dst_r, s_dst_c, num_slots, num_rows, num_steps,
    ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ERR_INDEX: tl.constexpr,
):
    # dst[slot, r, c] = src[row, step, r, c] for requests with a live slot and step >= 0,
    # when slot, row and step are inside every pool and scratch buffer of the commit (each
    # launch of one commit takes the same bounds, so a row is copied everywhere or nowhere).
    i_r, i_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_indices + i_n).to(tl.int64)
    row = tl.load(scratch_indices + i_n).to(tl.int64)
    step = tl.load(accepted_steps + i_n).to(tl.int64)
    claimed = (slot >= 0) & (step >= 0)
    inside = (slot < num_slots) & (row >= 0) & (row < num_rows) & (step < num_steps)
    active = claimed & inside
    count_bad_row(errors, claimed & ~inside & (i_r == 0), ERR_INDEX)
    offs_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    mask = mask_if((offs_r[:, None] < ROWS) & (offs_c[None, :] < COLS), active)
    src_ptrs = src + row * s_src_row + step * s_src_step + offs_r[:, None] * s_src_r + offs_c[None, :] * s_src_c
    vals = tl.load(src_ptrs, mask=mask, other=0.0)
    dst_ptrs = dst + slot * s_dst_slot + offs_r[:, None] * s_dst_r + offs_c[None, :] * s_dst_c
    tl.store(dst_ptrs, vals.to(dst.dtype.element_ty), mask=mask)


_commit_ring = CachedKernel(_commit_ring_kernel)
_gather_copy = CachedKernel(_gather_copy_kernel)


# ----------------------------------------------------------------------------
# Ring commit
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CommitRingConfig:
    """Launch configuration of one ring commit (``commit_ring_config`` picks it from the
    shapes). ``block_v``, ``num_warps``: state rows on one warp, as the verify recurrence
    holds them (``recurrence_tile``; its 8 rows or 16 at K = 128): one warp reduces each row
    over K in the verify's order whatever the rows it holds, so a ring commit equals a
    snapshot commit bitwise (more warps do not: the k norm then spans warps);
    ``tiles``: recurrence tiles folded per program, in turn (the next one's state loading
    while this one folds); ``steps_ahead``: how far ahead each step's ring rows load (1 or 2).
    A benchmark sweep passes its own (bench_mtp.py --commit-configs 'tiles=2,steps_ahead=1').
    One tile, two steps ahead: results/mtp_commit_steps_ahead_repeat_h200.json, N = 64 / 256,
    4 steps 76.3 / 284 us against 79.6 / 306 one step ahead, 8 steps 94.9 / 336 against
    103.5 / 366; two tiles two ahead in between (mtp_commit_steps_ahead_h200.json likewise).
    The kernel keeps its tile loop at one tile: written without it, the same kernel measured
    no gain from two steps ahead (mtp_commit_ahead_h200.json)."""
    block_v: int
    num_warps: int = 1
    tiles: int = 1
    steps_ahead: int = 2


# Rings of at least this many steps commit WIDE_COMMIT_TILE_BYTES of state rows a program,
# shorter ones the verify's 4 KB (results/mtp_commit_rows_h200.json, N = 64 / 256, rings of
# 1 + num_spec steps, accept lengths drawn from 1 to the ring's length: 8-step rings 88.1 /
# 319.8 us against 95.6 / 347.2 with 4 KB; 4-step rings 74.2 / 280.0 against 73.6 / 279.0;
# 2-step rings 72.9 / 277.3 against 71.1 / 269.7). The ring's length, not the steps a request
# commits, picks it: a long ring that commits one step takes the wide tile (2-3% slower at
# 2-step rings). Either tile is bitwise the verify's: one warp reduces each row over K in the
# same order whatever the rows it holds.
WIDE_COMMIT_FROM_STEPS = 8
WIDE_COMMIT_TILE_BYTES = 2 * RECURRENCE_TILE_BYTES  # also the path commit's (tree_commit.py)


def commit_ring_config(V: int, K: int, ring_len: int = 1) -> CommitRingConfig:
    """The ring commit's pinned config for rings of ``ring_len`` steps."""
    wide = ring_len >= WIDE_COMMIT_FROM_STEPS
    block_v, num_warps = recurrence_tile(V, K, WIDE_COMMIT_TILE_BYTES if wide else RECURRENCE_TILE_BYTES)
    return CommitRingConfig(block_v=block_v, num_warps=num_warps)


@register("commit_ring", "triton")
def commit_ring_triton(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, *, track_slots,
                       track_steps, use_qk_l2norm, null_block_id, config: CommitRingConfig | None = None):
    """``config`` overrides the pinned choice (``commit_ring_config``; sweeps, tests)."""
    layered = state.dim() == 5
    if not layered:
        state, ring_k, ring_v, ring_g, ring_beta = (t.unsqueeze(0) for t in (state, ring_k, ring_v, ring_g,
                                                                            ring_beta))
    num_layers, _, HV, V, K = state.shape
    H, ring_len = ring_k.shape[2], ring_k.shape[3]
    N = slot_indices.shape[0]
    if N == 0 or num_layers == 0:
        return
    cfg = config or commit_ring_config(V, K, ring_len)
    block_v, num_warps = cfg.block_v, cfg.num_warps
    tiles = max(1, min(cfg.tiles, cdiv(V, block_v)))
    track = track_slots is not None
    grid = (cdiv(V, block_v * tiles), num_layers * HV, N)
    _commit_ring(grid, (
        state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens,
        track_slots if track else slot_indices, track_steps if track else accept_lens, errors.counters(state.device),
        state.stride(0) if layered else 0, state.stride(1),
        ring_k.stride(0) if layered else 0, ring_k.stride(1), ring_v.stride(0) if layered else 0, ring_v.stride(1),
        ring_g.stride(0) if layered else 0, ring_g.stride(1), ring_beta.stride(0) if layered else 0,
        ring_beta.stride(1), ring_len, int(null_block_id), state.shape[1]),
        dict(H=H, HV=HV, K=K, V=V, BLOCK_K=next_power_of_2(K),
             BLOCK_V=block_v, TILES=tiles, STEPS_AHEAD=cfg.steps_ahead,
             USE_QK_L2NORM=bool(use_qk_l2norm), TRACK=track, ERR_INDEX=errors.INDEX["commit_ring"]),
        num_warps=num_warps, num_stages=1)


@register("commit_ring", "reference")
def commit_ring_reference(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, **kwargs):
    if state.dim() == 4:
        return reference.commit_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, **kwargs)
    for layer in range(state.shape[0]):  # a bad row counts once, as in the kernel
        reference.commit_ring(state[layer], ring_k[layer], ring_v[layer], ring_g[layer], ring_beta[layer],
                              slot_indices, accept_lens, count_errors=layer == 0, **kwargs)


def check_commit_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, track_slots,
                      track_steps, full_checks=None):
    lead = state.dim() - 4
    if lead not in (0, 1):
        raise ValueError(f"`state` must be [slots, HV, V, K] or, for every layer at once, [layers, slots, HV, V, K] "
              f"(got shape {tuple(state.shape)}).")
    pool = state[0] if lead else state
    contracts.check_state_pool(pool, "state")
    if lead and state.stride(1) < pool.shape[1] * pool.shape[2] * pool.shape[3]:
        raise ValueError("`state` slots overlap: slot stride < HV*V*K.")
    layers = tuple(state.shape[:lead])
    slots, HV, V, K = pool.shape
    contracts.check_head_dims(K, V)
    if ring_k.dim() != 4 + lead:
        raise ValueError(f"`ring_k` must be {'[layers, ' if lead else '['}slots, H, L, K] (got shape {tuple(ring_k.shape)}).")
    H, L = ring_k.shape[lead + 1], ring_k.shape[lead + 2]
    want = {"ring_k": layers + (slots, H, L, K), "ring_v": layers + (slots, HV, L, V),
            "ring_g": layers + (slots, HV, L, K), "ring_beta": layers + (slots, HV, L)}
    for (name, shape), t in zip(want.items(), (ring_k, ring_v, ring_g, ring_beta)):
        inner_ok = t.stride(-1) == 1 and (t.dim() - lead == 3 and t.stride(-2) == L or t.dim() - lead == 4
                                          and t.stride(-2) == t.shape[-1] and t.stride(-3) == L * t.shape[-1])
        if tuple(t.shape) != shape or not inner_ok:
            raise ValueError(f"`{name}` must be {shape} with contiguous [heads, L, ...] per slot (got {tuple(t.shape)}).")
    if H == 0 or HV % H:
        raise ValueError(f"value heads must be a multiple of key heads (got H={H}, HV={HV}).")
    N = slot_indices.shape[0] if slot_indices.dim() == 1 else -1
    for name, t in (("slot_indices", slot_indices), ("accept_lens", accept_lens)) + (
            (("track_slots", track_slots), ("track_steps", track_steps)) if track_slots is not None else ()):
        if t.dim() != 1 or t.shape[0] != N:
            raise ValueError(f"`{name}` must be 1-D with one entry per request ({N}) (got shape {tuple(t.shape)}).")
        contracts.check_index_dtype(name, t)
    if (track_slots is None) != (track_steps is None):
        raise ValueError("tracking needs `track_slots` and `track_steps` together.")
    if ring_g.dtype != torch.float32 or ring_beta.dtype != torch.float32:
        raise ValueError(f"`ring_g` and `ring_beta` must be float32 (got {ring_g.dtype}, {ring_beta.dtype}).")
    contracts.check_float_dtypes(ring_k=ring_k, ring_v=ring_v)
    contracts.check_same_device(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, track_slots,
                                track_steps)
    if contracts.full_checks_enabled(full_checks):
        contracts.check_slot_values("slot_indices", slot_indices, slots, full_checks=True)
        if accept_lens.numel() and int(accept_lens.max()) > L:
            raise ValueError(f"`accept_lens` holds {int(accept_lens.max())}, more steps than the rings hold (L={L}).")
        if track_slots is not None:
            tracked = track_slots[(track_slots >= 0) & (slot_indices >= 0)]
            if tracked.numel() and int(tracked.max()) >= slots:
                raise ValueError(f"`track_slots` holds slot {int(tracked.max())}, out of range for a pool of {slots} "
                               "slots.")


@kdakit_op("commit_ring", counts_errors=True, mutates=("state",))
def commit_ring_op(state: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, ring_g: torch.Tensor,
                   ring_beta: torch.Tensor, slot_indices: torch.Tensor, accept_lens: torch.Tensor,
                   track_slots: torch.Tensor | None, track_steps: torch.Tensor | None, use_qk_l2norm: bool,
                   null_block_id: int, backend: str | None) -> None:
    _, impl = select("commit_ring", state.device, backend)
    impl(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, track_slots=track_slots,
         track_steps=track_steps, use_qk_l2norm=use_qk_l2norm, null_block_id=null_block_id)


def commit_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, *, track_slots=None,
                track_steps=None, use_qk_l2norm=True, null_block_id=-1, backend=None, full_checks=None):
    """Fold ``accept_lens[n]`` ring steps (bonus token included) into ``state[slot_indices[n]]``.

    Rings ``ring_k [slots, H, L, K]`` (k before its L2 norm), ``ring_v [slots, HV, L, V]``,
    ``ring_g [slots, HV, L, K]`` (log-decay, float32), ``ring_beta [slots, HV, L]`` (float32),
    as ``mtp_verify`` writes them. With ``track_slots``/``track_steps`` the state after step
    ``track_steps[n]`` (0-based, when < accept_lens[n]) also goes to ``state[track_slots[n]]``.
    Rows with slot ``<= null_block_id`` (or < 0) or ``accept_lens <= 0`` are skipped, and so
    are rows whose slot or track slot is past the pool (counted, ``kdakit.take_errors``). Every
    tensor may carry a leading layer dimension: all layers commit in one launch.
    """
    check_commit_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, track_slots,
                      track_steps, full_checks)
    commit_ring_op(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, track_slots, track_steps,
                   use_qk_l2norm, null_block_id, backend)


@commit_ring_op.register_example
def _commit_ring_example(seed, device="cpu", *, track=True):
    g = example_rng(seed)
    H, HV, K, V, slots, L = 1, 2, 8, 16, 6, 4
    bf16 = torch.bfloat16
    args = (example_randn(g, slots, HV, V, K, scale=0.5, device=device),
            example_randn(g, slots, H, L, K, dtype=bf16, device=device),
            example_randn(g, slots, HV, L, V, dtype=bf16, device=device), -example_rand(g, slots, HV, L, K, device=device),
            example_rand(g, slots, HV, L, device=device), example_index(4, -1, 1, 2, device=device),
            example_index(3, 2, 1, 0, device=device))
    kw = dict(null_block_id=-1)
    if track:
        kw.update(track_slots=example_index(5, 0, 3, 0, device=device),
                  track_steps=example_index(1, 0, 0, 0, device=device))
    return commit_ring, args, kw


# ----------------------------------------------------------------------------
# Snapshot commit
# ----------------------------------------------------------------------------
def _gather_copy_launch(src, dst, slot_indices, scratch_indices, accepted_steps, rows, cols,
                        src_rc_strides, dst_rc_strides, bounds, err_index):
    block_c = next_power_of_2(cols)
    block_r = max(1, min(next_power_of_2(rows), 4096 // block_c))
    grid = (cdiv(rows, block_r), slot_indices.shape[0])
    _gather_copy(grid, (src, dst, slot_indices, scratch_indices, accepted_steps, errors.counters(src.device),
                        src.stride(0), src.stride(1), *src_rc_strides, dst.stride(0), *dst_rc_strides, *bounds),
                 dict(ROWS=rows, COLS=cols, BLOCK_R=block_r, BLOCK_C=block_c, ERR_INDEX=err_index),
                 num_warps=4, num_stages=1)


def snapshot_commit_bounds(state, snapshots, conv_states, intermediate_conv) -> tuple:
    """(slots, scratch rows, steps) that every pool and scratch buffer of a snapshot commit holds."""
    dst = ([state] if snapshots is not None else []) + list(conv_states or ())
    src = ([snapshots] if snapshots is not None else []) + list(intermediate_conv or ())
    return min(t.shape[0] for t in dst), min(t.shape[0] for t in src), min(t.shape[1] for t in src)


@register("commit_snapshots", "triton")
def commit_snapshots_triton(state, snapshots, slot_indices, scratch_indices, accepted_steps, *, conv_states,
                            intermediate_conv):
    if slot_indices.shape[0] == 0:
        return
    bounds = snapshot_commit_bounds(state, snapshots, conv_states, intermediate_conv)
    err_index = errors.INDEX["commit_snapshots"]  # the first launch counts
    if snapshots is not None:
        _, HV, V, K = state.shape
        _gather_copy_launch(snapshots, state, slot_indices, scratch_indices, accepted_steps, HV * V, K,
                            (K, 1), (K, 1), bounds, err_index)
        err_index = errors.NO_COUNT
    for pool, inter in zip(conv_states or (), intermediate_conv or ()):
        _gather_copy_launch(inter, pool, slot_indices, scratch_indices, accepted_steps, pool.shape[1],
                            pool.shape[2], (inter.stride(2), inter.stride(3)), (pool.stride(1), pool.stride(2)),
                            bounds, err_index)
        err_index = errors.NO_COUNT


@register("commit_snapshots", "reference")
def commit_snapshots_reference(state, snapshots, slot_indices, scratch_indices, accepted_steps, **kwargs):
    reference.commit_snapshots(state, snapshots, slot_indices, scratch_indices, accepted_steps, **kwargs)


def run_commit_snapshots(state, snapshots, slot_indices, scratch_indices, accepted_steps, conv_states,
                         intermediate_conv, backend):
    """Dispatch after validation; the conv pools as tuples (or None), as the public entry takes them."""
    _, impl = select("commit_snapshots", state.device, backend)
    impl(state, snapshots, slot_indices, scratch_indices, accepted_steps, conv_states=conv_states,
         intermediate_conv=intermediate_conv)


def _schema_args(state, snapshots, slot_indices, scratch_indices, accepted_steps, conv_states, intermediate_conv,
                 backend):
    """The custom op's arguments: the conv pools as lists (empty for None)."""
    return (state, snapshots, slot_indices, scratch_indices, accepted_steps, list(conv_states or ()),
            list(intermediate_conv or ()), backend)


@kdakit_op("commit_snapshots", counts_errors=True, mutates=("state", "conv_states"),
           dispatch=run_commit_snapshots, flatten=_schema_args)
def commit_snapshots_op(state: torch.Tensor, snapshots: torch.Tensor | None, slot_indices: torch.Tensor,
                        scratch_indices: torch.Tensor, accepted_steps: torch.Tensor, conv_states: list[torch.Tensor],
                        intermediate_conv: list[torch.Tensor], backend: str | None) -> None:
    run_commit_snapshots(state, snapshots, slot_indices, scratch_indices, accepted_steps,
                         tuple(conv_states) if conv_states else None,
                         tuple(intermediate_conv) if intermediate_conv else None, backend)


def commit_snapshots(state, snapshots, slot_indices, scratch_indices, accepted_steps, *, conv_states=None,
                     intermediate_conv=None, backend=None, full_checks=None):
    """For each request with a live slot and ``accepted_steps[n] >= 0``, copy snapshot
    ``snapshots[scratch_indices[n], accepted_steps[n]]`` into ``state[slot_indices[n]]``, and
    the conv windows ``intermediate_conv[i][row, step]`` into ``conv_states[i][slot]``.
    ``snapshots=None`` commits the conv windows only (after a ring commit of the state). A
    request whose slot, scratch row or step is outside any of these buffers is not committed
    anywhere (counted, ``kdakit.take_errors``)."""
    N = slot_indices.shape[0] if slot_indices.dim() == 1 else -1
    for name, t in (("slot_indices", slot_indices), ("scratch_indices", scratch_indices),
                    ("accepted_steps", accepted_steps)):
        if t.dim() != 1 or t.shape[0] != N:
            raise ValueError(f"`{name}` must be 1-D with one entry per request ({N}) (got shape {tuple(t.shape)}).")
        contracts.check_index_dtype(name, t)
    tensors = [state, slot_indices, scratch_indices, accepted_steps]
    if snapshots is not None:
        contracts.check_state_pool(state, "state")
        if (snapshots.dim() != 5 or tuple(snapshots.shape[2:]) != tuple(state.shape[1:])
                or snapshots.stride(4) != 1 or snapshots.stride(3) != state.shape[3]
                or snapshots.stride(2) != state.shape[2] * state.shape[3]):
            raise ValueError(f"`snapshots` must be [scratch, L, {', '.join(map(str, state.shape[1:]))}] with contiguous "
                  f"inner dims (got {tuple(snapshots.shape)}).")
        tensors.append(snapshots)
    if (conv_states is None) != (intermediate_conv is None):
        raise ValueError("conv windows need `conv_states` and `intermediate_conv` together.")
    for i, (pool, inter) in enumerate(zip(conv_states or (), intermediate_conv or ())):
        if pool.dim() != 3 or inter.dim() != 4 or tuple(inter.shape[2:]) != tuple(pool.shape[1:]):
            raise ValueError(f"conv pool {i} must be [slots, C, W-1] and its intermediate [scratch, L, C, W-1] "
                  f"(got {tuple(pool.shape)} and {tuple(inter.shape)}).")
        tensors += [pool, inter]
    if snapshots is None and conv_states is None:
        raise ValueError("nothing to commit: pass `snapshots`, or `conv_states` with `intermediate_conv`.")
    contracts.check_same_device(*tensors)
    if contracts.full_checks_enabled(full_checks):
        contracts.check_slot_values("slot_indices", slot_indices, state.shape[0], full_checks=True)
        steps = accepted_steps[slot_indices >= 0]
        L = (snapshots if snapshots is not None else intermediate_conv[0]).shape[1]
        if steps.numel() and int(steps.max()) >= L:
            raise ValueError(f"`accepted_steps` holds {int(steps.max())}, past the {L} steps a scratch row holds.")
        num_slots, num_rows, _ = snapshot_commit_bounds(state, snapshots, conv_states, intermediate_conv)
        committed = (slot_indices >= 0) & (accepted_steps >= 0)
        contracts.check_slot_values("slot_indices", slot_indices[committed], num_slots, full_checks=True)
        contracts.check_rows_in_range("scratch_indices", scratch_indices[committed], num_rows, "row")
    commit_snapshots_op(state, snapshots, slot_indices, scratch_indices, accepted_steps, conv_states,
                        intermediate_conv, backend)


@commit_snapshots_op.register_example
def _commit_snapshots_example(seed, device="cpu", *, merged_conv_only=False):
    """``merged_conv_only``: one merged q|k|v conv pool and no state snapshot (after a ring commit)."""
    g = example_rng(seed)
    HV, K, V, W, slots, scratch, L = 2, 8, 16, 4, 5, 3, 4
    bf16 = torch.bfloat16
    channels = (8, 8, 32)
    rows = (example_index(4, -1, 1, device=device), example_index(0, 2, 1, device=device),
            example_index(2, 1, -1, device=device))
    if merged_conv_only:
        C = sum(channels)
        args = (example_randn(g, slots, HV, V, K, device=device), None, *rows)
        kw = dict(conv_states=(example_randn(g, slots, C, W - 1, dtype=bf16, device=device),),
                  intermediate_conv=(example_randn(g, scratch, L, C, W - 1, dtype=bf16, device=device),))
    else:
        args = (example_pool(g, slots, HV, V, K, device=device), example_randn(g, scratch, L, HV, V, K, device=device),
                *rows)
        kw = dict(conv_states=tuple(example_randn(g, slots, c, W - 1, dtype=bf16, device=device) for c in channels),
                  intermediate_conv=tuple(example_randn(g, scratch, L, c, W - 1, dtype=bf16, device=device)
                                          for c in channels))
    return commit_snapshots, args, kw
