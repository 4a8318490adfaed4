"""sglang 0.5.23's KDA kernel functions: same names, parameters (positional order, keywords,
defaults), returns and error texts. A parameter sglang has and kdakit does not implement is
accepted only where ignoring it cannot change the result; otherwise it raises ValueError."""
from __future__ import annotations

import torch

from ..ops.commit import commit_ring
from ..ops.conv1d_varlen import causal_conv1d_varlen
from ..ops.mtp_verify import mtp_verify
from ..ops.packed_decode import packed_decode
from ..ops.packed_decode_helion import helion_fused_recurrent_kda_packed_decode  # noqa: F401  (re-exported)


def fused_recurrent_kda_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                      ssm_state_indices, use_qk_l2norm_in_kernel=False, lower_bound=None):
    """Packed decode into the caller's ``out`` and ``initial_state``; returns both."""
    packed_decode(mixed_qkv, a, b, A_log, dt_bias, initial_state, ssm_state_indices, out,
                  scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, lower_bound=lower_bound)
    return out, initial_state


# ----------------------------------------------------------------------------
# Speculative verify (DSpARK fixed drafts) and the ReplaySSM ring commit
# ----------------------------------------------------------------------------
_TILE = 128  # DSpARK's kernels are K = V = 128, H == HV


def _dspark_checks(x_q, x_k, x_v, g, beta, recurrent_state, intermediate_ssm, cu_seqlens, rings, onorm):
    """sglang's checks, in its order and with its texts. Returns (N, 1 + num_spec)."""
    T = x_q.shape[1] if x_q.dim() > 1 else 0
    H = x_q.shape[2] if x_q.dim() > 2 else 0
    N = cu_seqlens.numel() - 1
    shape = (1, T, H, _TILE)
    if tuple(x_q.shape) != shape or tuple(x_k.shape) != shape:
        raise ValueError(f"expected q/k shape {shape}")
    if tuple(x_v.shape) != shape or tuple(g.shape) != shape:
        raise ValueError(f"expected v/g shape {shape}")
    if tuple(beta.shape) != (1, T, H):
        raise ValueError(f"expected beta shape {(1, T, H)}")
    if N <= 0 or T % N != 0 or T // N < 1:
        raise ValueError(f"DSpARK KDA MTP requires a fixed 1 + num_spec dense tokens per request; got T={T}, N={N}")
    steps = T // N
    if recurrent_state.dim() != 4 or tuple(recurrent_state.shape[1:]) != (H, _TILE, _TILE):
        raise ValueError("expected recurrent state layout [pool, H, V=128, K=128]")
    if (recurrent_state.dtype != torch.float32
            or tuple(recurrent_state.stride()[-3:]) != (_TILE * _TILE, _TILE, 1)
            or recurrent_state.stride(0) % 4 != 0 or recurrent_state.storage_offset() % 4 != 0):
        raise ValueError("cp.async recurrent state requires fp32 contiguous [H, V, K] inner layout and "
                         "16-byte-aligned slot offsets")
    given = [r is not None for r in rings]
    if any(given) and not all(given):
        raise ValueError("ReplaySSM requires all four replayssm_* rings")
    if all(given):
        rawv, rawk, ring_g, ring_beta = rings
        L = rawv.shape[2] if rawv.dim() == 4 else -1
        slots = rawv.shape[0] if rawv.dim() == 4 else -1
        if (L < steps or any(r.dim() != 4 or tuple(r.shape) != (slots, H, L, _TILE) for r in (rawv, rawk, ring_g))
                or tuple(ring_beta.shape) != (slots, H, L)):
            raise ValueError(f"expected ReplaySSM ring layouts [slots, H={H}, L>={steps}, 128] / [slots, H, L]")
        if (rawv.dtype != torch.bfloat16 or rawk.dtype != torch.bfloat16 or ring_g.dtype != torch.float32
                or ring_beta.dtype != torch.float32):
            raise ValueError("expected ReplaySSM ring dtypes rawv/rawk=bf16, g/beta=fp32")
    elif (intermediate_ssm is None or intermediate_ssm.dim() != 5 or intermediate_ssm.shape[1] < steps
          or tuple(intermediate_ssm.shape[2:]) != (H, _TILE, _TILE)):
        raise ValueError(f"expected intermediate SSM layout [scratch, >={steps}, H, V=128, K=128]")
    onorm_gate, onorm_weight, onorm_eps = onorm
    given = [x is not None for x in onorm]
    if any(given) and not all(given):
        raise ValueError("fused output norm requires onorm_gate, onorm_weight, and onorm_eps")
    if all(given):
        if tuple(onorm_gate.shape) != shape:
            raise ValueError(f"expected output-norm gate shape {shape}")
        if tuple(onorm_weight.shape) != (_TILE,):
            raise ValueError(f"expected output-norm weight shape {(_TILE,)}")
        if onorm_gate.dtype != torch.bfloat16 or onorm_weight.dtype != torch.float32:
            raise ValueError("expected output-norm gate=bf16 and weight=fp32")
    return N, steps


def fused_kda_decode_mtp_dspark(*, x_q, x_k, x_v, w_q, w_k, w_v, cs_q, cs_k, cs_v, g, beta, A_log, dt_bias,
                                recurrent_state, intermediate_ssm, intermediate_state_indices,
                                intermediate_conv_q, intermediate_conv_k, intermediate_conv_v,
                                ssm_state_indices, cu_seqlens, lower_bound, scale=None,
                                replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None,
                                replayssm_beta=None, onorm_gate=None, onorm_weight=None, onorm_eps=None):
    """DSpARK speculative verify: pre-conv ``x_* [1, T, H, 128]`` with ``T = N * (1 + num_spec)``,
    safe gate, persistent pools read-only, snapshots or (all four ``replayssm_*``) rings.
    Returns a new ``[1, T, H, 128]`` tensor in ``x_v``'s dtype."""
    rings = (replayssm_rawv, replayssm_rawk, replayssm_g, replayssm_beta)
    N, steps = _dspark_checks(x_q, x_k, x_v, g, beta, recurrent_state, intermediate_ssm, cu_seqlens, rings,
                              (onorm_gate, onorm_weight, onorm_eps))
    H = x_q.shape[2]
    ring_mode = replayssm_rawv is not None
    out = torch.empty_like(x_v)
    dense = (N, steps, H, _TILE)
    mtp_verify(x_q.view(dense), x_k.view(dense), x_v.view(dense), g.view(dense), beta.view(N, steps, H), A_log,
               dt_bias, recurrent_state, ssm_state_indices, intermediate_state_indices,
               conv_weights=(w_q, w_k, w_v), conv_states=(cs_q, cs_k, cs_v),
               intermediate_conv=(intermediate_conv_q, intermediate_conv_k, intermediate_conv_v),
               snapshots=None if ring_mode else intermediate_ssm,
               rings=(replayssm_rawk, replayssm_rawv, replayssm_g, replayssm_beta) if ring_mode else None,
               scale=_TILE ** -0.5 if scale is None else scale, lower_bound=float(lower_bound),
               norm_gate=None if onorm_gate is None else onorm_gate.view(dense), norm_weight=onorm_weight,
               norm_eps=1e-6 if onorm_eps is None else float(onorm_eps), out=out.view(dense))
    return out


def commit_kda_replayssm_spec(checkpoint_state, rawv_cache, rawk_cache, gk_cache, beta_cache, ssm_state_indices,
                              accept_lens, max_cache_len, num_k_heads, mamba_track_indices=None,
                              mamba_steps_to_track=None, use_qk_l2norm_in_kernel=True, null_block_id=0):
    """Exact fold of the accepted ring prefix into ``checkpoint_state`` in place; returns None.
    Tensors may carry a leading layer dimension (every layer in one launch)."""
    ring_len = rawv_cache.shape[-2] if rawv_cache.dim() >= 2 else -1
    if int(max_cache_len) != ring_len:
        raise ValueError(f"`max_cache_len` must equal the rings' length L={ring_len} (got {max_cache_len}).")
    key_heads = rawk_cache.shape[-3] if rawk_cache.dim() >= 3 else -1
    if int(num_k_heads) != key_heads:
        raise ValueError(f"`num_k_heads` must equal rawk_cache's head count {key_heads} (got {num_k_heads}).")
    tracking = mamba_track_indices is not None and mamba_steps_to_track is not None
    commit_ring(checkpoint_state, rawk_cache, rawv_cache, gk_cache, beta_cache, ssm_state_indices, accept_lens,
                track_slots=mamba_track_indices if tracking else None,
                track_steps=mamba_steps_to_track if tracking else None,
                use_qk_l2norm=use_qk_l2norm_in_kernel, null_block_id=null_block_id)


commit_kda_replayssm_spec_all_layers = commit_kda_replayssm_spec


# ----------------------------------------------------------------------------
# The extend path's short conv
# ----------------------------------------------------------------------------
PAD_SLOT_ID = -1


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, seq_lens_cpu, cache_indices=None,
                     has_initial_state=None, activation="silu", pad_slot_id=PAD_SLOT_ID, validate_data=False,
                     block_table=None, **kwargs):
    """sglang's Triton varlen ``causal_conv1d_fn`` (``sglang/kernels/ops/mamba/causal_conv1d_triton.py``,
    the one its KDA backend calls): the same parameters in the same order, with the same defaults.

    ``x [dim, cu_seq_len]`` channels first (the transposed view of a ``[T, dim]`` projection works),
    ``weight [dim, W]``, ``bias [dim]`` or None, ``conv_states [slots, dim, W-1]`` updated in place
    (None: no windows), ``query_start_loc [N+1]`` (None: one sequence), ``cache_indices [N]``
    (None: sequence n uses slot n), ``has_initial_state [N]`` (None: every sequence starts from
    zeros, as in sglang), ``activation`` "silu"/"swish"/True or None. A sequence whose cache index
    is ``pad_slot_id`` is padding: no window is read or written for it (its outputs are computed
    from zeros, where sglang leaves them unwritten). ``seq_lens_cpu`` (sglang sizes its launch
    grid from it; it must agree with ``query_start_loc``, which kdakit reads on the device
    instead), ``validate_data`` and other keywords (``metadata``) are accepted and unused:
    kdakit checks its inputs' shapes on every call.

    ``block_table`` (sglang's CUDA-graph launch plan of (sequence, token block) rows, which
    decides the blocks that are computed) is not supported: passing one raises ValueError.

    Returns a new ``[dim, cu_seq_len]`` tensor laid out like x, as sglang's Triton path does; x
    itself is not modified. Weights and bias of another dtype are cast to float32.
    """
    if block_table is not None:
        raise ValueError("kdakit's causal_conv1d_fn does not support `block_table` (sglang's CUDA-graph launch "
                         "plan); pass block_table=None: kdakit plans its blocks on the device from "
                         "query_start_loc, so its calls can be captured without one.")
    del seq_lens_cpu, validate_data, kwargs
    if activation is True:
        activation = "silu"
    elif activation is False:
        activation = None
    if activation not in [None, "silu", "swish"]:
        raise NotImplementedError("activation must be None, silu, or swish")
    if x.dim() != 2:
        raise ValueError(f"`x` must be the varlen layout [dim, cu_seq_len] (got shape {tuple(x.shape)}); "
                         "flatten a [batch, dim, seqlen] input and pass query_start_loc.")
    dim, T = x.shape
    dev = x.device
    if query_start_loc is None:
        query_start_loc = torch.tensor([0, T], dtype=torch.int32, device=dev)
    N = query_start_loc.numel() - 1
    weight = weight if weight.dtype == torch.float32 and weight.is_contiguous() else weight.float().contiguous()
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        bias = bias.float().contiguous()
    if conv_states is None:  # no windows: every sequence starts from zeros and writes none
        conv_states = torch.zeros(1, dim, max(weight.shape[-1] - 1, 1), dtype=x.dtype, device=dev)
        slots = torch.full((N,), -1, dtype=torch.int32, device=dev)
    elif cache_indices is None:
        slots = torch.arange(N, dtype=torch.int32, device=dev)
    elif pad_slot_id is not None and pad_slot_id != -1:
        slots = torch.where(cache_indices == pad_slot_id, -1, cache_indices)
    else:
        slots = cache_indices
    if has_initial_state is None:
        has_initial_state = torch.zeros(N, dtype=torch.bool, device=dev)
    elif has_initial_state.dtype != torch.bool:
        has_initial_state = has_initial_state.bool()
    out = torch.empty_like(x)
    causal_conv1d_varlen(x.t(), conv_states, weight, query_start_loc, slots, has_initial_state=has_initial_state,
                         bias=bias, activation=activation, out=out.t())
    return out


# Tree target verify (EAGLE top-k > 1): kdakit/compat/sglang_tree.py
from .sglang_tree import causal_conv1d_update, fused_sigmoid_gating_delta_rule_update  # noqa: E402,F401

# The extend path's chunked prefill (the pool extension of chunk_kda): kdakit/compat/sglang_chunk.py
from .sglang_chunk import chunk_kda  # noqa: E402,F401
