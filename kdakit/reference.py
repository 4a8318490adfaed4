"""The PyTorch reference of every KDA serving op, written as the math of docs/design.md.

Two jobs: it is the CPU backend of the public ops (``compute_dtype=float32``), and
the oracle every kernel test compares against (``compute_dtype=float64``). Every
function runs on any device. Pool-level functions update the pools they are
given in place, exactly where the op documents it, and nothing else.

Layouts (docs/design.md): state ``[slots, HV, V, K]`` V-major; conv window
``[slots, C, W-1]`` oldest first; a slot index ``< 0`` is a padding row. An index
outside its buffer (a slot past the pool, a scratch row or track slot outside its
buffer) makes a padding row too, as in the kernels, and is counted on the op's error
counter (``kdakit.errors``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import errors

L2_EPS = 1e-6


# ----------------------------------------------------------------------------
# The pieces of one token
# ----------------------------------------------------------------------------
def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x²) + eps)`` over the last dim."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^x)`` for ``x <= 20``, ``x`` above (the threshold kernels use)."""
    return torch.where(x <= 20.0, torch.log1p(torch.exp(torch.clamp(x, max=20.0))), x)


def kda_gate(a, A_log, dt_bias, lower_bound=None):
    """Log-decay ``g`` per key channel. ``a [..., HV, K]``, ``A_log [HV]``, ``dt_bias [HV, K]``.

    default: ``g = -exp(A_log) * softplus(a + dt_bias)``;
    safe gate (``lower_bound = L``): ``g = L * sigmoid(exp(A_log) * (a + dt_bias))``.
    """
    x = a + dt_bias
    A = torch.exp(A_log)[:, None]
    if lower_bound is None:
        return -A * softplus(x)
    return lower_bound * torch.sigmoid(A * x)


def kda_beta(b):
    """``β = sigmoid(b)``."""
    return torch.sigmoid(b)


def expand_to_value_heads(x, num_value_heads: int):
    """Grouped value attention: value head ``hv`` reads key head ``hv // (HV // H)``."""
    return x.repeat_interleave(num_value_heads // x.shape[-2], dim=-2)


def delta_rule_step(S, q, k, v, g, beta):
    """One token of the gated delta rule on a V-major state.

    ``S [..., HV, V, K]``; ``q, k [..., HV, K]`` (already normalised and scaled);
    ``v [..., HV, V]``; ``g [..., HV, K]`` log-decay; ``beta [..., HV]``.
    Returns ``(o [..., HV, V], S_new)``.
    """
    S = S * torch.exp(g)[..., None, :]                               # S · diag(exp(g))
    u = beta[..., None] * (v - (S @ k[..., :, None])[..., 0])        # β (v − S k̂)
    S = S + u[..., :, None] * k[..., None, :]                        # S + u k̂ᵀ
    o = (S @ q[..., :, None])[..., 0]                                # S q̂
    return o, S


def prepare_qk(q, k, num_value_heads, scale, use_qk_l2norm=True):
    """L2 norm (when on), scale on q, and expansion of key heads to value heads."""
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return expand_to_value_heads(q * scale, num_value_heads), expand_to_value_heads(k, num_value_heads)


def conv_step(x, window, weight, bias=None, activation_dtype=None, silu=True):
    """Causal short conv of one token with SiLU (none when ``silu=False``).

    ``x [..., C]``; ``window [..., C, W-1]`` (oldest first); ``weight [C, W]``.
    Returns ``(y [..., C], new_window)``; ``y`` is rounded to ``activation_dtype``
    (as an unfused conv kernel stores it) and returned in the compute dtype.
    """
    y = (window * weight[:, :-1]).sum(-1) + weight[:, -1] * x
    if bias is not None:
        y = y + bias
    if silu:
        y = F.silu(y)
    if activation_dtype is not None:
        y = y.to(activation_dtype).to(x.dtype)
    return y, torch.cat([window[..., 1:], x[..., None]], dim=-1)


def gated_rmsnorm(o, gate, weight, eps: float = 1e-6):
    """``y = o · rsqrt(mean(o²) + eps) · w · sigmoid(gate)`` over the last dim."""
    return o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * weight * torch.sigmoid(gate)


def split_packed_qkv(mixed, H, K, HV, V):
    """``[..., 2*H*K + HV*V]`` -> q ``[..., H, K]``, k ``[..., H, K]``, v ``[..., HV, V]``."""
    lead = mixed.shape[:-1]
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    return q.reshape(*lead, H, K), k.reshape(*lead, H, K), v.reshape(*lead, HV, V)


def infer_packed_heads(qkv_dim: int, HV: int, V: int, K: int) -> int:
    """H from the packed width ``2*H*K + HV*V`` (the op's input checks ran first)."""
    return (qkv_dim - HV * V) // 2 // K


def _default_scale(scale, K):
    return K ** -0.5 if scale is None else scale


def _live(slot_indices, num_slots, op, inside=None):
    """Positions of the rows that are not padding, and their slots. A row whose slot is past
    the pool (``num_slots``), or whose other indices are not ``inside``, is padding too,
    counted on ``op``'s error counter."""
    claimed = slot_indices >= 0
    ok = slot_indices < num_slots
    if inside is not None:
        ok = ok & inside
    errors.count(op, claimed & ~ok)
    rows = torch.nonzero(claimed & ok).flatten()
    return rows, slot_indices[rows].long()


def _in_range(index, count):
    """``0 <= index < count`` elementwise."""
    return (index >= 0) & (index < count)


# ----------------------------------------------------------------------------
# Ops over state pools (the CPU backend and the oracle)
# ----------------------------------------------------------------------------
def packed_decode(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out, *,
                  scale=None, use_qk_l2norm=True, lower_bound=None, compute_dtype=torch.float32):
    """One token per request; ``state[slot_indices[i]]`` updated in place; ``out [B, 1, HV, V]``."""
    _, HV, V, K = state.shape
    H = infer_packed_heads(mixed_qkv.shape[-1], HV, V, K)
    cd = compute_dtype
    rows, slots = _live(slot_indices, state.shape[0], "packed_decode")
    q, k, v = split_packed_qkv(mixed_qkv[rows].to(cd), H, K, HV, V)
    q, k = prepare_qk(q, k, HV, _default_scale(scale, K), use_qk_l2norm)
    g = kda_gate(a[rows].to(cd).view(-1, HV, K), A_log.to(cd), dt_bias.to(cd).view(HV, K), lower_bound)
    o, S = delta_rule_step(state[slots].to(cd), q, k, v, g, kda_beta(b[rows].to(cd)))
    state[slots] = S.to(state.dtype)
    out.zero_()
    out[rows, 0] = o.to(out.dtype)
    return out


def causal_conv1d_update(x, conv_state, weight, slot_indices, out, *, bias=None, compute_dtype=torch.float32):
    """Short conv of one token per request with SiLU; ``conv_state[slot]`` shifted in place."""
    cd = compute_dtype
    rows, slots = _live(slot_indices, conv_state.shape[0], "causal_conv1d_update")
    y, window = conv_step(x[rows].to(cd), conv_state[slots].to(cd), weight.to(cd),
                          None if bias is None else bias.to(cd), activation_dtype=out.dtype)
    conv_state[slots] = window.to(conv_state.dtype)
    out.zero_()
    out[rows] = y.to(out.dtype)
    return out


def causal_conv1d_varlen(x, conv_state, weight, cu_seqlens, slot_indices, out, *, has_initial_state=None,
                         bias=None, activation=True, compute_dtype=torch.float32):
    """Short conv (SiLU when ``activation``) of the tokens ``x [T, C]`` of ``N`` sequences split by
    ``cu_seqlens [N+1]``; ``out [T, C]`` gets every token's output, rounded to ``out``'s dtype.

    Sequence ``n`` (tokens ``cu_seqlens[n] .. cu_seqlens[n+1]``) starts from the window
    ``conv_state[slot]``, ``slot = slot_indices[n]``, when the slot is in the pool (``0 <= slot <
    slots``) and ``has_initial_state[n]`` (all True when not given); from zeros otherwise. Then the
    slot, when in the pool, holds the last ``W-1`` entries of ``[starting window, the sequence's
    inputs]`` (the window shifted by the sequence's length). A slot outside the pool (< 0:
    padding) is neither read nor written; a sequence of length 0 writes nothing. A slot past
    the pool of a sequence with tokens is counted.
    """
    cd = compute_dtype
    C, W = weight.shape
    num_slots = conv_state.shape[0]
    bounds = cu_seqlens.tolist()
    slots = slot_indices.tolist()
    starts_from_slot = [True] * len(slots) if has_initial_state is None else has_initial_state.tolist()
    w = weight.to(cd)
    b = None if bias is None else bias.to(cd)
    T = x.shape[0]
    bad = 0
    for n, slot in enumerate(slots):
        s, e = max(bounds[n], 0), min(bounds[n + 1], T)  # offsets outside [0, T] (unchecked by default) clip
        if e <= s:
            continue
        in_pool = 0 <= slot < num_slots
        bad += slot >= num_slots
        if in_pool and starts_from_slot[n]:
            window = conv_state[slot].to(cd)                                  # [C, W-1], oldest first
        else:
            window = torch.zeros(C, W - 1, dtype=cd, device=x.device)
        # Token by token, as the math reads (and as a chain of one-token updates computes it,
        # bit for bit: PyTorch's vectorised SiLU rounds by a tensor's shape, so no batching).
        for t in range(s, e):
            y, window = conv_step(x[t:t + 1].to(cd), window[None], w, b, activation_dtype=out.dtype, silu=activation)
            window = window[0]
            out[t] = y[0].to(out.dtype)
        if in_pool:
            conv_state[slot] = window.to(conv_state.dtype)
    errors.count("causal_conv1d_varlen", torch.ones(bad, dtype=torch.bool, device=conv_state.device))
    return out


def fused_decode(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, *,
                 conv_bias=None, scale=None, lower_bound=None, norm_gate=None, norm_weight=None,
                 norm_eps=1e-6, compute_dtype=torch.float32):
    """Conv update + packed decode (L2 norm on) + optional gated RMSNorm, for one token."""
    cd = compute_dtype
    _, HV, V, K = state.shape
    rows, slots = _live(slot_indices, min(state.shape[0], conv_state.shape[0]), "fused_decode")
    mixed, window = conv_step(qkv[rows].to(cd), conv_state[slots].to(cd), conv_weight.to(cd),
                              None if conv_bias is None else conv_bias.to(cd), activation_dtype=qkv.dtype)
    H = infer_packed_heads(qkv.shape[-1], HV, V, K)
    q, k, v = split_packed_qkv(mixed, H, K, HV, V)
    q, k = prepare_qk(q, k, HV, _default_scale(scale, K), True)
    g = kda_gate(a[rows].to(cd).view(-1, HV, K), A_log.to(cd), dt_bias.to(cd).view(HV, K), lower_bound)
    o, S = delta_rule_step(state[slots].to(cd), q, k, v, g, kda_beta(b[rows].to(cd)))
    if norm_weight is not None:
        o = gated_rmsnorm(o, norm_gate[rows].to(cd).view(-1, HV, V), norm_weight.to(cd), norm_eps)
    state[slots] = S.to(state.dtype)
    conv_state[slots] = window.to(conv_state.dtype)
    out.zero_()
    out[rows, 0] = o.to(out.dtype)
    return out


def _clamped_offsets(bounds, T):
    """Each sequence's (start, end) as the kernels read offsets, which are data checked only in
    full-check mode: clamped into [0, T], the end at least the start."""
    spans = []
    for n in range(len(bounds) - 1):
        start = min(max(int(bounds[n]), 0), T)
        spans.append((start, min(max(int(bounds[n + 1]), start), T)))
    return spans


def recurrent_forward(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens=None, scale=None,
                      use_qk_l2norm=True, A_log=None, dt_bias=None, lower_bound=None, beta_is_logit=False,
                      num_accepted_tokens=None, token_states=None, write_final_state=True, final_states=None,
                      padding_rows=True, compute_dtype=torch.float32):
    """Varlen multi-token forward over ``[1, T, ...]`` inputs split by ``cu_seqlens``.

    ``g`` is the log-decay, or the raw gate when ``A_log`` is given (gate in kernel);
    ``beta`` is β, or its logit when ``beta_is_logit``. A sequence whose (starting) slot
    is < 0 is a padding row: its outputs, token states and final state are zeros and the
    pool is not touched. With ``padding_rows=False`` (fla's ``initial_state=None``) it
    instead starts from a zero state, computes its outputs, and writes no pool slot.

    - 1-D ``slot_indices [N]``: sequence ``n`` starts from ``state[slot_indices[n]]``;
      its final state is written back there when ``write_final_state``.
    - 2-D ``slot_indices [N, T_max]`` (speculative serving): sequence ``n`` starts from
      ``state[slot_indices[n, num_accepted_tokens[n] - 1]]`` (``[n, 0]`` without
      ``num_accepted_tokens``); the state after its token ``i`` (0-based within the
      sequence) is written to ``state[slot_indices[n, i]]`` when ``write_final_state``.

    ``token_states [T, HV, V, K]``, when given, receives the state after every token;
    ``final_states [N, HV, V, K]``, when given, sequence ``n``'s final state.
    """
    cd = compute_dtype
    _, T, H, K = q.shape
    HV, V = v.shape[-2:]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    scale = _default_scale(scale, K)
    spans = _clamped_offsets(cu_seqlens.tolist(), T)
    per_token_slots = slot_indices.dim() == 2
    num_slots = state.shape[0]
    bad = 0
    for n, (bos, eos) in enumerate(spans):
        if per_token_slots:
            cols = slot_indices.shape[1]
            start = 0 if num_accepted_tokens is None else int(num_accepted_tokens[n]) - 1
            slot = int(slot_indices[n, start]) if 0 <= start < cols else num_slots
        else:
            slot = int(slot_indices[n])
        # Slots past the pool (the start, or any slot the sequence writes): a padding row, counted.
        in_pool = slot < num_slots
        if per_token_slots and write_final_state:
            length = eos - bos
            in_pool = in_pool and length <= cols and all(int(s) < num_slots for s in slot_indices[n, :length])
        used = slot >= 0 or not padding_rows
        bad += used and not in_pool
        if not (used and in_pool):
            out[0, bos:eos] = 0
            if token_states is not None:
                token_states[bos:eos] = 0
            if final_states is not None:
                final_states[n] = 0
            continue
        S = state[slot].to(cd) if slot >= 0 else torch.zeros(HV, V, K, dtype=cd, device=q.device)
        for i, t in enumerate(range(bos, eos)):
            qt, kt = prepare_qk(q[0, t].to(cd), k[0, t].to(cd), HV, scale, use_qk_l2norm)
            gt = g[0, t].to(cd)
            if A_log is not None:
                gt = kda_gate(gt, A_log.to(cd), dt_bias.to(cd).view(HV, K), lower_bound)
            bt = kda_beta(beta[0, t].to(cd)) if beta_is_logit else beta[0, t].to(cd)
            o, S = delta_rule_step(S, qt, kt, v[0, t].to(cd), gt, bt)
            out[0, t] = o.to(out.dtype)
            if token_states is not None:
                token_states[t] = S.to(token_states.dtype)
            if per_token_slots and write_final_state and int(slot_indices[n, i]) >= 0:
                state[int(slot_indices[n, i])] = S.to(state.dtype)
        if not per_token_slots and write_final_state and slot >= 0:
            state[slot] = S.to(state.dtype)
        if final_states is not None:
            final_states[n] = S.to(final_states.dtype)
    errors.count("recurrent_forward", torch.ones(bad, dtype=torch.bool, device=state.device))
    return out


def mtp_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out, *,
               conv_weights=None, conv_states=None, intermediate_conv=None, conv_bias=None,
               snapshots=None, rings=None, scale=None, lower_bound=None, norm_gate=None,
               norm_weight=None, norm_eps=1e-6, compute_dtype=torch.float32):
    """Speculative verify of ``T = 1 + num_spec`` dense tokens per request.

    ``q, k [N, T, H, K]``, ``v [N, T, HV, V]``, ``a [N, T, HV, K]`` raw gate,
    ``b [N, T, HV]`` raw beta, ``out [N, T, HV, V]``. The persistent ``state`` and
    ``conv_states`` are only read. With ``conv_weights = (w_q, w_k, w_v)`` the inputs
    are pre-conv and the windows after step t go to ``intermediate_conv[i][row, t]``.
    After step t: ``snapshots[row, t] = S`` or, with ``rings = (ring_k, ring_v,
    ring_g, ring_beta)``, the step's post-conv k (before L2 norm), v, g and β at
    ring position t of the request's slot. Padding rows (slot < 0): zero output.
    """
    cd = compute_dtype
    N, T, H, K = q.shape
    HV, V = v.shape[-2:]
    scale = _default_scale(scale, K)
    act = q.dtype
    out.zero_()
    scratch_bufs = ([snapshots] if rings is None and snapshots is not None else []) + (
        list(intermediate_conv) if conv_weights is not None else [])
    inside = _in_range(scratch_indices, min(t.shape[0] for t in scratch_bufs)) if scratch_bufs else None
    rows, slots = _live(slot_indices, state.shape[0], "mtp_verify", inside)
    if len(rows) == 0:
        return out
    scratch = scratch_indices[rows].long()
    S = state[slots].to(cd)
    xs = [q[rows].to(cd).flatten(2), k[rows].to(cd).flatten(2), v[rows].to(cd).flatten(2)]
    if conv_weights is not None:
        windows = [cs[slots].to(cd) for cs in conv_states]
        biases = conv_bias if conv_bias is not None else (None, None, None)
    for t in range(T):
        x_t = [x[:, t] for x in xs]
        if conv_weights is not None:
            for i in range(3):
                x_t[i], windows[i] = conv_step(x_t[i], windows[i], conv_weights[i].to(cd),
                                               None if biases[i] is None else biases[i].to(cd),
                                               activation_dtype=act)
                intermediate_conv[i][scratch, t] = windows[i].to(intermediate_conv[i].dtype)
        k_raw = x_t[1].view(-1, H, K)
        v_t = x_t[2].view(-1, HV, V)
        qh, kh = prepare_qk(x_t[0].view(-1, H, K), k_raw, HV, scale, True)
        g_t = kda_gate(a[rows, t].to(cd), A_log.to(cd), dt_bias.to(cd).view(HV, K), lower_bound)
        beta_t = kda_beta(b[rows, t].to(cd))
        o, S = delta_rule_step(S, qh, kh, v_t, g_t, beta_t)
        if norm_weight is not None:
            o = gated_rmsnorm(o, norm_gate[rows, t].to(cd).view(-1, HV, V), norm_weight.to(cd), norm_eps)
        out[rows, t] = o.to(out.dtype)
        if rings is not None:
            ring_k, ring_v, ring_g, ring_beta = rings
            ring_k[slots, :, t] = k_raw.to(ring_k.dtype)
            ring_v[slots, :, t] = v_t.to(ring_v.dtype)
            ring_g[slots, :, t] = g_t.to(ring_g.dtype)
            ring_beta[slots, :, t] = beta_t.to(ring_beta.dtype)
        elif snapshots is not None:
            snapshots[scratch, t] = S.to(snapshots.dtype)
    return out


def commit_snapshots(state, snapshots, slot_indices, scratch_indices, accepted_steps, *,
                     conv_states=None, intermediate_conv=None):
    """For each request with ``accepted_steps[n] >= 0`` and a live slot: copy snapshot
    ``[row, s]`` (state, and conv windows when given) into its slot. A row whose slot, row or
    step is outside any pool or scratch buffer of the commit is not committed (counted)."""
    dst = ([state] if snapshots is not None else []) + list(conv_states or ())
    src = ([snapshots] if snapshots is not None else []) + list(intermediate_conv or ())
    claimed = (slot_indices >= 0) & (accepted_steps >= 0)
    inside = ((slot_indices < min(t.shape[0] for t in dst)) & _in_range(scratch_indices, min(t.shape[0] for t in src))
              & (accepted_steps < min(t.shape[1] for t in src)))
    errors.count("commit_snapshots", claimed & ~inside)
    keep = torch.nonzero(claimed & inside).flatten()
    slots = slot_indices[keep].long()
    scratch = scratch_indices[keep].long()
    steps = accepted_steps[keep].long()
    if snapshots is not None:
        state[slots] = snapshots[scratch, steps].to(state.dtype)
    if conv_states is not None:
        for pool, inter in zip(conv_states, intermediate_conv):
            pool[slots] = inter[scratch, steps].to(pool.dtype)


def commit_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, *,
                track_slots=None, track_steps=None, use_qk_l2norm=True, null_block_id=-1,
                compute_dtype=torch.float32, count_errors=True):
    """Fold the accepted prefix (``accept_lens[n]`` steps, bonus token included) from the
    rings into ``state[slot]`` in place. When ``track_slots`` is given and
    ``0 <= track_steps[n] < accept_lens[n]``, the state after step ``track_steps[n]``
    also goes to ``state[track_slots[n]]``. Rows with slot ``<= null_block_id`` or
    ``accept_lens <= 0`` are skipped, and so are rows whose slot or (used) track slot is past
    the pool (counted when ``count_errors``). At most the rings' ``L`` steps are folded."""
    cd = compute_dtype
    HV, K = ring_g.shape[1], ring_g.shape[3]
    num_slots, ring_len = state.shape[0], ring_g.shape[2]
    bad = 0
    for n in range(slot_indices.shape[0]):
        slot, steps = int(slot_indices[n]), min(int(accept_lens[n]), ring_len)
        if slot <= null_block_id or slot < 0:
            continue
        track_slot = int(track_slots[n]) if track_slots is not None else -1
        if slot >= num_slots or (track_slot > null_block_id and track_slot >= num_slots):
            bad += 1
            continue
        if steps <= 0:
            continue
        S = state[slot].to(cd)
        track = int(track_steps[n]) if track_slots is not None else -1
        for t in range(steps):
            k_t = ring_k[slot, :, t].to(cd)
            if use_qk_l2norm:
                k_t = l2_normalize(k_t)
            k_t = expand_to_value_heads(k_t, HV)
            _, S = delta_rule_step(S, torch.zeros_like(k_t), k_t, ring_v[slot, :, t].to(cd),
                                   ring_g[slot, :, t].to(cd), ring_beta[slot, :, t].to(cd))
            if t == track and track_slot > null_block_id and track_slot >= 0:
                state[track_slot] = S.to(state.dtype)
        state[slot] = S.to(state.dtype)
    if count_errors:
        errors.count("commit_ring", torch.ones(bad, dtype=torch.bool, device=state.device))
    del K


def gated_rmsnorm_op(x, gate, weight, out, *, eps=1e-6, compute_dtype=torch.float32):
    """Gated RMSNorm over the last dim of ``x``; writes ``out``."""
    cd = compute_dtype
    out.copy_(gated_rmsnorm(x.to(cd), gate.to(cd), weight.to(cd), eps).to(out.dtype))
    return out


# ----------------------------------------------------------------------------
# Tree verify (speculative trees, snapshot mode)
# ----------------------------------------------------------------------------
def tree_parent(parents_row, t: int) -> int:
    """Node ``t``'s effective parent: -1 (the committed state and window) for node 0, for
    ``p = -1`` and for an invalid ``p`` (``p >= t`` or ``p < -1``); ``p`` otherwise."""
    if t == 0:
        return -1
    p = int(parents_row[t])
    return p if -1 <= p < t else -1


def tree_conv(x, window, weight, parents_row, bias=None, activation_dtype=None):
    """The short conv of one request's tree of ``T`` nodes. ``x [T, C]`` pre-conv inputs,
    ``window [C, W-1]`` the committed window, ``parents_row [T]``. Node ``t``'s window is
    its parent's window after the parent (the committed one for a root) shifted by one with
    ``x[t]`` appended. Returns ``(y [T, C], windows [T, C, W-1])``: the post-conv values and
    the window after each node."""
    ys, windows = [], []
    for t in range(x.shape[0]):
        p = tree_parent(parents_row, t)
        y, win = conv_step(x[t], window if p < 0 else windows[p], weight, bias, activation_dtype)
        ys.append(y)
        windows.append(win)
    return torch.stack(ys), torch.stack(windows)


def tree_verify(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out, *,
                conv_weights=None, conv_states=None, intermediate_conv=None, conv_bias=None, snapshots=None,
                rings=None, scale=None, lower_bound=None, norm_gate=None, norm_weight=None, norm_eps=1e-6,
                compute_dtype=torch.float32):
    """Verify a tree of ``T`` nodes per request (layouts of ``mtp_verify``; ``parents [N, T]``).

    Node 0 starts from ``state[slot]`` (and the committed conv windows), node ``t > 0`` from
    the post-state (and windows) of node ``p = tree_parent(parents[n], t)``, or from the
    committed ones when ``p = -1``. Each node applies its own token with the one-token math;
    its post-state goes to ``snapshots[row, t]``, its windows to ``intermediate_conv[i][row, t]``.
    With ``rings = (ring_k, ring_v, ring_g, ring_beta)`` (ring mode, no snapshots) node ``t``'s
    post-conv k (before its L2 norm), v, log-decay g and β go to ring position ``t`` of the
    slot instead. A request whose slot or scratch row falls outside its buffer is a padding
    row: zero output, nothing read or written (counted once per request with a slot >= 0); each
    invalid parent of a live request is counted too. The persistent pools are only read.
    """
    cd = compute_dtype
    N, T, H, K = q.shape
    HV, V = v.shape[-2:]
    scale = _default_scale(scale, K)
    act = q.dtype
    rows_in = [t.shape[0] for t in ([snapshots] if snapshots is not None else []) + list(intermediate_conv or ())]
    num_rows = min(rows_in) if rows_in else None
    out.zero_()
    A, dt = A_log.to(cd), dt_bias.to(cd).view(HV, K)
    bad = 0
    for n in range(N):
        slot, row = int(slot_indices[n]), int(scratch_indices[n])
        if not 0 <= slot < state.shape[0] or (num_rows is not None and not 0 <= row < num_rows):
            bad += slot >= 0  # a claimed slot with an index outside its buffer: counted
            continue  # a padding row
        bad += sum(not -1 <= int(parents[n, t]) < t for t in range(1, T))  # invalid parents: counted
        x = [q[n].to(cd).flatten(1), k[n].to(cd).flatten(1), v[n].to(cd).flatten(1)]   # [T, C] each
        if conv_weights is not None:
            for i in range(3):
                bias = None if conv_bias is None else conv_bias[i].to(cd)
                x[i], windows = tree_conv(x[i], conv_states[i][slot].to(cd), conv_weights[i].to(cd), parents[n],
                                          bias, activation_dtype=act)
                intermediate_conv[i][row, :T] = windows.to(intermediate_conv[i].dtype)
        post = []
        for t in range(T):
            p = tree_parent(parents[n], t)
            S = state[slot].to(cd) if p < 0 else post[p]
            qh, kh = prepare_qk(x[0][t].view(H, K), x[1][t].view(H, K), HV, scale, True)
            g_t = kda_gate(a[n, t].to(cd), A, dt, lower_bound)
            o, S = delta_rule_step(S, qh, kh, x[2][t].view(HV, V), g_t, kda_beta(b[n, t].to(cd)))
            if norm_weight is not None:
                o = gated_rmsnorm(o, norm_gate[n, t].to(cd).view(HV, V), norm_weight.to(cd), norm_eps)
            out[n, t] = o.to(out.dtype)
            post.append(S)
            if rings is not None:
                ring_k, ring_v, ring_g, ring_beta = rings
                ring_k[slot, :, t] = x[1][t].view(H, K).to(ring_k.dtype)
                ring_v[slot, :, t] = x[2][t].view(HV, V).to(ring_v.dtype)
                ring_g[slot, :, t] = g_t.to(ring_g.dtype)
                ring_beta[slot, :, t] = kda_beta(b[n, t].to(cd)).to(ring_beta.dtype)
            elif snapshots is not None:
                snapshots[row, t] = S.to(snapshots.dtype)
    errors.count("tree_verify", torch.ones(bad, dtype=torch.bool, device=state.device))
    return out


def commit_tree_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, *,
                     use_qk_l2norm=True, null_block_id=-1, compute_dtype=torch.float32):
    """Fold the accepted path of a ring-mode tree verify into ``state[slot]`` in place: the
    ring entries of nodes ``paths[n, 0 .. accept_lens[n] - 1]`` (node ids, root first), in
    order. Rows with slot ``<= null_block_id`` (or outside the pool), ``accept_lens <= 0``, or
    a path node outside the rings are skipped; a claimed slot past the pool, or an accepted
    path with a node outside the rings, is counted once per request."""
    cd = compute_dtype
    HV, L = ring_g.shape[1], ring_g.shape[2]
    bad = 0
    for n in range(slot_indices.shape[0]):
        slot, steps = int(slot_indices[n]), min(int(accept_lens[n]), paths.shape[1])
        nodes = [int(x) for x in paths[n, :max(steps, 0)]]
        if slot <= null_block_id or slot < 0:
            continue
        if slot >= state.shape[0] or (steps > 0 and not all(0 <= x < L for x in nodes)):
            bad += 1  # counted once per request
            continue
        if steps <= 0:
            continue
        S = state[slot].to(cd)
        for t in nodes:
            k_t = ring_k[slot, :, t].to(cd)
            if use_qk_l2norm:
                k_t = l2_normalize(k_t)
            k_t = expand_to_value_heads(k_t, HV)
            _, S = delta_rule_step(S, torch.zeros_like(k_t), k_t, ring_v[slot, :, t].to(cd),
                                   ring_g[slot, :, t].to(cd), ring_beta[slot, :, t].to(cd))
        state[slot] = S.to(state.dtype)
    errors.count("commit_tree_ring", torch.ones(bad, dtype=torch.bool, device=state.device))


def chunk_prefill(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens=None, scale=None, use_qk_l2norm=True,
                  A_log=None, dt_bias=None, lower_bound=None, beta_is_logit=False, has_initial_state=None,
                  chunk_states=None, chunk_state_indices=None, chunk_size=64, compute_dtype=torch.float32):
    """The chunked prefill's contract, computed token by token (the recurrence is the oracle).

    Sequence ``n`` of ``cu_seqlens`` starts from ``state[slot_indices[n]]`` (zeros when
    ``has_initial_state[n]`` is False) and its final state goes back there. A slot < 0 or
    >= the pool's slot count is a padding row: zero outputs, nothing read or written.
    With ``chunk_states``, the state after the sequence's first ``(j+1) * chunk_size``
    tokens goes to ``chunk_states[chunk_state_indices[n, j]]`` when that row is in range.
    Counted: each slot past the pool, and each such row past ``chunk_states`` (a row < 0 is
    "not written", uncounted).
    Rows of ``out`` of tokens outside ``cu_seqlens`` are not written.
    """
    cd = compute_dtype
    _, T, H, K = q.shape
    HV, V = v.shape[-2:]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    scale = _default_scale(scale, K)
    bounds = cu_seqlens.tolist()
    num_slots = state.shape[0]
    bad = 0
    for n in range(len(bounds) - 1):
        slot = int(slot_indices[n])
        if not 0 <= slot < num_slots:
            out[0, bounds[n]:bounds[n + 1]] = 0
            bad += slot >= num_slots
            continue
        fresh = has_initial_state is not None and not bool(has_initial_state[n])
        S = torch.zeros(HV, V, K, dtype=cd, device=q.device) if fresh else state[slot].to(cd)
        for i, t in enumerate(range(bounds[n], bounds[n + 1])):
            qt, kt = prepare_qk(q[0, t].to(cd), k[0, t].to(cd), HV, scale, use_qk_l2norm)
            gt = g[0, t].to(cd)
            if A_log is not None:
                gt = kda_gate(gt, A_log.to(cd), dt_bias.to(cd).view(HV, K), lower_bound)
            bt = kda_beta(beta[0, t].to(cd)) if beta_is_logit else beta[0, t].to(cd)
            o, S = delta_rule_step(S, qt, kt, v[0, t].to(cd), gt, bt)
            out[0, t] = o.to(out.dtype)
            j, boundary = divmod(i + 1, chunk_size)
            if chunk_states is not None and boundary == 0 and j - 1 < chunk_state_indices.shape[1]:
                row = int(chunk_state_indices[n, j - 1])
                if 0 <= row < chunk_states.shape[0]:
                    chunk_states[row] = S.to(chunk_states.dtype)
                bad += row >= chunk_states.shape[0]
        state[slot] = S.to(state.dtype)
    errors.count("chunk_prefill", torch.ones(bad, dtype=torch.bool, device=state.device))
    return out
