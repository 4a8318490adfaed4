"""Speculative (MTP) verify: ``T = 1 + num_spec`` dense tokens per request.

Each request starts from its slot's state and conv windows, which stay
read-only. After step ``t`` the verify writes either a full snapshot
``snapshots[row, t]`` or, in ring mode, the step's raw inputs (post-conv k
before its L2 norm, v, log-decay g, β) at ring position ``t`` of the slot, so a
later commit can replay any accepted prefix. Conv windows after step ``t`` go to
``intermediate_conv[i][row, t]``. ``row = scratch_indices[n]``. With the short conv, a
prologue kernel (``verify_conv.py``) convolves every channel once before the recurrence.

Snapshot mode runs the recurrence here (the state after every step is written anyway).
Ring mode keeps no state: beyond a few requests it computes its outputs in the chunk form
(``ring_verify.py``) from one read of the state; at small batches, where launch latency
rules, the recurrence here is faster (``ring_form``). The ring commit replays with this
file's recurrence tile, so a ring commit equals a snapshot commit bitwise whichever form
computed the outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import contracts, errors, reference
from ..backends import register, select
from .gated_rmsnorm import gated_rmsnorm_after
from .launch import CachedKernel, cdiv, next_power_of_2, pdl_available
from .registry import example_index, example_rand, example_randn, example_rng, kdakit_op
from .ring_verify import RingVerifyConfig, ring_verify, ring_verify_config
from .triton_math import count_bad_row, delta_rule_update, kda_log_decay, l2_normalize, mask_if, verify_request
from .verify_conv import VerifyConvConfig, verify_conv, verify_conv_config


@triton.jit
def _load_token(x_q, x_k, x_v, a, b, t, tok, s_q, s_k, s_v, s_a, s_b, i_hv, ch_qk, ch_v, offs_k, mask_k, mask_v,
                bias, A_log_h, lower_bound, K: tl.constexpr, SAFE_GATE: tl.constexpr):
    """Step t's post-conv q, k, v, its log-decay g and β, float32, from token ``tok`` of
    ``a`` and ``b`` and step ``t`` after the request's first token ``x_*``, each tensor's
    tokens ``s_*`` elements apart. Read as 1-D rows, the way the ring commit reads its rows,
    so both hold k in the same register layout and its L2 norm rounds alike."""
    q_t = tl.load(x_q + t * s_q + ch_qk, mask=mask_k, other=0.0).to(tl.float32)
    k_t = tl.load(x_k + t * s_k + ch_qk, mask=mask_k, other=0.0).to(tl.float32)
    v_t = tl.load(x_v + t * s_v + ch_v, mask=mask_v, other=0.0).to(tl.float32)
    a_t = tl.load(a + tok * s_a + i_hv * K + offs_k, mask=mask_k, other=0.0)
    g_t = kda_log_decay(a_t.to(tl.float32), bias, A_log_h, lower_bound, SAFE_GATE)
    beta_t = tl.sigmoid(tl.load(b + tok * s_b + i_hv).to(tl.float32))
    return q_t, k_t, v_t, g_t, beta_t


@triton.jit
def _load_step(x_q, x_k, x_v, a, b, t, n64, i_hv, ch_qk, ch_v, offs_k, mask_k, mask_v, bias, A_log_h, lower_bound,
               T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               SAFE_GATE: tl.constexpr):
    """``_load_token`` of dense ``[N, T, ...]`` tokens (request ``n64``, step ``t``)."""
    return _load_token(x_q, x_k, x_v, a, b, t, n64 * T + t, H * K, H * K, HV * V, HV * K, HV, i_hv, ch_qk, ch_v,
                       offs_k, mask_k, mask_v, bias, A_log_h, lower_bound, K, SAFE_GATE)


@triton.jit
def _verify_step(S, cur, t, live, writes_head, writes_key_head, mask_s, slot, row, n64, i_h, i_hv, offs_k, offs_v,
                 mask_k, mask_v, out, snapshots, ring_k, ring_v, ring_g, ring_beta, s_snap_row, s_snap_t, s_rk_slot,
                 s_rv_slot, s_rg_slot, s_rb_slot, ring_len, scale, T: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, SNAPSHOT: tl.constexpr, RING: tl.constexpr):
    """Step ``t`` of one program's tile: its ring entries, the update, its output row and snapshot."""
    q_t, k_t, v_t, g_t, beta_t = cur
    if RING:  # the raw per-step inputs of the commit's replay
        tl.store(ring_k + slot * s_rk_slot + (i_h * ring_len + t) * K + offs_k, k_t.to(ring_k.dtype.element_ty),
                 mask=mask_if(mask_k, writes_key_head))
        tl.store(ring_v + slot * s_rv_slot + (i_hv * ring_len + t) * V + offs_v,
                 v_t.to(ring_v.dtype.element_ty), mask=mask_if(mask_v, live))
        tl.store(ring_g + slot * s_rg_slot + (i_hv * ring_len + t) * K + offs_k,
                 g_t.to(ring_g.dtype.element_ty), mask=mask_if(mask_k, writes_head))
        tl.store(ring_beta + slot * s_rb_slot + i_hv * ring_len + t, beta_t.to(ring_beta.dtype.element_ty),
                 mask=writes_head)
    q_hat = l2_normalize(q_t) * scale
    S = delta_rule_update(S, l2_normalize(k_t), v_t, g_t, beta_t)
    o = tl.where(live, tl.sum(S * q_hat[None, :], axis=1), 0.0)
    tl.store(out + ((n64 * T + t) * HV + i_hv) * V + offs_v, o.to(out.dtype.element_ty), mask=mask_v)
    if SNAPSHOT:
        snap = snapshots + row * s_snap_row + t * s_snap_t + i_hv * V * K
        tl.store(snap + offs_v[:, None] * K + offs_k[None, :], S.to(snapshots.dtype.element_ty), mask=mask_s)
    return S


@triton.jit
def _mtp_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out,
    snapshots, ring_k, ring_v, ring_g, ring_beta, errors,
    stride_state_slot, s_snap_row, s_snap_t, s_rk_slot, s_rv_slot, s_rg_slot, s_rb_slot, ring_len,
    s_q, s_k, s_v, s_a, s_b, num_slots, num_rows, scale, lower_bound,
    T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    SNAPSHOT: tl.constexpr, RING: tl.constexpr, SAFE_GATE: tl.constexpr,
    WAIT_FOR_TOKENS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, CHECK_ROWS: tl.constexpr,
    ERR_INDEX: tl.constexpr, UNROLL_STEPS: tl.constexpr,
):
    # One program: BLOCK_V state rows of one (request, value head), carried in registers
    # through the T steps; each step's inputs are loaded while the previous step computes
    # (faster than preparing chunks of steps at once: results/mtp_schedule_sweep_h200.json).
    # Data shared by the programs of a key head (the k ring) has one writer: the group's
    # first value head, V tile 0. WAIT_FOR_TOKENS: a programmatic dependent launch after the
    # conv prologue that writes q, k, v; the state tile loads while that kernel ends.
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if LAUNCH_DEPENDENTS:  # the output norm may start loading its gate now
        gdc_launch_dependents()
    G: tl.constexpr = HV // H
    i_h = i_hv // G
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < V
    # Padding rows, and indices past their buffers: zero output, nothing else read or written.
    slot, row, live = verify_request(slot_indices, scratch_indices, i_n, num_slots, num_rows, CHECK_ROWS)
    writes_head = live & (i_v == 0)
    writes_key_head = writes_head & (i_hv % G == 0)
    mask_s = mask_if(mask_v[:, None] & mask_k[None, :], live)
    s_ptrs = state + slot * stride_state_slot + i_hv * V * K + offs_v[:, None] * K + offs_k[None, :]
    S = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)

    n64 = i_n.to(tl.int64)
    x_q = q + n64 * T * s_q                       # this request's token 0, channel 0 (s_*: token strides)
    x_k = k + n64 * T * s_k
    x_v = v + n64 * T * s_v
    ch_qk = i_h * K + offs_k
    ch_v = i_hv * V + offs_v
    bias = tl.load(dt_bias + i_hv * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    A_log_h = tl.load(A_log + i_hv).to(tl.float32)
    if WAIT_FOR_TOKENS:
        gdc_wait()

    nxt = _load_token(x_q, x_k, x_v, a, b, 0, n64 * T, s_q, s_k, s_v, s_a, s_b, i_hv, ch_qk, ch_v, offs_k, mask_k,
                      mask_v, bias, A_log_h, lower_bound, K, SAFE_GATE)
    if UNROLL_STEPS:
        for t in tl.static_range(T):
            cur = nxt
            if t + 1 < T:
                nxt = _load_token(x_q, x_k, x_v, a, b, t + 1, n64 * T + t + 1, s_q, s_k, s_v, s_a, s_b, i_hv, ch_qk,
                                  ch_v, offs_k, mask_k, mask_v, bias, A_log_h, lower_bound, K, SAFE_GATE)
            S = _verify_step(S, cur, t, live, writes_head, writes_key_head, mask_s, slot, row, n64, i_h, i_hv,
                             offs_k, offs_v, mask_k, mask_v, out, snapshots, ring_k, ring_v, ring_g, ring_beta,
                             s_snap_row, s_snap_t, s_rk_slot, s_rv_slot, s_rg_slot, s_rb_slot, ring_len, scale,
                             T, HV, K, V, SNAPSHOT, RING)
    else:
        # Long chains as a loop: unrolled, the code of 16 steps outgrows the instruction
        # cache. The last step loads step T - 1 again rather than branch.
        for t in range(T):
            cur = nxt
            step = tl.minimum(t + 1, T - 1)
            nxt = _load_token(x_q, x_k, x_v, a, b, step, n64 * T + step, s_q, s_k, s_v, s_a, s_b, i_hv, ch_qk, ch_v,
                              offs_k, mask_k, mask_v, bias, A_log_h, lower_bound, K, SAFE_GATE)
            S = _verify_step(S, cur, t, live, writes_head, writes_key_head, mask_s, slot, row, n64, i_h, i_hv,
                             offs_k, offs_v, mask_k, mask_v, out, snapshots, ring_k, ring_v, ring_g, ring_beta,
                             s_snap_row, s_snap_t, s_rk_slot, s_rv_slot, s_rg_slot, s_rb_slot, ring_len, scale,
                             T, HV, K, V, SNAPSHOT, RING)
    count_bad_row(errors, (slot >= 0) & ~live & (i_v == 0) & (i_hv == 0), ERR_INDEX)


_mtp_verify = CachedKernel(_mtp_verify_kernel)


# Bytes of float32 state rows per one-warp program of the verify recurrence: the pickers'
# default (a benchmark sweep passes its own, ``benchmarks/bench_mtp.py --configs``).
RECURRENCE_TILE_BYTES = 4096


def recurrence_tile(V: int, K: int, tile_bytes: int = RECURRENCE_TILE_BYTES) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of every kernel that runs the verify recurrence: one warp on
    ``tile_bytes`` of float32 state rows. The ring commits replay on one warp too (with
    as many rows or twice as many), so their reductions round exactly like the verify's and
    a ring commit equals a snapshot commit bitwise; that is also why the output norm runs
    as a second kernel rather than on a full-row tile."""
    rows = tile_bytes // (next_power_of_2(K) * 4)
    return max(1, min(next_power_of_2(V), rows)), 1


# Ring mode runs the chunk form above this many (request, value head, step) triples and the
# recurrence at or below it (results/mtp_ring_forms_h200.json, H = 32: the recurrence wins at
# N <= 16 with 2 steps and N <= 4 with 4 or 8; from N = 8 with 8 steps the chunk form is
# 1.5x faster). The pickers' default (a benchmark sweep passes a config: bench_mtp.py --ring-configs).
RING_CHUNK_FORM_ABOVE = 1024


def ring_form(N: int, HV: int, T: int, chunk_form_above: int = RING_CHUNK_FORM_ABOVE) -> str:
    """"chunked" (ring_verify.py: two kernels, one read of the state) or "recurrent"."""
    return "chunked" if N * HV * T > chunk_form_above else "recurrent"


@dataclass(frozen=True)
class VerifyConfig:
    """Launch configuration of one verify call, chain (``mtp_verify_config``) or tree
    (``tree_verify.tree_verify_config``), picked from the shapes and the gate.
    ``block_v``, ``num_warps``: the recurrence's tile (``recurrence_tile``; a ring commit of
    the same rows must use the same tile to equal a snapshot commit bitwise). ``ring_form``:
    ring mode's "chunked" (``ring``'s kernels) or "recurrent" form (``ring_form``).
    ``conv``: the chain's conv prologue (a tree's has its own, ``tree_conv.py``).
    ``unroll_steps``: the recurrence's steps unrolled (``unroll_steps`` picks it from T)."""
    block_v: int
    num_warps: int = 1
    ring_form: str = "recurrent"
    ring: RingVerifyConfig = RingVerifyConfig()
    conv: VerifyConvConfig = VerifyConvConfig()
    unroll_steps: bool = True  # the recurrence's step loop unrolled (False: a loop; long chains)
    prefetch_parent: bool = False  # tree snapshot loop: a node's parent tile loads a node early


def mtp_verify_config(N: int, T: int, HV: int, V: int, K: int, lower_bound) -> VerifyConfig:
    """The chain verify's pinned config (no autotuning in a serving call)."""
    block_v, num_warps = recurrence_tile(V, K)
    return VerifyConfig(block_v=block_v, num_warps=num_warps, ring_form=ring_form(N, HV, T),
                        ring=ring_verify_config(T, lower_bound), conv=verify_conv_config(T),
                        unroll_steps=unroll_steps(T))


# The recurrence's step loop is unrolled up to this many steps, a loop beyond.
UNROLL_STEPS_MAX = 8


def unroll_steps(T: int, unroll_max: int = UNROLL_STEPS_MAX) -> bool:
    return T <= unroll_max


def _strides(t, dims, default=0):
    return [t.stride(d) for d in dims] if t is not None else [default] * len(dims)


@register("mtp_verify", "triton")
def mtp_verify_triton(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out, *,
                      conv_weights, conv_states, intermediate_conv, conv_bias, snapshots, rings, scale,
                      lower_bound, norm_gate, norm_weight, norm_eps, config: VerifyConfig | None = None):
    """``config`` overrides the pinned choice (``mtp_verify_config``; sweeps, tests)."""
    N, T, H, K = q.shape
    HV, V = v.shape[-2:]
    if N == 0:
        return out
    cfg = config or mtp_verify_config(N, T, HV, V, K, lower_bound)
    # Programmatic dependent launches (see launch.pdl_available) between our own kernels.
    pdl = pdl_available(q.device)
    conv = conv_weights is not None
    # Every kernel of the verify treats the same rows as padding: slots past the pool, and
    # scratch rows outside every scratch buffer the call writes (-1: none, rows not checked);
    # one kernel counts them.
    bounds = (state.shape[0], scratch_rows(snapshots if rings is None else None, intermediate_conv))
    if conv:  # its own kernel first (it reads dense tokens); the recurrence reads the post-conv tokens
        q, k, v = verify_conv(_dense(q), _dense(k), _dense(v), conv_weights, conv_bias, conv_states, intermediate_conv, slot_indices,
                              scratch_indices, bounds, launch_dependents=pdl, config=cfg.conv)
    norm = norm_weight is not None
    raw_out = torch.empty(out.shape, dtype=torch.float32, device=out.device) if norm else out
    if rings is not None and cfg.ring_form == "chunked":  # its kernels read dense tokens
        q, k, v, a, b = map(_dense, (q, k, v, a, b))
        ring_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, bounds, raw_out, rings,
                    scale=scale, lower_bound=lower_bound, wait_for_tokens=conv, launch_dependents=norm, pdl=pdl,
                    config=cfg.ring)
    else:
        _launch_recurrence(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, raw_out, snapshots,
                           rings, scale, lower_bound, bounds, conv=conv, norm=norm, pdl=pdl,
                           tile=(cfg.block_v, cfg.num_warps), unrolled=cfg.unroll_steps)
    if norm:  # padding rows stay zero: their raw output is zero, and so is its norm
        gated_rmsnorm_after(raw_out, norm_gate, norm_weight, out, eps=norm_eps, wait_for_x=pdl)
    return out


def scratch_rows(snapshots, intermediate_conv) -> int:
    """Rows every scratch buffer written has (snapshots, intermediate conv windows); -1 when none is."""
    rows = [t.shape[0] for t in (snapshots, *(intermediate_conv or ())) if t is not None]
    return min(rows) if rows else -1


def _launch_recurrence(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, raw_out, snapshots,
                       rings, scale, lower_bound, bounds, *, conv, norm, pdl, tile, unrolled=True):
    """The verify recurrence: outputs, and after every step a snapshot or the ring entries."""
    N, T, H, K = q.shape
    HV, V = v.shape[-2:]
    dummy = state  # never dereferenced: the constexpr flags compile its uses away
    ring_k, ring_v, ring_g, ring_beta = rings if rings is not None else (None,) * 4
    block_v, num_warps = tile
    _mtp_verify(
        (cdiv(V, block_v), HV, N),
        (q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, raw_out,
         *(t if t is not None else dummy for t in (snapshots, ring_k, ring_v, ring_g, ring_beta)),
         errors.counters(q.device),
         state.stride(0), *_strides(snapshots, (0, 1)), *_strides(ring_k, (0,)), *_strides(ring_v, (0,)),
         *_strides(ring_g, (0,)), *_strides(ring_beta, (0,)), ring_k.shape[2] if ring_k is not None else 0,
         *(token_stride(t) for t in (q, k, v, a, b)),
         *bounds, float(scale), float(lower_bound) if lower_bound is not None else 0.0),
        dict(T=T, H=H, HV=HV, K=K, V=V, BLOCK_K=next_power_of_2(K), BLOCK_V=block_v,
             SNAPSHOT=snapshots is not None and rings is None, RING=rings is not None,
             SAFE_GATE=lower_bound is not None, WAIT_FOR_TOKENS=conv and pdl, LAUNCH_DEPENDENTS=norm and pdl,
             CHECK_ROWS=bounds[1] >= 0, ERR_INDEX=errors.INDEX["mtp_verify"], UNROLL_STEPS=bool(unrolled)),
        num_warps=num_warps, num_stages=1, launch_pdl=conv and pdl)


@register("mtp_verify", "reference")
def mtp_verify_reference(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out, **kwargs):
    return reference.mtp_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out, **kwargs)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
def token_stride(t: torch.Tensor) -> int | None:
    """Elements between consecutive tokens of ``t [N, T, *inner]`` read as ``N * T`` tokens in a
    row (request n's step t is token ``n T + t``) with dense inner dims, or None when its strides
    do not allow that (a view of sglang's packed ``q|k|v`` projection does: one token stride)."""
    N, T = t.shape[:2]
    inner = 1
    for size in t.shape[2:]:
        inner *= size
    if t.is_contiguous():
        return inner
    expected = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    if T > 1:
        if N > 1 and t.stride(0) != T * t.stride(1):
            return None
        return t.stride(1)
    return t.stride(0) if N > 1 else inner


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def check_mtp_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out, *,
                     conv_weights, conv_states, intermediate_conv, conv_bias, snapshots, rings,
                     lower_bound, norm_gate, norm_weight, full_checks=None, strided_tokens=False):
    """Shapes, layouts, dtypes and devices of a native verify call; raises before anything runs.
    ``strided_tokens``: q, k, v, a, b may be views whose tokens lie one stride apart (the chain
    verify reads them so; ``token_stride``), else they must be contiguous."""
    if q.dim() != 4:
        raise ValueError(f"`q` must be [N, 1 + num_spec, H, K] (got shape {tuple(q.shape)}).")
    N, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (N, T):
        raise ValueError(f"`v` must be [N, T, HV, V] with N={N}, T={T} (got shape {tuple(v.shape)}).")
    HV, V = v.shape[2:]
    expected = {"q": (N, T, H, K), "k": (N, T, H, K), "a": (N, T, HV, K), "b": (N, T, HV), "out": (N, T, HV, V)}
    for name, t in (("q", q), ("k", k), ("a", a), ("b", b), ("out", out)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"`{name}` must have shape {expected[name]} (got {tuple(t.shape)}).")
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("out", out)):
        if strided_tokens and name != "out":
            if token_stride(t) is None:
                raise ValueError(f"`{name}` must hold its N*T tokens one stride apart with dense inner dims "
                                 f"(got shape {tuple(t.shape)}, strides {t.stride()}).")
        elif not t.is_contiguous():
            raise ValueError(f"`{name}` must be contiguous (dense [N, T, ...] tokens).")
    if H == 0 or HV % H != 0:
        raise ValueError(f"value heads must be a multiple of key heads (got H={H}, HV={HV}).")
    contracts.check_state_pool(state, "state")
    if tuple(state.shape[1:]) != (HV, V, K):
        raise ValueError(f"`state` must be [slots, HV={HV}, V={V}, K={K}] (got {tuple(state.shape)}).")
    contracts.check_head_dims(K, V)
    if A_log.numel() != HV or dt_bias.numel() != HV * K:
        raise ValueError(f"`A_log` must have {HV} elements and `dt_bias` {HV * K} (got {A_log.numel()}, {dt_bias.numel()}).")
    for name, t in (("slot_indices", slot_indices), ("scratch_indices", scratch_indices)):
        if tuple(t.shape) != (N,):
            raise ValueError(f"`{name}` must have shape ({N},) (got {tuple(t.shape)}).")
        contracts.check_index_dtype(name, t)
    contracts.check_float_dtypes(q=q, k=k, v=v, a=a, b=b, out=out, A_log=A_log, dt_bias=dt_bias)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"`q`, `k`, `v` must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype}).")
    contracts.check_lower_bound(lower_bound)
    tensors = [q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out]
    if conv_weights is not None:
        if conv_states is None or intermediate_conv is None:
            raise ValueError("the fused conv needs `conv_weights`, `conv_states` and `intermediate_conv` together.")
        channels = (H * K, H * K, HV * V)
        W = conv_weights[0].shape[-1]
        for i, name in enumerate("qkv"):
            w, cs, ic = conv_weights[i], conv_states[i], intermediate_conv[i]
            if tuple(w.shape) != (channels[i], W) or not w.is_contiguous() or w.dtype != torch.float32:
                raise ValueError(f"conv weight `w_{name}` must be contiguous float32 [{channels[i]}, {W}] "
                      f"(got {tuple(w.shape)} {w.dtype}).")
            if cs.dim() != 3 or cs.shape[1:] != (channels[i], W - 1) or cs.shape[0] != state.shape[0]:
                raise ValueError(f"conv state `cs_{name}` must be [slots={state.shape[0]}, {channels[i]}, {W - 1}] "
                      f"(got {tuple(cs.shape)}).")
            if (ic.dim() != 4 or ic.shape[1] < T or ic.shape[2:] != (channels[i], W - 1)
                    or ic.stride(3) != 1 or ic.stride(2) != W - 1):
                raise ValueError(f"`intermediate_conv_{name}` must be [scratch, >={T}, {channels[i]}, {W - 1}] with "
                      f"contiguous inner dims (got {tuple(ic.shape)}).")
            if conv_bias is not None and tuple(conv_bias[i].shape) != (channels[i],):
                raise ValueError(f"conv bias {i} must have shape ({channels[i]},) (got {tuple(conv_bias[i].shape)}).")
            tensors += [w, cs, ic]
    if rings is not None:
        ring_k, ring_v, ring_g, ring_beta = rings
        slots, L = state.shape[0], ring_v.shape[2] if ring_v.dim() == 4 else -1
        want = {"ring_k": (slots, H, L, K), "ring_v": (slots, HV, L, V), "ring_g": (slots, HV, L, K),
                "ring_beta": (slots, HV, L)}
        for name, t in zip(want, rings):
            if tuple(t.shape) != want[name] or L < T or t.stride(-1) != 1 or (
                    t.dim() == 4 and (t.stride(2) != t.shape[3] or t.stride(1) != L * t.shape[3])) or (
                    t.dim() == 3 and t.stride(1) != L):
                raise ValueError(f"`{name}` must be {want[name]} with L >= {T} and contiguous [heads, L, ...] per slot "
                      f"(got {tuple(t.shape)}).")
        tensors += list(rings)
    elif snapshots is not None:
        if (snapshots.dim() != 5 or snapshots.shape[1] < T or tuple(snapshots.shape[2:]) != (HV, V, K)
                or snapshots.stride(4) != 1 or snapshots.stride(3) != K or snapshots.stride(2) != V * K):
            raise ValueError(f"`snapshots` must be [scratch, >={T}, HV={HV}, V={V}, K={K}] with contiguous inner dims "
                  f"(got {tuple(snapshots.shape)}).")
        if snapshots.dtype not in contracts.STATE_DTYPES:
            raise ValueError(f"`snapshots` must be float32, bfloat16 or float16 (got {snapshots.dtype}).")
        tensors.append(snapshots)
    if (norm_gate is None) != (norm_weight is None):
        raise ValueError("the fused output norm needs `norm_gate` and `norm_weight` together.")
    if norm_weight is not None:
        if tuple(norm_gate.shape) != (N, T, HV, V) or not norm_gate.is_contiguous():
            raise ValueError(f"`norm_gate` must be contiguous {(N, T, HV, V)} (got {tuple(norm_gate.shape)}).")
        if tuple(norm_weight.shape) != (V,):
            raise ValueError(f"`norm_weight` must have shape ({V},) (got {tuple(norm_weight.shape)}).")
        tensors += [norm_gate, norm_weight]
    contracts.check_same_device(*tensors)
    if contracts.full_checks_enabled(full_checks):
        contracts.check_slot_values("slot_indices", slot_indices, state.shape[0], full_checks=True)
        if snapshots is not None and rings is None:
            contracts.check_slot_values("scratch_indices", scratch_indices[slot_indices >= 0], snapshots.shape[0],
                                        full_checks=True)
        rows = scratch_rows(snapshots if rings is None else None, intermediate_conv)
        if rows >= 0:  # negative rows, and the intermediate conv windows' rows, too
            contracts.check_rows_in_range("scratch_indices", scratch_indices[slot_indices >= 0], rows, "row")
        contracts.check_finite(True, A_log=A_log, dt_bias=dt_bias)


def run_mtp_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out, conv_weights,
                   conv_states, intermediate_conv, conv_bias, snapshots, rings, scale, lower_bound, norm_gate,
                   norm_weight, norm_eps, backend):
    """Dispatch after validation, the tuples as the public entry takes them."""
    _, impl = select("mtp_verify", q.device, backend)
    impl(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out,
         conv_weights=conv_weights, conv_states=conv_states, intermediate_conv=intermediate_conv,
         conv_bias=conv_bias, snapshots=snapshots, rings=rings, scale=scale, lower_bound=lower_bound,
         norm_gate=norm_gate, norm_weight=norm_weight, norm_eps=norm_eps)


def mtp_verify_tensors(conv_weights, conv_states, intermediate_conv, conv_bias, snapshots, rings) -> tuple:
    """The public tuples flattened into the custom op's 17 optional tensor arguments, in
    schema order: ``w_q..w_v, cs_q..cs_v, ic_q..ic_v, bias_q..bias_v, snapshots, ring_k..ring_beta``."""
    flat = []
    for group, n in ((conv_weights, 3), (conv_states, 3), (intermediate_conv, 3), (conv_bias, 3)):
        flat += list(group) if group is not None else [None] * n
    flat.append(snapshots)
    flat += list(rings) if rings is not None else [None] * 4
    return tuple(flat)


def optional_tuple(*tensors):
    """A tuple of tensors, or None when the first is None (the op's "not given")."""
    return None if tensors[0] is None else tuple(tensors)


def verify_schema_args(first: int):
    """A flattener of a verify op's arguments for its custom op: the six tuple-or-None
    arguments from position ``first`` on as ``mtp_verify_tensors``."""
    def flatten(*args):
        return (*args[:first], *mtp_verify_tensors(*args[first:first + 6]), *args[first + 6:])
    return flatten


@kdakit_op("mtp_verify", mutates=("out", "ic_q", "ic_k", "ic_v", "snapshots", "ring_k", "ring_v", "ring_g",
                                  "ring_beta"), counts_errors=True, dispatch=run_mtp_verify,
           flatten=verify_schema_args(11))
def mtp_verify_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slot_indices: torch.Tensor,
                  scratch_indices: torch.Tensor, out: torch.Tensor,
                  w_q: torch.Tensor | None, w_k: torch.Tensor | None, w_v: torch.Tensor | None,
                  cs_q: torch.Tensor | None, cs_k: torch.Tensor | None, cs_v: torch.Tensor | None,
                  ic_q: torch.Tensor | None, ic_k: torch.Tensor | None, ic_v: torch.Tensor | None,
                  bias_q: torch.Tensor | None, bias_k: torch.Tensor | None, bias_v: torch.Tensor | None,
                  snapshots: torch.Tensor | None, ring_k: torch.Tensor | None, ring_v: torch.Tensor | None,
                  ring_g: torch.Tensor | None, ring_beta: torch.Tensor | None, scale: float,
                  lower_bound: float | None, norm_gate: torch.Tensor | None, norm_weight: torch.Tensor | None,
                  norm_eps: float, backend: str | None) -> None:
    run_mtp_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out,
                   optional_tuple(w_q, w_k, w_v), optional_tuple(cs_q, cs_k, cs_v), optional_tuple(ic_q, ic_k, ic_v),
                   optional_tuple(bias_q, bias_k, bias_v), snapshots, optional_tuple(ring_k, ring_v, ring_g, ring_beta),
                   scale, lower_bound, norm_gate, norm_weight, norm_eps, backend)


def mtp_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, *,
               conv_weights=None, conv_states=None, intermediate_conv=None, conv_bias=None,
               snapshots=None, rings=None, scale=None, lower_bound=None, norm_gate=None, norm_weight=None,
               norm_eps=1e-6, out=None, backend=None, full_checks=None):
    """Verify ``T = 1 + num_spec`` tokens per request without touching the persistent pools.

    ``q, k [N, T, H, K]``, ``v [N, T, HV, V]`` (pre-conv when ``conv_weights=(w_q, w_k, w_v)``
    is given, else already convolved), ``a [N, T, HV, K]`` raw gate, ``b [N, T, HV]`` raw
    beta (each contiguous, or a view whose ``N * T`` tokens lie one stride apart with dense heads,
    as splits of a packed projection are); ``state [slots, HV, V, K]`` and ``conv_states`` read-only; request ``n`` uses
    ``state[slot_indices[n]]`` and scratch row ``scratch_indices[n]``. Per step: a snapshot
    ``snapshots[row, t]`` or, with ``rings=(ring_k, ring_v, ring_g, ring_beta)``, the ring
    entries at ``[slot, :, t]``; windows to ``intermediate_conv[i][row, t]``. Returns
    ``out [N, T, HV, V]`` (optionally gated-RMSNormed with ``norm_gate``, ``norm_weight``).
    A request whose slot is past the pool, or whose scratch row is outside a scratch buffer
    the call writes, is a padding row (zero output, nothing written; counted, ``kdakit.take_errors``).
    """
    if out is None and q.dim() == 4 and v.dim() == 4:
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    check_mtp_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out,
                     conv_weights=conv_weights, conv_states=conv_states, intermediate_conv=intermediate_conv,
                     conv_bias=conv_bias, snapshots=snapshots, rings=rings, lower_bound=lower_bound,
                     norm_gate=norm_gate, norm_weight=norm_weight, full_checks=full_checks, strided_tokens=True)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mtp_verify_op(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out, conv_weights, conv_states,
                  intermediate_conv, conv_bias, snapshots, rings, scale, lower_bound, norm_gate, norm_weight, norm_eps,
                  backend)
    return out


def verify_example_inputs(g, T: int, steps: int, mode: str, device):
    """Inputs of a small verify (3 requests of ``T`` tokens, grouped value heads, the conv
    prologue, scratch and rings of ``steps`` rows, poisoned): ``(args, kw)`` for
    ``mtp_verify`` (``steps = T + 1``) and, with the parents appended, ``tree_verify``."""
    N, H, HV, K, V, W, slots, scratch = 3, 1, 2, 8, 16, 4, 5, 3
    bf16 = torch.bfloat16
    channels = (H * K, H * K, HV * V)
    args = (example_randn(g, N, T, H, K, dtype=bf16, device=device),
            example_randn(g, N, T, H, K, dtype=bf16, device=device),
            example_randn(g, N, T, HV, V, dtype=bf16, device=device),
            example_randn(g, N, T, HV, K, dtype=bf16, device=device),
            example_randn(g, N, T, HV, dtype=bf16, device=device), example_rand(g, HV, device=device),
            example_randn(g, HV * K, scale=0.5, device=device),
            example_randn(g, slots, HV, V, K, scale=0.5, device=device), example_index(4, -1, 1, device=device),
            example_index(0, 2, 1, device=device))
    kw = dict(conv_weights=tuple(example_randn(g, c, W, scale=0.5, device=device) for c in channels),
              conv_states=tuple(example_randn(g, slots, c, W - 1, dtype=bf16, device=device) for c in channels),
              intermediate_conv=tuple(torch.full((scratch, steps, c, W - 1), 7.0, dtype=bf16, device=device)
                                      for c in channels),
              lower_bound=-5.0)
    if mode == "snapshot":
        kw["snapshots"] = torch.full((scratch, steps, HV, V, K), 7.0, device=device)
        kw.update(conv_bias=tuple(example_randn(g, c, scale=0.1, device=device) for c in channels))
    else:
        kw["rings"] = (torch.full((slots, H, steps, K), 7.0, dtype=bf16, device=device),
                       torch.full((slots, HV, steps, V), 7.0, dtype=bf16, device=device),
                       torch.full((slots, HV, steps, K), 7.0, device=device),
                       torch.full((slots, HV, steps), 7.0, device=device))
        kw.update(norm_gate=example_randn(g, N, T, HV, V, dtype=bf16, device=device),
                  norm_weight=example_rand(g, V, device=device) + 0.5)
    return args, kw


@mtp_verify_op.register_example
def _example(seed, device="cpu", *, mode="snapshot", out=True):
    """``mode``: ``"snapshot"`` (conv bias too) or ``"ring"`` (the output norm too)."""
    T = 3
    args, kw = verify_example_inputs(example_rng(seed), T, T + 1, mode, device)
    if out:
        kw["out"] = torch.full((3, T, 2, 16), 7.0, dtype=torch.bfloat16, device=device)
    return mtp_verify, args, kw
