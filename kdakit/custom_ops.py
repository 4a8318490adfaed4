"""Every public op as a ``torch.library`` custom op (``torch.ops.kdakit.<name>``).

Why: ``torch.compile(fullgraph=True)`` cannot trace into a Triton launcher or the
reference's data-dependent indexing, and CUDA-graph trees need to know which
buffers an op writes. Each op here is opaque to the compiler: a schema that names
the buffers it writes (``mutates_args``), a fake implementation (a no-op: every op
writes caller-owned buffers and returns ``None``; a custom op may not return an
alias of an input), and a body that picks the backend with
:func:`kdakit.backends.select` and runs it.

How the public entries use them (``kdakit/ops/*.py``):
  * The public entry validates first, *outside* the custom op, so under
    ``torch.compile`` validation runs at trace time on fake tensors: shape, stride,
    dtype and device checks raise the usual ``ValueError`` while compiling. Data
    checks (``full_checks=True`` / ``KDAKIT_CHECKS=full``) read tensor values and
    cannot run on fake tensors; see :func:`kdakit.contracts.full_checks_enabled`
    (an explicit ``full_checks=True`` under tracing raises, the environment
    default is skipped).
  * Then, when traced (``torch.compiler.is_compiling()``: ``torch.compile``,
    ``torch.export``) or when the first tensor is a subclass (fake or functional
    tensors of a non-Dynamo trace), it calls ``torch.ops.kdakit.<name>(...)`` and
    returns the caller's ``out`` object. In plain eager it keeps its direct
    ``select(...)`` + impl dispatch: the custom-op dispatcher path costs ~150 µs of
    host time per call in torch 2.13 (the Python ADInplaceOrView/autograd wrappers
    of a mutating custom op rebuild the schema's argument list for every argument),
    far more than a decode step takes on the GPU, and eager CUDA-graph capture needs
    no custom op (the launches are captured as they are).
  * ``backend=`` travels as an ``Optional[str]`` argument; the body calls
    ``select(op, device, backend)`` exactly as the eager dispatch does, so the
    ``KDAKIT_BACKEND`` variable is read on every call, compiled or not (and an
    unavailable backend raises when the op runs, as in eager).
  * Bodies do no validation.

Argument mapping: optional tensors are ``Optional[Tensor]``; fixed-size tuples of
tensors (``conv_weights``, ``rings``...) are flattened into separate optional
tensor arguments; ``commit_snapshots``' conv pools (any number of them, e.g. one
merged ``q|k|v`` pool or three) are ``List[Tensor]`` (empty list for ``None``).

Layout: every op carries ``torch.Tag.needs_exact_strides`` so inductor hands the
kernels the strides that validation saw at trace time (kernels read strides at
run time and the contracts pin some of them).
"""
from typing import List, Optional

import torch
from torch import Tensor

from .backends import select
from .ops.recurrent_forward import run_recurrent_forward  # select + the dispatch-time defaults of that op
from .ops.chunk_prefill import run_chunk_prefill

_TAGS = (torch.Tag.needs_exact_strides,)


def _op(name: str, mutates: tuple[str, ...]):
    """``torch.library.custom_op("kdakit::name")`` with a no-op fake implementation."""
    def decorate(fn):
        op = torch.library.custom_op(f"kdakit::{name}", mutates_args=mutates, tags=_TAGS)(fn)

        @op.register_fake
        def _fake(*args, **kwargs):  # every op writes caller-owned buffers and returns None
            return None
        return op
    return decorate


def _opt(*tensors):
    """A tuple of tensors, or None when the first is None (the op's "not given")."""
    return None if tensors[0] is None else tuple(tensors)


# ----------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------
@_op("packed_decode", ("state", "out"))
def packed_decode(mixed_qkv: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, state: Tensor,
                  slot_indices: Tensor, out: Tensor, scale: float, use_qk_l2norm: bool,
                  lower_bound: Optional[float], backend: Optional[str]) -> None:
    _, impl = select("packed_decode", mixed_qkv.device, backend)
    impl(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out,
         scale=scale, use_qk_l2norm=use_qk_l2norm, lower_bound=lower_bound)


@_op("fused_decode", ("conv_state", "state", "out"))
def fused_decode(qkv: Tensor, conv_weight: Tensor, conv_state: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                 dt_bias: Tensor, state: Tensor, slot_indices: Tensor, out: Tensor, conv_bias: Optional[Tensor],
                 scale: float, lower_bound: Optional[float], norm_gate: Optional[Tensor],
                 norm_weight: Optional[Tensor], norm_eps: float, backend: Optional[str]) -> None:
    _, impl = select("fused_decode", qkv.device, backend)
    impl(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, conv_bias=conv_bias,
         scale=scale, lower_bound=lower_bound, norm_gate=norm_gate, norm_weight=norm_weight, norm_eps=norm_eps)


@_op("causal_conv1d_update", ("conv_state", "out"))
def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, slot_indices: Tensor, out: Tensor,
                         bias: Optional[Tensor], backend: Optional[str]) -> None:
    _, impl = select("causal_conv1d_update", x.device, backend)
    impl(x, conv_state, weight, slot_indices, out, bias=bias)


@_op("causal_conv1d_varlen", ("conv_state", "out"))
def causal_conv1d_varlen(x: Tensor, conv_state: Tensor, weight: Tensor, cu_seqlens: Tensor, slot_indices: Tensor,
                         out: Tensor, has_initial_state: Optional[Tensor], bias: Optional[Tensor], activation: bool,
                         backend: Optional[str]) -> None:
    """``activation``: SiLU on (the public entry's ``"silu"``/``"swish"``) or off (``None``)."""
    _, impl = select("causal_conv1d_varlen", x.device, backend)
    impl(x, conv_state, weight, cu_seqlens, slot_indices, out, has_initial_state=has_initial_state, bias=bias,
         activation=activation)


@_op("gated_rmsnorm", ("out",))
def gated_rmsnorm(x: Tensor, gate: Tensor, weight: Tensor, out: Tensor, eps: float, groups: List[int],
                  backend: Optional[str]) -> None:
    """``groups`` is ``contracts.row_groups`` flattened: ``[n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi]``."""
    n_outer, n_inner, sxo, sxi, sgo, sgi, soo, soi = groups
    _, impl = select("gated_rmsnorm", x.device, backend)
    impl(x, gate, weight, out, eps=eps, groups=(n_outer, n_inner, ((sxo, sxi), (sgo, sgi), (soo, soi))))


def flatten_row_groups(groups) -> list[int]:
    """``contracts.row_groups``' nested tuple as the flat int list the custom op takes."""
    n_outer, n_inner, strides = groups
    return [int(n_outer), int(n_inner)] + [int(s) for pair in strides for s in pair]


# ----------------------------------------------------------------------------
# Speculative verify and commits
# ----------------------------------------------------------------------------
@_op("mtp_verify", ("out", "ic_q", "ic_k", "ic_v", "snapshots", "ring_k", "ring_v", "ring_g", "ring_beta"))
def mtp_verify(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
               state: Tensor, slot_indices: Tensor, scratch_indices: Tensor, out: Tensor,
               w_q: Optional[Tensor], w_k: Optional[Tensor], w_v: Optional[Tensor],
               cs_q: Optional[Tensor], cs_k: Optional[Tensor], cs_v: Optional[Tensor],
               ic_q: Optional[Tensor], ic_k: Optional[Tensor], ic_v: Optional[Tensor],
               bias_q: Optional[Tensor], bias_k: Optional[Tensor], bias_v: Optional[Tensor],
               snapshots: Optional[Tensor], ring_k: Optional[Tensor], ring_v: Optional[Tensor],
               ring_g: Optional[Tensor], ring_beta: Optional[Tensor], scale: float, lower_bound: Optional[float],
               norm_gate: Optional[Tensor], norm_weight: Optional[Tensor], norm_eps: float,
               backend: Optional[str]) -> None:
    _, impl = select("mtp_verify", q.device, backend)
    impl(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, out,
         conv_weights=_opt(w_q, w_k, w_v), conv_states=_opt(cs_q, cs_k, cs_v),
         intermediate_conv=_opt(ic_q, ic_k, ic_v), conv_bias=_opt(bias_q, bias_k, bias_v),
         snapshots=snapshots, rings=_opt(ring_k, ring_v, ring_g, ring_beta), scale=scale,
         lower_bound=lower_bound, norm_gate=norm_gate, norm_weight=norm_weight, norm_eps=norm_eps)


def mtp_verify_tensors(conv_weights, conv_states, intermediate_conv, conv_bias, snapshots, rings) -> tuple:
    """The public tuples flattened into the custom op's 17 optional tensor arguments, in
    schema order: ``w_q..w_v, cs_q..cs_v, ic_q..ic_v, bias_q..bias_v, snapshots, ring_k..ring_beta``."""
    flat = []
    for group, n in ((conv_weights, 3), (conv_states, 3), (intermediate_conv, 3), (conv_bias, 3)):
        flat += list(group) if group is not None else [None] * n
    flat.append(snapshots)
    flat += list(rings) if rings is not None else [None] * 4
    return tuple(flat)


@_op("commit_snapshots", ("state", "conv_states"))
def commit_snapshots(state: Tensor, snapshots: Optional[Tensor], slot_indices: Tensor, scratch_indices: Tensor,
                     accepted_steps: Tensor, conv_states: List[Tensor], intermediate_conv: List[Tensor],
                     backend: Optional[str]) -> None:
    _, impl = select("commit_snapshots", state.device, backend)
    impl(state, snapshots, slot_indices, scratch_indices, accepted_steps,
         conv_states=tuple(conv_states) if conv_states else None,
         intermediate_conv=tuple(intermediate_conv) if intermediate_conv else None)


@_op("commit_ring", ("state",))
def commit_ring(state: Tensor, ring_k: Tensor, ring_v: Tensor, ring_g: Tensor, ring_beta: Tensor,
                slot_indices: Tensor, accept_lens: Tensor, track_slots: Optional[Tensor],
                track_steps: Optional[Tensor], use_qk_l2norm: bool, null_block_id: int,
                backend: Optional[str]) -> None:
    _, impl = select("commit_ring", state.device, backend)
    impl(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens, track_slots=track_slots,
         track_steps=track_steps, use_qk_l2norm=use_qk_l2norm, null_block_id=null_block_id)


# ----------------------------------------------------------------------------
# Varlen forward
# ----------------------------------------------------------------------------
@_op("recurrent_forward", ("state", "out", "token_states", "final_states"))
def recurrent_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                      slot_indices: Tensor, out: Tensor, cu_seqlens: Optional[Tensor], scale: Optional[float],
                      use_qk_l2norm: bool, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
                      lower_bound: Optional[float], beta_mode: int, num_accepted_tokens: Optional[Tensor],
                      token_states: Optional[Tensor], write_final_state: bool, final_states: Optional[Tensor],
                      padding_rows: bool, backend: Optional[str]) -> None:
    """``beta_mode`` is one of ``ops.recurrent_forward.BETA_*``; ``final_states`` is fla's
    non-in-place output (the public native entry passes None)."""
    run_recurrent_forward(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                          use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                          beta_mode=beta_mode, num_accepted_tokens=num_accepted_tokens,
                          token_states=token_states, write_final_state=write_final_state,
                          final_states=final_states, padding_rows=padding_rows, backend=backend)


@_op("chunk_prefill", ("state", "out", "chunk_states"))
def chunk_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slot_indices: Tensor,
                  out: Tensor, cu_seqlens: Tensor, scale: Optional[float], use_qk_l2norm: bool,
                  A_log: Optional[Tensor], dt_bias: Optional[Tensor], lower_bound: Optional[float], beta_mode: int,
                  has_initial_state: Optional[Tensor], chunk_states: Optional[Tensor],
                  chunk_state_indices: Optional[Tensor], backend: Optional[str]) -> None:
    """``beta_mode`` is one of ``ops.chunk_prefill.BETA_*``."""
    run_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                      use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                      beta_mode=beta_mode, has_initial_state=has_initial_state, chunk_states=chunk_states,
                      chunk_state_indices=chunk_state_indices, backend=backend)


OPS = {"packed_decode": packed_decode, "fused_decode": fused_decode, "causal_conv1d_update": causal_conv1d_update,
       "causal_conv1d_varlen": causal_conv1d_varlen, "gated_rmsnorm": gated_rmsnorm, "mtp_verify": mtp_verify, "commit_snapshots": commit_snapshots,
       "commit_ring": commit_ring, "recurrent_forward": recurrent_forward,
       "chunk_prefill": chunk_prefill}


# ----------------------------------------------------------------------------
# Tree verify (kdakit/ops/tree_verify.py)
# ----------------------------------------------------------------------------
@_op("tree_verify", ("out", "ic_q", "ic_k", "ic_v", "snapshots", "ring_k", "ring_v", "ring_g", "ring_beta"))
def tree_verify(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                state: Tensor, slot_indices: Tensor, scratch_indices: Tensor, parents: Tensor, out: Tensor,
                w_q: Optional[Tensor], w_k: Optional[Tensor], w_v: Optional[Tensor],
                cs_q: Optional[Tensor], cs_k: Optional[Tensor], cs_v: Optional[Tensor],
                ic_q: Optional[Tensor], ic_k: Optional[Tensor], ic_v: Optional[Tensor],
                bias_q: Optional[Tensor], bias_k: Optional[Tensor], bias_v: Optional[Tensor],
                snapshots: Optional[Tensor], ring_k: Optional[Tensor], ring_v: Optional[Tensor],
                ring_g: Optional[Tensor], ring_beta: Optional[Tensor], scale: float, lower_bound: Optional[float],
                norm_gate: Optional[Tensor], norm_weight: Optional[Tensor], norm_eps: float,
                backend: Optional[str]) -> None:
    """The tensors as ``mtp_verify``'s (``mtp_verify_tensors``), then the same scalars."""
    _, impl = select("tree_verify", q.device, backend)
    impl(q, k, v, a, b, A_log, dt_bias, state, slot_indices, scratch_indices, parents, out,
         conv_weights=_opt(w_q, w_k, w_v), conv_states=_opt(cs_q, cs_k, cs_v),
         intermediate_conv=_opt(ic_q, ic_k, ic_v), conv_bias=_opt(bias_q, bias_k, bias_v),
         snapshots=snapshots, rings=_opt(ring_k, ring_v, ring_g, ring_beta), scale=scale, lower_bound=lower_bound,
         norm_gate=norm_gate, norm_weight=norm_weight, norm_eps=norm_eps)


OPS["tree_verify"] = tree_verify


@_op("commit_tree_ring", ("state",))
def commit_tree_ring(state: Tensor, ring_k: Tensor, ring_v: Tensor, ring_g: Tensor, ring_beta: Tensor,
                     slot_indices: Tensor, paths: Tensor, accept_lens: Tensor, use_qk_l2norm: bool,
                     null_block_id: int, backend: Optional[str]) -> None:
    _, impl = select("commit_tree_ring", state.device, backend)
    impl(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, paths, accept_lens, use_qk_l2norm=use_qk_l2norm,
         null_block_id=null_block_id)


OPS["commit_tree_ring"] = commit_tree_ring
