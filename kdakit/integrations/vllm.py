"""kdakit as the KDA kernels of vLLM 0.33.0's Kimi Linear: a vLLM general plugin (entry point
group ``vllm.general_plugins``, name ``kdakit``) that substitutes a subclass for vLLM's KDA layer
through vLLM's own out-of-tree hook, without editing vLLM.

How it plugs in. vLLM loads every ``vllm.general_plugins`` entry point in each process (the
workers included) before the model is built. Kimi Linear's KDA layer is
``KimiGatedDeltaNetAttention`` (``vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py``),
a ``PluggableLayer``: ``register_oot`` makes ``PluggableLayer.__new__`` build the registered
class whenever vLLM builds the in-tree one. The subclass overrides only ``_forward`` (with the
same ``eager_break_during_capture`` decorator and keywords); parameters, weight loading, state
shapes and dtypes (so vLLM's cache sizing), the projections and the output norm are vLLM's.

What runs where (``register()`` logs the same in one line):

- prefill batches (``num_prefills > 0``, no speculative rows; one-token decodes in the batch go
  the same way, as in vLLM): one ``kdakit.causal_conv1d_varlen`` over the packed q|k|v (vLLM
  makes three convs) on vLLM's conv pool, then ``kdakit.chunk_prefill`` reading and writing the
  recurrent pool by slot (vLLM gathers the initial states and scatters the finals).
- pure decode batches: ``kdakit.causal_conv1d_update`` then ``kdakit.packed_decode``, both on
  the pools in place; nothing syncs with the host (they run inside vLLM's FULL CUDA graphs).
- speculative verify (any batch with ``spec_sequence_masks``, spec-only or mixed): vLLM's own
  kernels, through ``super()._forward``, for that whole call.
- anything else the checks below do not clear (a conv pool whose dtype is neither the
  activations' nor float32, a recurrent pool kdakit does not take, tables that do not match the
  token count, kdakit's input checks failing): ``super()._forward`` for that call, with one
  warning per reason and process. The checks run before anything is written.

Conventions mapped: vLLM's padding rows carry slot 0 (``NULL_BLOCK_ID``, a reserved block no
request owns; its kernels skip ``idx <= 0``); kdakit's padding is a slot < 0, so every slot table
goes through ``torch.where(idx > 0, idx, -1)`` on the device (no host sync). vLLM's conv pool
``[slots, L, 3P]`` (``SD``, the default; ``[slots, 3P, L]`` with ``VLLM_SSM_CONV_STATE_LAYOUT=DS``)
with ``L = W-1+num_spec`` is page-strided; vLLM's non-speculative conv kernels use its first
``W-1`` columns as the window (oldest first), which is kdakit's ``[slots, 3P, W-1]`` window on a
strided view. The recurrent pool ``[slots, H, V, K]`` (V-major, page-strided slots, float32 or
bfloat16) is kdakit's layout. ``beta`` arrives as a row-strided view and the conv weights are
float32 beside bfloat16 activations: kdakit's ops take both as they are.

``KDAKIT_VLLM`` switches the plugin off (``0``, ``off``, ``false``, ``no``, ``disable``); the
plugin also refuses (a warning, vLLM unchanged) on a vLLM other than 0.33.0, a layer whose
``_forward`` signature or metadata fields differ from those it was written against, a platform
other than CUDA, and a ROCm build of torch.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os

import torch

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = ("0.33.0",)
SWITCH_ENV = "KDAKIT_VLLM"
OFF_VALUES = ("0", "off", "false", "no", "disable", "disabled")
LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
LAYER_CLASS = "KimiGatedDeltaNetAttention"
METADATA_MODULE = "vllm.v1.attention.backends.gdn_attn"
FORWARD_PARAMETERS = ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out")
# The GDNAttentionMetadata fields _forward reads (vLLM's own path reads these too).
METADATA_FIELDS = ("num_prefills", "num_decodes", "num_spec_decodes", "num_actual_tokens", "has_initial_state",
                   "non_spec_query_start_loc", "non_spec_state_indices_tensor", "spec_sequence_masks",
                   "spec_state_indices_tensor", "spec_query_start_loc", "spec_token_indx", "non_spec_token_indx",
                   "num_accepted_tokens")
# The layer attributes _forward reads.
LAYER_ATTRIBUTES = ("kv_cache", "conv1d", "A_log", "dt_bias", "gate_lower_bound", "o_norm", "prefix",
                    "local_num_heads", "head_dim", "local_projection_size", "conv_size")

ON_KDAKIT = ("prefill: kdakit.causal_conv1d_varlen (q|k|v in one call) + kdakit.chunk_prefill on vLLM's pools "
             "by slot",
             "decode: kdakit.causal_conv1d_update + kdakit.packed_decode (no host sync, CUDA-graph safe)")
ON_VLLM = ("speculative verify (spec-only and mixed spec batches): vLLM's own causal_conv1d_update + "
           "fused_recurrent_kda",
           "the projections, the gated RMSNorm o_norm and o_proj",
           "any call outside what kdakit was checked on (logged once per reason)")

_registered: dict = {}
_warned: set = set()


def installed_vllm_version() -> str | None:
    """vLLM's version from its distribution metadata (no import of vLLM)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def switched_off() -> bool:
    return os.environ.get(SWITCH_ENV, "").strip().lower() in OFF_VALUES


def _platform_is_cuda() -> bool:
    """vLLM's own platform says CUDA (tests stand in for it on a CPU machine)."""
    from vllm.platforms import current_platform
    return bool(current_platform.is_cuda())


def refusal_reason() -> str | None:
    """Why the plugin must not activate in this process (before importing vLLM's layer), or None."""
    if switched_off():
        return f"switched off by {SWITCH_ENV}={os.environ.get(SWITCH_ENV)!r}"
    version = installed_vllm_version()
    if version not in SUPPORTED_VLLM_VERSIONS:
        return (f"vLLM {version or '(not installed)'} is not a version whose KDA layer this kdakit was written "
                f"against ({', '.join(SUPPORTED_VLLM_VERSIONS)})")
    if torch.version.hip is not None:
        return "this is a ROCm build of torch; kdakit's kernels are built and checked for CUDA only"
    if not _platform_is_cuda():
        return "vLLM's platform is not CUDA"
    return None


def layer_mismatch(base, metadata_cls) -> str | None:
    """What of vLLM's layer or metadata differs from what the subclass was written against, or None."""
    forward = getattr(base, "_forward", None)
    if forward is None:
        return f"{LAYER_CLASS} has no _forward"
    params = tuple(inspect.signature(forward).parameters)
    if params != FORWARD_PARAMETERS:
        return f"{LAYER_CLASS}._forward takes {params}, not {FORWARD_PARAMETERS}"
    fields = set(getattr(metadata_cls, "__dataclass_fields__", {}))
    missing = [f for f in METADATA_FIELDS if f not in fields]
    if missing:
        return f"GDNAttentionMetadata lacks {', '.join(missing)}"
    if not callable(getattr(base, "register_oot", None)):
        return f"{LAYER_CLASS} has no register_oot"
    return None


def routing_line() -> str:
    return "on kdakit: " + "; ".join(ON_KDAKIT) + ". On vLLM: " + "; ".join(ON_VLLM) + "."


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("kdakit: %s; this call runs vLLM's own KDA kernels.", reason)


def _null_to_padding(idx: torch.Tensor) -> torch.Tensor:
    """vLLM's padding slot 0 (and anything <= 0, which its recurrent kernels skip) to kdakit's -1.
    A device op: no host sync, capturable."""
    return torch.where(idx > 0, idx, torch.full_like(idx, -1))


def conv_window(conv_state: torch.Tensor, W: int) -> torch.Tensor:
    """The window ``[slots, C, W-1]`` vLLM's non-speculative conv kernels use in its ``[slots, C, L]``
    pool: the first ``W-1`` columns, oldest first (the rest hold speculative history)."""
    return conv_state[..., :W - 1]


def make_layer_class(base, layer_module):
    """The subclass of vLLM's ``KimiGatedDeltaNetAttention`` (``base``) whose ``_forward`` runs kdakit."""
    import kdakit
    from kdakit.contracts import STATE_DTYPES
    from kdakit.ops.chunk_prefill.op import check_chunk_prefill
    from kdakit.ops.conv1d_update import check_causal_conv1d_update
    from kdakit.ops.conv1d_varlen import check_causal_conv1d_varlen
    from kdakit.ops.packed_decode import check_packed_decode

    eager_break = layer_module.eager_break_during_capture

    class KdakitKimiGatedDeltaNetAttention(base):
        """vLLM's Kimi Linear KDA layer with kdakit's kernels (see ``kdakit.integrations.vllm``)."""

        kdakit_routes = ON_KDAKIT

        @eager_break
        def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
            plan = self._kdakit_plan(mixed_qkv, g1, beta, core_attn_out)
            if isinstance(plan, str):
                if plan:
                    _fallback(plan)
                return super()._forward(mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta, core_attn_out=core_attn_out)
            run, args = plan
            run(*args)
            core_attn_out.copy_(self.o_norm(core_attn_out, g2))

        # -- the plan: host-side checks only, nothing written ---------------------------------
        def _kdakit_plan(self, mixed_qkv, g1, beta, core_attn_out):
            """``(run, args)``, or a string: the reason the call goes to vLLM ('' for the calls
            vLLM's own _forward returns from at once, and for speculative batches, said at startup)."""
            attn_metadata = layer_module.get_forward_context().attn_metadata
            if not isinstance(attn_metadata, dict):
                return ""
            m = attn_metadata.get(self.prefix)
            if m is None:
                return ""
            if m.spec_sequence_masks is not None:
                return ""  # speculative verify stays on vLLM (the startup line says so)
            if m.non_spec_state_indices_tensor is None or m.non_spec_query_start_loc is None:
                return "a non-speculative batch without state indices"
            T = int(m.num_actual_tokens)
            if T <= 0:
                return "an empty batch"
            conv_state, state = self.kv_cache
            if not self._kdakit_dim_first():
                conv_state = conv_state.transpose(-1, -2)
            W = self.conv_size
            if conv_state.dim() != 3 or conv_state.shape[-1] < W - 1:
                return f"a conv pool of shape {tuple(conv_state.shape)}"
            window = conv_window(conv_state, W)
            if conv_state.dtype not in (mixed_qkv.dtype, torch.float32):
                return f"a {conv_state.dtype} conv pool with {mixed_qkv.dtype} activations"
            if state.dtype not in STATE_DTYPES:
                return f"a {state.dtype} recurrent pool"
            weight = self.conv1d.weight
            weight = weight.view(weight.shape[0], weight.shape[-1])
            bias = self.conv1d.bias
            H, D, P = self.local_num_heads, self.head_dim, self.local_projection_size
            x = mixed_qkv[:T]
            g = g1[:, :T]
            b = beta[:, :T]
            idx = m.non_spec_state_indices_tensor
            try:
                if m.num_prefills > 0:
                    if m.has_initial_state is None:
                        return "a prefill batch without has_initial_state"
                    cu = m.non_spec_query_start_loc
                    slots = _null_to_padding(idx)
                    conv_out = torch.empty((T, 3 * P), dtype=x.dtype, device=x.device)
                    check_causal_conv1d_varlen(x, window, weight, cu, slots, conv_out,
                                               has_initial_state=m.has_initial_state, bias=bias, full_checks=False)
                    q, k, v = (conv_out[:, i * P:(i + 1) * P].view(1, T, H, D) for i in range(3))
                    out = core_attn_out[:, :T]
                    check_chunk_prefill(q, k, v, g, b, state, slots, out, cu_seqlens=cu, A_log=self.A_log,
                                        dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound,
                                        has_initial_state=m.has_initial_state, full_checks=False)
                    return self._kdakit_prefill, (x, window, weight, bias, cu, slots, m.has_initial_state, conv_out,
                                                  q, k, v, g, b, state, out)
                if idx.dim() != 1 or idx.shape[0] < T:
                    return f"a decode batch of {T} tokens with a slot table of shape {tuple(idx.shape)}"
                slots = _null_to_padding(idx[:T])
                conv_out = torch.empty((T, 3 * P), dtype=x.dtype, device=x.device)
                check_causal_conv1d_update(x, window, weight, slots, conv_out, bias=bias, full_checks=False)
                a = g[0].reshape(T, H * D)
                b2 = b[0]
                out = core_attn_out[0, :T].unsqueeze(1)
                check_packed_decode(conv_out, a, b2, self.A_log, self.dt_bias, state, out, slots,
                                    lower_bound=self.gate_lower_bound, full_checks=False)
                return self._kdakit_decode, (x, window, weight, bias, slots, conv_out, a, b2, state, out)
            except ValueError as err:
                return f"kdakit's input checks refused the call ({err})"

        def _kdakit_dim_first(self):
            check = getattr(layer_module, "is_conv_state_dim_first", None)
            return bool(check()) if check is not None else False

        # -- the kernels ----------------------------------------------------------------------
        def _kdakit_prefill(self, x, window, weight, bias, cu, slots, has_initial_state, conv_out, q, k, v, g, b,
                            state, out):
            kdakit.causal_conv1d_varlen(x, window, weight, cu, slots, has_initial_state=has_initial_state, bias=bias,
                                        activation="silu", out=conv_out)
            kdakit.chunk_prefill(q, k, v, g, b, state, slots, cu_seqlens=cu, A_log=self.A_log, dt_bias=self.dt_bias,
                                 lower_bound=self.gate_lower_bound, beta_is_logit=True,
                                 has_initial_state=has_initial_state, use_qk_l2norm=True, out=out)

        def _kdakit_decode(self, x, window, weight, bias, slots, conv_out, a, b, state, out):
            kdakit.causal_conv1d_update(x, window, weight, slots, bias=bias, out=conv_out)
            kdakit.packed_decode(conv_out, a, b, self.A_log, self.dt_bias, state, slots, out, use_qk_l2norm=True,
                                 lower_bound=self.gate_lower_bound)

    KdakitKimiGatedDeltaNetAttention.__module__ = __name__
    KdakitKimiGatedDeltaNetAttention.__qualname__ = KdakitKimiGatedDeltaNetAttention.__name__
    return KdakitKimiGatedDeltaNetAttention


def _register():
    reason = refusal_reason()
    if reason is not None:
        logger.warning("kdakit vLLM plugin NOT active: %s. vLLM's own KDA kernels stay in place.", reason)
        return None
    layer_module = importlib.import_module(LAYER_MODULE)
    base = getattr(layer_module, LAYER_CLASS, None)
    metadata_cls = getattr(importlib.import_module(METADATA_MODULE), "GDNAttentionMetadata", None)
    mismatch = "the layer class is missing" if base is None else layer_mismatch(base, metadata_cls)
    if mismatch is not None:
        logger.warning("kdakit vLLM plugin NOT active: %s. vLLM's own KDA kernels stay in place.", mismatch)
        return None
    from vllm.model_executor.custom_op import op_registry_oot
    if LAYER_CLASS in op_registry_oot:
        logger.warning("kdakit vLLM plugin NOT active: another out-of-tree class (%s) already replaces %s. "
                       "vLLM's own KDA kernels stay in place.", op_registry_oot[LAYER_CLASS], LAYER_CLASS)
        return None
    cls = make_layer_class(base, layer_module)
    base.register_oot(cls)      # the one change to vLLM, made last
    _registered["cls"] = cls
    logger.info("kdakit vLLM plugin active (vLLM %s): %s is built as %s.%s; %s", installed_vllm_version(),
                LAYER_CLASS, __name__, cls.__name__, routing_line())
    return cls


def register():
    """The ``vllm.general_plugins`` entry point (vLLM calls it with no arguments, once per process).
    Registers the layer subclass, or logs why not; never raises. Returns the class, or None."""
    if "cls" in _registered:
        return _registered["cls"]
    try:
        return _register()
    except Exception as err:  # vLLM's loader would propagate it and stop the engine
        logger.warning("kdakit vLLM plugin NOT active: %s: %s. vLLM's own KDA kernels stay in place.",
                       type(err).__name__, err)
        return None
