"""How `kdakit bench --peers` calls each implementation of one job on one set of inputs.

Every builder here takes the same seeded inputs (kdakit/bench/inputs.py) and returns a
``Call``: ``run()`` does the job once (in place on its own pool, as the engine would), and
``result()`` returns the tensors that must agree across implementations (outputs in one
layout, the live slots' final states, the snapshots). Each implementation gets its own copy
of the inputs and the pool (the same seed draws the same values), because peers change some
of their inputs in place.

Peers are called the way their engine calls them:
- sglang 0.5.23's KDA kernels (``sglang.kernels.ops.attention.fla`` / ``.linear``, its Triton
  varlen conv ``sglang.kernels.ops.mamba.causal_conv1d_triton``) with the arguments of its
  ``TritonKDAKernel`` and ``kda_backend.py``: q/k/v as ``[1, tokens, heads, dim]`` views,
  the pool by slot, the conv input as the ``[C, T]`` view of the ``[T, C]`` projection;
- fla-core's ``fused_recurrent_kda_fwd`` (pool by slot, V-major) and ``chunk_kda`` (the
  sequences' states gathered from the pool, the finals scattered back, as engines do).
A peer that is not installed is ``None`` in ``find_peers()`` and a row saying so.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class Call:
    run: Callable[[], None]
    result: Callable[[], dict]


def find_peers() -> dict:
    """The peers importable here: ``{"sglang": {...} | str, "fla": {...} | str}`` (a str says why not)."""
    peers = {}
    try:
        from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_kda_packed_decode
        from sglang.kernels.ops.attention.fla.index import prepare_chunk_indices, prepare_chunk_offsets
        from sglang.kernels.ops.attention.fla.kda import chunk_kda
        from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
            fused_sigmoid_gating_delta_rule_update)
        from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn
        peers["sglang"] = dict(packed=fused_recurrent_kda_packed_decode, chunk=chunk_kda,
                               verify=fused_sigmoid_gating_delta_rule_update, conv=causal_conv1d_fn,
                               chunk_indices=prepare_chunk_indices, chunk_offsets=prepare_chunk_offsets)
    except Exception as exc:  # noqa: BLE001  (not installed, or its imports fail here)
        peers["sglang"] = f"not importable ({type(exc).__name__}: {str(exc)[:120]})"
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        peers["fla"] = dict(chunk=fla_chunk_kda, recurrent=fused_recurrent_kda_fwd)
    except Exception as exc:  # noqa: BLE001
        peers["fla"] = f"not importable ({type(exc).__name__}: {str(exc)[:120]})"
    return peers


def _live(idx):
    return idx[idx >= 0].long()


# ------------------------------------------------------------------------------------------
# Packed decode: one token per request, q|k|v packed, the pool by slot
# ------------------------------------------------------------------------------------------
def packed_decode_kdakit(L, H):
    import kdakit
    return Call(lambda: kdakit.packed_decode(L["mixed"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"],
                                             L["idx"], L["out"]),
                lambda: {"out": L["out"], "state": L["state"][_live(L["idx"])]})


def packed_decode_dropin(L, H):
    """kdakit's sglang drop-in (``kdakit.compat.sglang``), called as sglang's backend calls it."""
    from ..compat import sglang as compat
    K = L["state"].shape[-1]
    return Call(lambda: compat.fused_recurrent_kda_packed_decode(
        L["mixed"], L["a"], L["b"], L["A_log"], L["dt_bias"], K ** -0.5, L["state"], L["out"], L["idx"],
        use_qk_l2norm_in_kernel=True, lower_bound=None),
        lambda: {"out": L["out"], "state": L["state"][_live(L["idx"])]})


def packed_decode_sglang(fns, L, H):
    K = L["state"].shape[-1]
    return Call(lambda: fns["packed"](mixed_qkv=L["mixed"], a=L["a"], b=L["b"], A_log=L["A_log"],
                                      dt_bias=L["dt_bias"], scale=K ** -0.5, initial_state=L["state"], out=L["out"],
                                      ssm_state_indices=L["idx"], use_qk_l2norm_in_kernel=True, lower_bound=None),
                lambda: {"out": L["out"], "state": L["state"][_live(L["idx"])]})


def packed_decode_fla(fns, L, H):
    N = L["mixed"].shape[0]
    _, HV, V, K = L["state"].shape
    q, k, v = L["mixed"].split([H * K, H * K, HV * V], dim=-1)
    q, k, v = (t.reshape(N, 1, -1, d) for t, d in ((q, K), (k, K), (v, V)))
    gate, beta = L["a"].view(N, 1, HV, K), L["b"].view(N, 1, HV)

    def run():
        fns["recurrent"](q=q, k=k, v=v, g=gate, beta=beta, A_log=L["A_log"], dt_bias=L["dt_bias"],
                         initial_state=L["state"], scale=K ** -0.5, output_final_state=True,
                         inplace_final_state=True, state_v_first=True, ssm_state_indices=L["idx"],
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         out=L["out"])
    return Call(run, lambda: {"out": L["out"], "state": L["state"][_live(L["idx"])]})


# ------------------------------------------------------------------------------------------
# Speculative verify: chains (mtp_verify) and trees, snapshot and ring modes
# ------------------------------------------------------------------------------------------
def _verify_result(L, mode):
    res = {"out": L["out"]}
    if mode == "snapshot":
        res["snapshots"] = L["snapshots"][L["scratch_idx"].long()]
    return res


def verify_kdakit(L, mode, parents=None):
    import kdakit
    if parents is None:
        def run():
            kdakit.mtp_verify(L["q"], L["k"], L["v"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"],
                              L["slots"], L["scratch_idx"], snapshots=L.get("snapshots"), rings=L.get("rings"),
                              out=L["out"])
    else:
        def run():
            kdakit.tree_verify(L["q"], L["k"], L["v"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"],
                               L["slots"], L["scratch_idx"], parents, L["out"], snapshots=L.get("snapshots"),
                               rings=L.get("rings"))
    return Call(run, lambda: _verify_result(L, mode))


def verify_sglang(fns, L, mode, parents=None):
    """sglang's target verify (``fused_sigmoid_gating_delta_rule_update`` with the state update
    off): snapshots into ``intermediate_states_buffer`` by scratch row, or (ring mode) its
    ReplaySSM ring write (``cache_ring``) into rings of its own layouts; trees through
    ``retrieve_parent_token``. Only the outputs (and snapshots) are compared: the rings'
    layouts differ between the two."""
    N, T, H, K = L["q"].shape
    HV, V = L["v"].shape[2:]
    dev = L["q"].device
    flat = dict(q=L["q"].view(1, N * T, H, K), k=L["k"].view(1, N * T, H, K), v=L["v"].view(1, N * T, HV, V),
                a=L["a"].view(N * T, HV * K), b=L["b"].view(1, N * T, HV))
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=dev)
    kw = dict(A_log=L["A_log"], dt_bias=L["dt_bias"], softplus_beta=1.0, softplus_threshold=20.0,
              initial_state_source=L["state"], initial_state_indices=L["slots"], cu_seqlens=cu,
              use_qk_l2norm_in_kernel=True, is_kda=True, disable_state_update=True, cache_steps=T,
              retrieve_parent_token=parents, **flat)
    if mode == "snapshot":
        kw.update(intermediate_states_buffer=L["snapshots"], intermediate_state_indices=L["scratch_idx"])
    else:
        slots = L["state"].shape[0]
        kw.update(cache_ring=True,
                  replayssm_rawv=torch.zeros(slots, HV, T, V, device=dev, dtype=L["v"].dtype),
                  replayssm_rawk=torch.zeros(slots, H, T, K, device=dev, dtype=L["k"].dtype),
                  replayssm_g=torch.zeros(slots, HV, T, K, device=dev),
                  replayssm_beta=torch.zeros(slots, HV, T, device=dev))
    box = {}

    def run():
        o = fns["verify"](**kw)
        box["out"] = o
    return Call(run, lambda: {**_verify_result(L, mode), "out": box["out"].reshape(N, T, HV, V)})


# ------------------------------------------------------------------------------------------
# Varlen short conv (the extend path's q|k|v conv) on the pool's windows
# ------------------------------------------------------------------------------------------
def conv_inputs(lengths, C, W, *, x_layout, seed, device) -> dict:
    """``x`` ``[T, C]``: ``x_layout="rows"`` a row-major ``[T, C]`` projection (what engines
    hold; sglang takes its ``[C, T]`` view), ``"channels"`` the ``[T, C]`` view of a
    ``[C, T]`` buffer. The window pool is stored ``[slots, W-1, C]`` (sglang's) and passed as
    its ``[slots, C, W-1]`` view; a few sequences start from zeros (``has_initial_state``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N, T = len(lengths), sum(lengths)
    slots = N + 4
    x = (torch.randn(T, C, device=device, generator=gen).to(torch.bfloat16) if x_layout == "rows"
         else torch.randn(C, T, device=device, generator=gen).to(torch.bfloat16).t())
    pool = torch.randn(slots, W - 1, C, device=device, generator=gen).to(torch.bfloat16).transpose(1, 2)
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return {"x": x, "conv_state": pool, "weight": torch.randn(C, W, device=device, generator=gen) * 0.5,
            "bias": torch.randn(C, device=device, generator=gen) * 0.1, "cu": cu.to(device), "lengths": list(lengths),
            "idx": torch.randperm(slots, device=device, generator=gen)[:N].to(torch.int32),
            "has_initial_state": torch.rand(N, device=device, generator=gen) < 0.7,
            "out": torch.empty(T, C, device=device, dtype=torch.bfloat16)}


def conv_kdakit(L):
    import kdakit
    return Call(lambda: kdakit.causal_conv1d_varlen(L["x"], L["conv_state"], L["weight"], L["cu"], L["idx"],
                                                    has_initial_state=L["has_initial_state"], bias=L["bias"],
                                                    out=L["out"]),
                lambda: {"out": L["out"], "windows": L["conv_state"][L["idx"].long()]})


def conv_sglang(fns, L):
    if L["x"].stride(1) != 1:
        raise ValueError("sglang's varlen conv takes the [C, T] view of a row-major [T, C] projection only")
    box = {}

    def run():
        box["out"] = fns["conv"](L["x"].t(), L["weight"], L["bias"], conv_states=L["conv_state"],
                                 query_start_loc=L["cu"], seq_lens_cpu=L["lengths"], cache_indices=L["idx"],
                                 has_initial_state=L["has_initial_state"], activation="silu")
    return Call(run, lambda: {"out": box["out"].t(), "windows": L["conv_state"][L["idx"].long()]})


# ------------------------------------------------------------------------------------------
# Chunked prefill on the pool
# ------------------------------------------------------------------------------------------
def prefill_kdakit(L, lower_bound):
    import kdakit
    return Call(lambda: kdakit.chunk_prefill(L["q"], L["k"], L["v"], L["g"], L["beta"], L["state"], L["idx"],
                                             cu_seqlens=L["cu"], A_log=L["A_log"], dt_bias=L["dt_bias"],
                                             lower_bound=lower_bound, beta_is_logit=True, out=L["out"]),
                lambda: {"out": L["out"], "state": L["state"][_live(L["idx"])]})


def prefill_sglang(fns, L, lower_bound):
    """sglang's Triton ``chunk_kda`` on the pool by slot, with the chunk tables its prefill
    CUDA graph passes (built once here, as sglang builds them before the call)."""
    HV = L["v"].shape[2]
    K = L["q"].shape[-1]
    chunk_indices, chunk_offsets = fns["chunk_indices"](L["cu"], 64), fns["chunk_offsets"](L["cu"], 64)
    box = {}

    def run():
        o = fns["chunk"](L["q"], L["k"], L["v"], L["g"], L["beta"], scale=K ** -0.5, initial_state=L["state"],
                         initial_state_indices=L["idx"], use_qk_l2norm_in_kernel=True, cu_seqlens=L["cu"],
                         A_log=L["A_log"].view(1, 1, HV, 1), dt_bias=L["dt_bias"], lower_bound=lower_bound,
                         beta_is_raw=True, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
        box["out"] = o[0] if isinstance(o, tuple) else o
    return Call(run, lambda: {"out": box["out"], "state": L["state"][_live(L["idx"])]})


def prefill_fla(fns, L, lower_bound):
    """fla-core's ``chunk_kda`` as an engine runs it on a V-major pool: gather, run, scatter."""
    idx, cu = L["idx"].long(), L["cu"].long()
    box = {}

    def run():
        h0 = L["state"].index_select(0, idx)
        o, ht = fns["chunk"](q=L["q"], k=L["k"], v=L["v"], g=L["g"], beta=L["beta"], A_log=L["A_log"],
                             dt_bias=L["dt_bias"], initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             safe_gate=lower_bound is not None, lower_bound=lower_bound, state_v_first=True,
                             cu_seqlens=cu)
        L["state"].index_copy_(0, idx, ht.to(L["state"].dtype))
        box["out"] = o
    return Call(run, lambda: {"out": box["out"], "state": L["state"][_live(L["idx"])]})
