"""fla-core 0.6.0's ``fused_recurrent_kda`` and ``fused_recurrent_kda_fwd``: same names,
parameters, defaults, return values and varlen error texts, on kdakit's kernel; and its
``chunk_kda`` forward on kdakit's chunked prefill (see ``chunk_kda`` below).

State layout: fla's default is K-major ``[N, HV, K, V]``; ``state_v_first=True`` takes
the V-major ``[N, HV, V, K]`` pool of sglang and kdakit. kdakit's kernel addresses the
state through four strides, so a K-major pool is passed as a transposed *view* (no copy,
no transpose kernel around the call); states we allocate use the caller's layout.

With the gate in kernel, ``A_log`` may have any shape of ``HV`` elements (fla's tests pass
``[1, 1, HV, 1]``) and ``dt_bias`` any shape of ``HV*K`` elements (``[HV*K]``, ``[HV, K]``), as
fla reads them; a wrong element count raises ``ValueError`` (fla reads out of bounds). Head
dims up to 256 (any size, powers of two or not) and log-decays of -1000 (masked channels) are
supported; a head dim past 256 raises ``ValueError``.

Where we differ from fla 0.6.0 (each a place where fla drops or corrupts data):
- ``fused_recurrent_kda`` honours ``ssm_state_indices``, ``num_accepted_tokens`` and
  ``out`` passed through ``**kwargs`` (fla 0.6.0 silently drops them). With
  ``ssm_state_indices`` the initial-state count check compares the number of index
  rows, not the pool size, with the number of sequences.
- A negative slot index reads as a zero state and is never written (fla: out of bounds).
- 2-D ``ssm_state_indices`` honour their token stride (fla 0.6.0 assumes it is 1).
- 1-D ``ssm_state_indices`` with several tokens per sequence: the sequence starts from
  its slot and its final state goes back there (fla 0.6.0 writes token ``t`` of
  sequence ``n`` to ``ssm_state_indices[n + t]``, another request's slot). With
  ``num_accepted_tokens`` the indices must be 2-D.
- Not in place with ``ssm_state_indices``: ``final_state`` is the per-token states
  ``[T_total, HV, ...]`` float32 (what newer fla allocates; 0.6.0 allocates ``N`` rows
  and overruns them when a sequence has more than one token), or ``None`` without
  ``output_final_state`` (fla 0.6.0 would write through a null pointer).
- ``inplace_final_state=True`` without ``initial_state``, and any other malformed input,
  raise ``ValueError`` (fla: ``assert`` or a silent out-of-bounds access).
- A per-value-channel (headwise) ``beta [B, T, HV, V]`` is not supported (ValueError).
"""
from __future__ import annotations

import warnings

import torch

from ..buffers import kept_buffer
from ..ops.recurrent_forward import (BETA_AS_IS, BETA_SIGMOID, BETA_SIGMOID_X2, check_recurrent_forward,
                                     run_recurrent_forward)

def identity_slots(device: torch.device, count: int) -> torch.Tensor:
    """``[0, 1, .., count-1]`` int32 on ``device``: sequence n uses state n. A
    ``buffers.kept_buffer``: no arange kernel on every call."""
    return kept_buffer("identity slots", device, count,
                       lambda size: torch.arange(size, device=device, dtype=torch.int32))[:count]


def _gate_params(A_log, dt_bias, HV, K):
    """fla reads ``A_log`` as ``HV`` values and ``dt_bias`` as ``HV*K`` values whatever their
    shape (``[HV]``, ``[1, 1, HV, 1]``, ``[HV, K]``, ...): flattened here to the ``[HV]`` /
    ``[HV*K]`` the kernel takes (a view when contiguous). A wrong element count raises."""
    if A_log is not None:
        if A_log.numel() != HV:
            raise ValueError(f"`A_log` must have HV={HV} elements, one per value head, in any shape "
                             f"(got shape {tuple(A_log.shape)}).")
        A_log = A_log.reshape(HV).contiguous()
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(f"`dt_bias` must have HV*K={HV * K} elements ([HV*K] or [HV, K]) "
                             f"(got shape {tuple(dt_bias.shape)}).")
        dt_bias = dt_bias.reshape(HV * K).contiguous()
    return A_log, dt_bias


def _v_major(t, state_v_first):
    """A ``[.., K, V]`` tensor as the V-major view the kernel addresses."""
    return t if (t is None or state_v_first) else t.transpose(-1, -2)


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's serving entry. Returns ``(out, final_state)``: ``out [B, T, HV, V]`` (the
    caller's, or a new zeroed one in ``v``'s dtype); ``final_state`` is ``initial_state``
    itself when ``inplace_final_state`` (updated in place), else a new float32 tensor
    (per sequence, or per token with ``ssm_state_indices``) when ``output_final_state``,
    else ``None``.

    In place: ``ssm_state_indices`` (1-D ``[N]`` or 2-D ``[N, T_max]`` with
    ``num_accepted_tokens``) address the pool ``initial_state``; without them sequence
    ``n`` uses ``initial_state[n]``.
    """
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"`q`/`v` must be 4D [B, T, H, K] / [B, T, HV, V] (got q.ndim={q.dim()}, v.ndim={v.dim()}).")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    own_out = out is None
    if own_out:  # zero outside cu_seqlens, as fla's zeros_like; the kernel writes those rows
        out = torch.empty_like(v)
    if beta.dim() == v.dim():
        raise ValueError("A per-value-channel (headwise) `beta` [B, T, HV, V] is not supported by kdakit; "
                         "pass beta [B, T, HV].")
    # Equal-length batches run as one flattened varlen batch (views when contiguous).
    if cu_seqlens is None and B != 1 and k.dim() == 4 and g.dim() == 4 and beta.dim() == 3:
        if not (out.shape == v.shape):
            raise ValueError(f"`out` must have the shape of `v` {tuple(v.shape)} (got {tuple(out.shape)}).")
        try:
            out_flat = out.view(1, B * T, HV, V)
        except RuntimeError:
            raise ValueError("`out` must be contiguous over its batch and time dims.") from None
        q, k, v, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
        beta = beta.reshape(1, B * T, *beta.shape[2:])
        cu_seqlens = torch.arange(0, B * T + 1, T, device=q.device, dtype=torch.int32)
    else:
        out_flat = out
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1

    # The gate, as fla computes it: A_log None means exp(A) -> 1 in the safe gate and
    # A -> 1 in the default gate (fla's kernel uses 1.0 for both).
    if use_gate_in_kernel:
        A_log, dt_bias = _gate_params(A_log, dt_bias, HV, K)
        if A_log is None:
            A_log = torch.full((HV,), 0.0 if lower_bound is not None else 1.0, device=q.device, dtype=torch.float32)
        if dt_bias is None:
            dt_bias = torch.zeros(HV * K, device=q.device, dtype=torch.float32)
    else:
        A_log = dt_bias = lower_bound = None  # g is the log-decay; fla ignores them
    beta_mode = BETA_AS_IS
    if use_beta_sigmoid_in_kernel:
        beta_mode = BETA_SIGMOID_X2 if allow_neg_eigval else BETA_SIGMOID

    token_states = final_states = None
    write = True
    if inplace_final_state:
        if initial_state is None:
            raise ValueError("`inplace_final_state=True` needs `initial_state` (the pool updated in place).")
        pool, final_state = initial_state, initial_state
        if ssm_state_indices is None:
            if initial_state.dim() == 4 and initial_state.shape[0] != N:
                raise ValueError(f"The number of initial states is expected to be equal to the number of input "
                                 f"sequences, i.e., {N} rather than {initial_state.shape[0]}.")
            slots = identity_slots(q.device, N)
        else:
            slots = ssm_state_indices
    else:
        write = False
        alloc = (HV, V, K) if state_v_first else (HV, K, V)
        if initial_state is None:  # zero initial states: every slot reads as padding
            pool = q.new_empty(0, *alloc, dtype=torch.float32)
            shape = (N,) if ssm_state_indices is None else tuple(ssm_state_indices.shape)
            slots = torch.full(shape, -1, device=q.device, dtype=torch.int32)
        else:
            pool = initial_state
            if ssm_state_indices is None:
                if initial_state.dim() == 4 and initial_state.shape[0] != N:
                    raise ValueError(f"The number of initial states is expected to be equal to the number of "
                                     f"input sequences, i.e., {N} rather than {initial_state.shape[0]}.")
                slots = identity_slots(q.device, N)
            else:
                slots = ssm_state_indices
        final_state = None
        if output_final_state:
            if ssm_state_indices is None:
                final_state = final_states = q.new_empty(N, *alloc, dtype=torch.float32)
            else:
                final_state = token_states = q.new_empty(q.shape[1], *alloc, dtype=torch.float32)
    check_recurrent_forward(q, k, v, g, beta, pool, slots, out_flat, cu_seqlens=cu_seqlens,
                            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                            num_accepted_tokens=num_accepted_tokens, token_states=token_states,
                            final_states=final_states, state_name="initial_state",
                            k_major=not state_v_first)
    run_recurrent_forward(q, k, v, g, beta, _v_major(pool, state_v_first), slots, out_flat, cu_seqlens=cu_seqlens,
                          scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
                          lower_bound=lower_bound, beta_mode=beta_mode, num_accepted_tokens=num_accepted_tokens,
                          token_states=_v_major(token_states, state_v_first), write_final_state=write,
                          final_states=_v_major(final_states, state_v_first), padding_rows=False,
                          zero_uncovered=own_out)
    return out, final_state


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's public entry: never updates ``initial_state``; returns ``(o, final_state)``
    with ``final_state`` a new float32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
    ``state_v_first``) when ``output_final_state``, else ``None``.

    Unlike fla 0.6.0, ``ssm_state_indices``, ``num_accepted_tokens`` and ``out`` given as
    keywords are honoured (see the module doc); other extra keywords are ignored as fla does.
    """
    if 'transpose_state_layout' in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn(
            "`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
            DeprecationWarning,
            stacklevel=2,
        )
        state_v_first = kwargs.pop('transpose_state_layout')
    ssm_state_indices = kwargs.get("ssm_state_indices")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                             f"Please flatten variable-length inputs before processing.")
        given = ssm_state_indices if ssm_state_indices is not None else initial_state
        if given is not None and given.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(f"The number of initial states is expected to be equal to the number of input "
                             f"sequences, i.e., {len(cu_seqlens) - 1} rather than {given.shape[0]}.")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    return fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        inplace_final_state=False, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
        ssm_state_indices=ssm_state_indices, num_accepted_tokens=kwargs.get("num_accepted_tokens"),
        out=kwargs.get("out"),
    )


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """fla-core 0.6.0's ``chunk_kda`` forward on kdakit's chunked prefill: same parameters,
    defaults, checks and return value ``(o, final_state)``. ``A_log`` / ``dt_bias`` come
    through ``**kwargs`` as in fla. ``initial_state [N, HV, K, V]`` float32 (``[N, HV, V, K]``
    with ``state_v_first``) is read, never written; ``final_state`` is a new float32 tensor
    in the same layout when ``output_final_state``, else ``None``. With the gate in kernel a
    ``lower_bound`` selects the safe gate (``A_log`` may then be None: ``exp(A)`` is 1).

    Not supported (ValueError): ``return_intermediate_states``, ``cp_context``, a headwise
    beta. Inference only: no autograd. ``use_graph`` / ``max_num_seqs`` / ``cu_seqlens_cpu``
    / ``disable_recompute`` / ``chunk_size`` are accepted and not needed (kdakit plans its
    chunks on the device from ``cu_seqlens`` without a host sync, so every call can be
    captured in a CUDA graph).
    """
    from ..ops.chunk_prefill import BETA_AS_IS as C_AS_IS, BETA_SIGMOID as C_SIGMOID
    from ..ops.chunk_prefill import BETA_SIGMOID_X2 as C_SIGMOID_X2, run_chunk_prefill
    if 'transpose_state_layout' in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=2)
        state_v_first = kwargs.pop('transpose_state_layout')
    if return_intermediate_states:
        raise ValueError("`return_intermediate_states` is not supported by kdakit's chunk_kda; pass `chunk_states` "
                         "to kdakit.chunk_prefill for the states at chunk boundaries.")
    if cp_context is not None:
        raise ValueError("Context parallelism (`cp_context`) is not supported by kdakit's chunk_kda.")
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"`q`/`v` must be 4D [B, T, H, K] / [B, T, HV, V] (got q.ndim={q.dim()}, v.ndim={v.dim()}).")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                             f"Please flatten variable-length inputs before processing.")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(f"The number of initial states is expected to be equal to the number of input "
                             f"sequences, i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError("initial_state must be in float32.")
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if A_log is None and lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if beta.dim() == v.dim():
        raise ValueError("A per-value-channel (headwise) `beta` [B, T, HV, V] is not supported by kdakit; "
                         "pass beta [B, T, HV].")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    out = torch.zeros_like(v)
    if cu_seqlens is None:  # equal-length batches as one flattened varlen batch
        q, k, v_flat, g = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g))
        beta = beta.reshape(1, B * T, *beta.shape[2:])
        out_flat = out.view(1, B * T, HV, V)
        cu_seqlens = torch.arange(0, B * T + 1, T, device=q.device, dtype=torch.int32)
    else:
        v_flat, out_flat = v, out
    N = cu_seqlens.numel() - 1
    if use_gate_in_kernel:
        A_log, dt_bias = _gate_params(A_log, dt_bias, HV, K)
        if A_log is None:  # the safe gate without A: exp(A) is 1
            A_log = torch.zeros(HV, device=q.device, dtype=torch.float32)
        if dt_bias is None:
            dt_bias = torch.zeros(HV * K, device=q.device, dtype=torch.float32)
        if lower_bound is not None and not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    else:
        lower_bound = None  # g is the log-decay
    beta_mode = C_AS_IS
    if use_beta_sigmoid_in_kernel:
        beta_mode = C_SIGMOID_X2 if allow_neg_eigval else C_SIGMOID
    # The kernel updates a pool in place: run it on a float32 copy of the initial states
    # (fla never writes `initial_state`), which becomes the returned final state.
    alloc = (HV, V, K) if state_v_first else (HV, K, V)
    if initial_state is None:
        final = q.new_zeros(N, *alloc, dtype=torch.float32)
    else:
        final = initial_state.clone(memory_format=torch.contiguous_format)
    slots = identity_slots(q.device, N)
    check_recurrent_forward(q, k, v_flat, g, beta, final, slots, out_flat, cu_seqlens=cu_seqlens,
                            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                            state_name="initial_state", k_major=not state_v_first)
    run_chunk_prefill(q, k, v_flat, g, beta, _v_major(final, state_v_first), slots, out_flat,
                      cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, A_log=A_log,
                      dt_bias=dt_bias, lower_bound=lower_bound, beta_mode=beta_mode)
    return out, (final if output_final_state else None)
