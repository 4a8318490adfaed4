"""sglang's tree target-verify entry points for KDA layers (EAGLE top-k > 1), as drop-ins:
same names, keyword names and defaults, returns.

- ``causal_conv1d_update(x, conv_state, weight, ...)`` with ``retrieve_next_token`` /
  ``retrieve_next_sibling`` (sglang's first-child / next-sibling links): derives each node's
  parent the way sglang does (in node order: a node's first child gets the node, its next
  sibling the node's parent), writes them to ``retrieve_parent_token`` when given, and runs
  kdakit's tree conv (``ops/tree_conv.py``): each node's window from its ancestor path, the
  window after each node in ``intermediate_conv_window[intermediate_state_indices[n], t]``.
  Unlike a one-token conv update it leaves ``conv_state`` as it is (the commit of the
  accepted node copies its window), as every kdakit verify does.
- ``fused_sigmoid_gating_delta_rule_update(...)`` with ``is_kda=True`` in target-verify
  mode (``intermediate_states_buffer``, ``intermediate_state_indices``,
  ``disable_state_update=True``): ``kdakit.tree_verify`` in snapshot mode with
  ``retrieve_parent_token`` as the parents (node 0 always from the committed state), or, when
  it is None, ``kdakit.mtp_verify`` (the chain kernel) on the caller's q, k, v, a, b views as
  they are (one token stride each: no copies).

Modes kdakit does not implement raise a ValueError that says so (plain decode and
prefill have their own kdakit entries; ``match_cutedsl_decode=True``, sglang's bit-parity
decode). ``causal_conv1d_update``'s ``metadata`` and ``validate_data`` are accepted and
unused, as in sglang's Triton version. A padding row (slot < 0) gives zeros, as kdakit's
contract says, where sglang's kernels compute it from a zero state.
"""
from __future__ import annotations

import torch

from .. import reference
from ..backends import forced_backend, triton_runs_on
from ..ops.conv1d_update import causal_conv1d_update as _conv_update_one_token
from ..ops.tree_conv import tree_conv_channels
from ..ops.mtp_verify import mtp_verify
from ..ops.tree_verify import tree_verify

PAD_SLOT_ID = -1


def _parents_from_links(retrieve_next_token, retrieve_next_sibling, T):
    """sglang's parent of every node from its first-child and next-sibling links, in node
    order (node 0's entry 0, never read); links outside [0, T) are ignored. No host sync."""
    N = retrieve_next_token.shape[0]
    dev = retrieve_next_token.device
    parents = torch.zeros(N, T + 1, dtype=torch.int32, device=dev)   # column T: a sink for no-links
    rows = torch.arange(N, device=dev)
    node_ids = torch.arange(T, dtype=torch.int32, device=dev)
    for t in range(T):
        child = retrieve_next_token[:, t].long()
        parents[rows, torch.where((child >= 0) & (child < T), child, T)] = node_ids[t]
        sib = retrieve_next_sibling[:, t].long()
        parents[rows, torch.where((sib >= 0) & (sib < T), sib, T)] = parents[:, t]
    return parents[:, :T].contiguous()


def _use_triton(device) -> bool:
    """The backend rule of every kdakit op (backends.select): Triton on CUDA, the reference on
    CPU, ``KDAKIT_BACKEND`` forcing either."""
    forced = forced_backend()
    if forced == "triton":
        return triton_runs_on(device)
    return forced != "reference" and device.type == "cuda"


def _tree_conv_reference(x, conv_state, weight, bias, intermediate, slots, rows, parents):
    """reference.tree_conv per request (float32); padding rows (slot or row outside its
    buffer) give zeros and touch nothing."""
    post = torch.zeros_like(x)
    for n in range(x.shape[0]):
        slot, row = int(slots[n]), int(rows[n])
        if not (0 <= slot < conv_state.shape[0] and 0 <= row < intermediate.shape[0]):
            continue
        y, windows = reference.tree_conv(x[n].float(), conv_state[slot].float(), weight, parents[n], bias,
                                         activation_dtype=x.dtype)
        post[n] = y.to(x.dtype)
        intermediate[row, :x.shape[1]] = windows.to(intermediate.dtype)
    return post


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None,
                         intermediate_state_indices=None, retrieve_next_token=None, retrieve_next_sibling=None,
                         retrieve_parent_token=None, pad_slot_id=PAD_SLOT_ID, metadata=None, validate_data=False):
    """``x [batch, dim, seqlen]`` (or ``[batch, dim]``); returns the post-conv values shaped
    like ``x``. Tree target verify when ``retrieve_next_token`` is given (a chain of
    ``seqlen`` nodes with ``intermediate_conv_window`` and no links); one token otherwise."""
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    if activation not in ("silu", "swish"):
        raise ValueError(f"kdakit's causal_conv1d_update applies SiLU; activation={activation!r} is not supported.")
    if cache_seqlens is not None or num_accept_tokens is not None:
        raise ValueError("kdakit's causal_conv1d_update has no circular conv state (`cache_seqlens`) or "
             "`num_accept_tokens` window offset; commit the accepted node's window instead.")
    if pad_slot_id != PAD_SLOT_ID:
        raise ValueError(f"kdakit's padding slot id is {PAD_SLOT_ID} (got pad_slot_id={pad_slot_id}).")
    unsqueeze = x.dim() == 2
    if unsqueeze:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    slots = conv_state_indices if conv_state_indices is not None else torch.arange(
        batch, dtype=torch.int32, device=x.device)
    weight = weight.float().contiguous()
    bias = bias.float().contiguous() if bias is not None else None
    if (retrieve_next_token is None) != (retrieve_next_sibling is None):
        raise ValueError("a tree needs `retrieve_next_token` and `retrieve_next_sibling` together.")
    if retrieve_next_token is None and intermediate_conv_window is None:
        if seqlen != 1:
            raise ValueError(f"without `intermediate_conv_window` kdakit's causal_conv1d_update takes one token (got seqlen={seqlen}).")
        out = _conv_update_one_token(x[..., 0], conv_state, weight, slots, bias=bias)
        return out if unsqueeze else out.unsqueeze(-1)
    if intermediate_conv_window is None or intermediate_state_indices is None:
        raise ValueError("tree target verify needs `intermediate_conv_window` and `intermediate_state_indices`.")
    W = weight.shape[1]
    ic = intermediate_conv_window
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (dim, W - 1):
        raise ValueError(f"`conv_state` must be [cache_lines, dim={dim}, W-1={W - 1}] (got {tuple(conv_state.shape)}).")
    if ic.dim() != 4 or ic.shape[1] < seqlen or tuple(ic.shape[2:]) != (dim, W - 1) or ic.stride(3) != 1 \
            or ic.stride(2) != W - 1:
        raise ValueError(f"`intermediate_conv_window` must be [scratch, >={seqlen}, {dim}, {W - 1}] with contiguous inner dims "
             f"(got {tuple(ic.shape)}).")
    if tuple(weight.shape) != (dim, W):
        raise ValueError(f"`weight` must be [dim={dim}, W] (got {tuple(weight.shape)}).")
    for name, t in (("conv_state_indices", slots), ("intermediate_state_indices", intermediate_state_indices)):
        if tuple(t.shape) != (batch,):
            raise ValueError(f"`{name}` must have shape ({batch},) (got {tuple(t.shape)}).")
    if retrieve_next_token is not None:
        for name, t in (("retrieve_next_token", retrieve_next_token), ("retrieve_next_sibling", retrieve_next_sibling)):
            if t.dim() != 2 or t.shape[0] != batch or t.shape[1] < seqlen:
                raise ValueError(f"`{name}` must be [batch={batch}, >={seqlen}] (got {tuple(t.shape)}).")
        parents = _parents_from_links(retrieve_next_token, retrieve_next_sibling, seqlen)
        if retrieve_parent_token is not None:
            retrieve_parent_token[:, :seqlen].copy_(parents)
    else:
        parents = (torch.arange(seqlen, dtype=torch.int32, device=x.device) - 1).expand(batch, seqlen).contiguous()
    x_tok = x.transpose(1, 2).contiguous()                     # [batch, seqlen, dim], token-major
    if _use_triton(x.device):
        post = tree_conv_channels(x_tok, conv_state, weight, bias, ic, slots, intermediate_state_indices, parents,
                                  num_rows=ic.shape[0])
    else:
        post = _tree_conv_reference(x_tok, conv_state, weight, bias, ic, slots, intermediate_state_indices, parents)
    out = post.transpose(1, 2)
    return out[..., 0] if unsqueeze else out


def fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                           initial_state_source, initial_state_indices, scale=None,
                                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, is_kda=False,
                                           lower_bound=None, disable_state_update=False,
                                           intermediate_states_buffer=None, intermediate_state_indices=None,
                                           cache_steps=None, retrieve_parent_token=None, cache_ring=False,
                                           replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None,
                                           replayssm_beta=None, match_cutedsl_decode=False):
    """KDA tree (or chain) target verify: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` post-conv
    (``B = 1`` with ``cu_seqlens`` of equal-length requests), ``a`` raw gate ``[.., HV*K]``,
    ``b [.., HV]``, state pool ``[slots, HV, V, K]`` (read only), node ``t``'s post-state to
    ``intermediate_states_buffer[intermediate_state_indices[n], t]``. Returns ``o`` shaped
    like ``v`` in ``q``'s dtype."""
    del cache_steps  # the buffer's own shape gives the step stride
    if match_cutedsl_decode:
        raise ValueError("kdakit does not support `match_cutedsl_decode=True` (sglang's bit-parity decode with "
                         "FlashInfer's CuTe DSL kernel); kdakit's drop-in covers target verify only.")
    if not is_kda:
        raise ValueError("kdakit implements the KDA form only (is_kda=True); gated delta net heads are not supported.")
    if not use_qk_l2norm_in_kernel:
        raise ValueError("kdakit's verify always L2-normalises q and k in kernel (KDA); use_qk_l2norm_in_kernel=False is not "
             "supported.")
    if lower_bound is None and (float(softplus_beta) != 1.0 or float(softplus_threshold) != 20.0):
        raise ValueError(f"kdakit's gate uses softplus with beta=1 and threshold=20 (got softplus_beta={softplus_beta}, "
             f"softplus_threshold={softplus_threshold}).")
    if intermediate_states_buffer is None or intermediate_state_indices is None or not disable_state_update:
        raise ValueError("kdakit's fused_sigmoid_gating_delta_rule_update covers target verify only: pass "
             "`intermediate_states_buffer`, `intermediate_state_indices` and disable_state_update=True (plain "
             "decode: kdakit.packed_decode / fused_decode; prefill: kdakit.recurrent_forward).")
    if cache_ring or any(r is not None for r in (replayssm_rawv, replayssm_rawk, replayssm_g, replayssm_beta)):
        raise ValueError("kdakit's tree verify drop-in keeps snapshots (intermediate_states_buffer); its ring mode is "
             "kdakit.tree_verify(rings=...) with kdakit.commit_tree_ring.")
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected q [B, T, H, K] and v [B, T, HV, V] (got {tuple(q.shape)}, {tuple(v.shape)}).")
    B, T_all, H, K = q.shape
    HV, V = v.shape[2:]
    if cu_seqlens is not None:
        N = cu_seqlens.numel() - 1
        if B != 1 or N <= 0 or T_all % N:
            raise ValueError(f"tree verify needs B = 1 and the same number of nodes per request with `cu_seqlens` "
                 f"(got B={B}, {T_all} tokens for N={N} requests).")
        T = T_all // N
    else:
        N, T = B, T_all
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if retrieve_parent_token is None:
        # A chain: kdakit's chain verify, on the caller's views as they are (sglang's q, k, v are
        # splits of its packed projection: one token stride, no copy).
        mtp_verify(q.reshape(N, T, H, K), k.reshape(N, T, H, K), v.reshape(N, T, HV, V), a.reshape(N, T, HV, K),
                   b.reshape(N, T, HV), A_log, dt_bias.reshape(-1), initial_state_source, initial_state_indices,
                   intermediate_state_indices, snapshots=intermediate_states_buffer, scale=scale,
                   lower_bound=lower_bound, out=out.view(N, T, HV, V))
        return out
    if retrieve_parent_token.dim() != 2 or retrieve_parent_token.shape[0] != N or \
            retrieve_parent_token.shape[1] < T:
        raise ValueError(f"`retrieve_parent_token` must be [N={N}, >={T}] (got {tuple(retrieve_parent_token.shape)}).")
    parents = retrieve_parent_token[:, :T].contiguous()
    tree_verify(q.reshape(N, T, H, K).contiguous(), k.reshape(N, T, H, K).contiguous(),
                v.reshape(N, T, HV, V).contiguous(), a.reshape(N, T, HV, K).contiguous(),
                b.reshape(N, T, HV).contiguous(), A_log, dt_bias.reshape(-1), initial_state_source,
                initial_state_indices, intermediate_state_indices, parents, out.view(N, T, HV, V),
                snapshots=intermediate_states_buffer, scale=scale, lower_bound=lower_bound)
    return out
