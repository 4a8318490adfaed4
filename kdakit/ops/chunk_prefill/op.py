"""The public ``chunk_prefill``: its input contract, the dispatch to the backend, and the custom
op ``torch.ops.kdakit.chunk_prefill`` (registered when this module is imported, which
``kdakit`` does once) with its example inputs."""
from __future__ import annotations

import torch

from ...backends import select
from ...contracts import (STATE_DTYPES, _shape, check_finite, check_index_dtype, check_same_device,
                          full_checks_enabled)
from ..recurrent_forward import _check_recurrent_forward_values, check_recurrent_forward
from ..registry import example_index, example_rand, example_randn, example_rng, kdakit_op
from .config import BETA_AS_IS, BETA_SIGMOID


def run_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, scale=None, use_qk_l2norm=True,
                      A_log=None, dt_bias=None, lower_bound=None, beta_mode=BETA_AS_IS, has_initial_state=None,
                      chunk_states=None, chunk_state_indices=None, backend=None):
    """Dispatch after validation (callers check first)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if A_log is not None:
        dt_bias = dt_bias.reshape(-1)
    _, impl = select("chunk_prefill", q.device, backend)
    return impl(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                beta_mode=beta_mode, has_initial_state=has_initial_state, chunk_states=chunk_states,
                chunk_state_indices=chunk_state_indices)


@kdakit_op("chunk_prefill", counts_errors=True, mutates=("state", "out", "chunk_states"))
def chunk_prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slot_indices: torch.Tensor, out: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float | None, use_qk_l2norm: bool, A_log: torch.Tensor | None,
                     dt_bias: torch.Tensor | None, lower_bound: float | None, beta_mode: int,
                     has_initial_state: torch.Tensor | None, chunk_states: torch.Tensor | None,
                     chunk_state_indices: torch.Tensor | None, backend: str | None) -> None:
    """``beta_mode`` is one of ``BETA_*``."""
    run_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                      use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                      beta_mode=beta_mode, has_initial_state=has_initial_state, chunk_states=chunk_states,
                      chunk_state_indices=chunk_state_indices, backend=backend)


# ----------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------
def check_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, A_log=None, dt_bias=None,
                        lower_bound=None, has_initial_state=None, chunk_states=None, chunk_state_indices=None,
                        full_checks=None) -> int:
    """The chunked-prefill contract (the varlen recurrent forward's, 1-D slots only, plus
    ``has_initial_state`` and the chunk-boundary states). Returns N."""
    if not (slot_indices.dim() == 1):
        raise ValueError(f"`slot_indices` must be 1D [N] for chunk_prefill (got ndim={slot_indices.dim()}); "
                         "each sequence starts from and writes back to one slot.")
    full = full_checks_enabled(full_checks)
    N = check_recurrent_forward(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, A_log=A_log,
                                dt_bias=dt_bias, lower_bound=lower_bound, full_checks=False)
    if has_initial_state is not None:
        if not (_shape(has_initial_state) == (N,)):
            raise ValueError(f"`has_initial_state` must have shape ({N},), one flag per sequence "
                             f"(got {_shape(has_initial_state)}).")
        if not (has_initial_state.dtype in (torch.bool, torch.int32, torch.int64)):
            raise ValueError(f"`has_initial_state` must be a bool, int32 or int64 tensor (got {has_initial_state.dtype}).")
    if (chunk_states is None) != (chunk_state_indices is None):
        raise ValueError("`chunk_states` and `chunk_state_indices` go together: pass both or neither.")
    if chunk_states is not None:
        _, HV, V, K = state.shape
        if not (chunk_states.dim() == 4 and tuple(chunk_states.shape[1:]) == (HV, V, K)):
            raise ValueError(f"`chunk_states` must have shape [scratch, HV={HV}, V={V}, K={K}] "
                             f"(got {_shape(chunk_states)}).")
        if not (chunk_states.stride(-1) == 1 and chunk_states.stride(2) == K and chunk_states.stride(1) == V * K):
            raise ValueError(f"`chunk_states` must have contiguous inner dims [HV, V, K] "
                             f"(got strides {tuple(chunk_states.stride())}).")
        if not (chunk_states.dtype in STATE_DTYPES):
            raise ValueError(f"`chunk_states` must be float32, bfloat16 or float16 (got {chunk_states.dtype}).")
        if not (chunk_state_indices.dim() == 2 and chunk_state_indices.shape[0] == N):
            raise ValueError(f"`chunk_state_indices` must have shape [N={N}, M] (got {_shape(chunk_state_indices)}).")
        check_index_dtype("chunk_state_indices", chunk_state_indices)
    check_same_device(q, state, slot_indices, cu_seqlens, has_initial_state, chunk_states, chunk_state_indices)
    if full:
        _check_recurrent_forward_values(slot_indices, None, cu_seqlens, q.shape[1], state.shape[0])
        check_finite(True, A_log=A_log, dt_bias=dt_bias)
        if chunk_states is not None:
            rows = chunk_state_indices[chunk_state_indices >= 0]
            if rows.numel():
                if not (int(rows.max()) < chunk_states.shape[0]):
                    raise ValueError(f"`chunk_state_indices` holds row {int(rows.max())}, out of range for "
                                     f"`chunk_states` of {chunk_states.shape[0]} rows.")
                if not (torch.unique(rows).numel() == rows.numel()):
                    raise ValueError("`chunk_state_indices` holds the same row twice; each boundary needs its own row.")
    return N


def chunk_prefill(q, k, v, g, beta, state, slot_indices, *, cu_seqlens=None, A_log=None, dt_bias=None,
                  lower_bound=None, beta_is_logit=False, has_initial_state=None, use_qk_l2norm=True, scale=None,
                  chunk_states=None, chunk_state_indices=None, out=None, full_checks=None, backend=None):
    """Chunked varlen KDA prefill over ``state [slots, HV, V, K]`` (see the package doc, ``kdakit.ops.chunk_prefill``).

    ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``, ``g [1, T, HV, K]``, ``beta [1, T, HV]``;
    ``cu_seqlens [N+1]`` (None: one sequence of ``T`` tokens); ``slot_indices [N]`` (a slot
    < 0 or >= slots is a padding row); ``has_initial_state [N]`` (bool or int; False: start
    from zeros, the final state is still written). ``g`` is the raw gate when ``A_log
    [HV]`` (with ``dt_bias [HV*K]``, optional ``lower_bound`` for the safe gate) is given,
    else the log-decay; ``beta`` is β, or its logit when ``beta_is_logit``.
    ``chunk_states [scratch, HV, V, K]`` with ``chunk_state_indices [N, M]``: the state of
    sequence ``n`` after its first ``(j+1) * CHUNK_SIZE`` tokens (64, whatever chunk the
    kernels use) goes to
    ``chunk_states[chunk_state_indices[n, j]]`` (rows < 0 or out of range: not written).
    Returns ``out [1, T, HV, V]`` (allocated zeroed in ``v``'s dtype when not given; rows
    of tokens outside ``cu_seqlens`` are not written).
    """
    if out is None:
        out = torch.zeros_like(v) if v.dim() == 4 else v.new_zeros(0)
    if cu_seqlens is None and q.dim() == 4:  # one sequence (a kernel, not a host copy: capturable)
        cu_seqlens = torch.arange(2, dtype=torch.int32, device=q.device) * q.shape[1]
    check_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, A_log=A_log,
                        dt_bias=dt_bias, lower_bound=lower_bound, has_initial_state=has_initial_state,
                        chunk_states=chunk_states, chunk_state_indices=chunk_state_indices,
                        full_checks=full_checks)
    beta_mode = BETA_SIGMOID if beta_is_logit else BETA_AS_IS
    chunk_prefill_op(q, k, v, g, beta, state, slot_indices, out, cu_seqlens, scale, use_qk_l2norm, A_log, dt_bias,
                     lower_bound, beta_mode, has_initial_state, chunk_states, chunk_state_indices, backend)
    return out


@chunk_prefill_op.register_example
def _example(seed, device="cpu"):
    """Sequences of 3 tokens, of 17 (past a 16-token sub-block; from a zero state), and an empty padding row."""
    g = example_rng(seed)
    H, HV, K, V, slots = 1, 2, 16, 16, 5
    cu = (0, 3, 20, 20)
    T = cu[-1]
    args = (example_randn(g, 1, T, H, K, device=device), example_randn(g, 1, T, H, K, device=device),
            example_randn(g, 1, T, HV, V, device=device), example_randn(g, 1, T, HV, K, device=device),
            example_randn(g, 1, T, HV, device=device), example_randn(g, slots, HV, V, K, scale=0.5, device=device),
            example_index(3, 0, -1, device=device))
    kw = dict(cu_seqlens=example_index(*cu, device=device), A_log=example_rand(g, HV, device=device),
              dt_bias=example_randn(g, HV * K, scale=0.5, device=device), lower_bound=-3.0, beta_is_logit=True,
              has_initial_state=torch.tensor([True, False, True], device=device),
              out=torch.full((1, T, HV, V), 7.0, device=device))
    return chunk_prefill, args, kw
