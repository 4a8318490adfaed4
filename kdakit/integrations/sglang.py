"""kdakit as sglang 0.5.23's KDA kernel: an sglang plugin (entry point group
``sglang.srt.plugins``, name ``kdakit``) that swaps the kernel object sglang's
``KDAKernelDispatcher`` builds, without editing sglang.

How it plugs in. sglang's dispatcher (``sglang/srt/layers/attention/linear/kda_backend.py``)
builds one ``TritonKDAKernel()`` and hands it every phase whose backend is ``triton`` (the
default on Hopper), the ``nv_cutedsl`` verify off SM10x, and every Triton fallback. The plugin
registers a class REPLACE of ``TritonKDAKernel`` through sglang's ``HookRegistry``; the
replacement subclasses the original, so every ``isinstance(kernel, TritonKDAKernel)`` check of
the backend (safe-gate guards, prefill-graph eligibility) still holds, and whatever kdakit does
not cover goes to the original methods through ``super()`` with the arguments as received.

What runs where (the first instance logs the same table):

- ``packed_decode``: ``kdakit.packed_decode`` (default and safe gate); with ReplaySSM rings
  (``--enable-linear-replayssm``) sglang's kernel.
- ``decode``: ``kdakit.recurrent_forward`` over ``query_start_loc`` (the safe gate included).
- ``extend`` (eager, radix ``track_state`` / ``track_chunk_idx`` snapshots, and inside sglang's
  breakable prefill CUDA graphs): ``kdakit.compat.sglang.chunk_kda`` (no host sync, and with
  a tracked batch no per-chunk ``h``: sglang reads ``h`` only when no snapshot buffer is given).
- ``target_verify`` of chains and trees (``retrieve_parent_token``) with snapshots into
  ``intermediate_states_buffer``: ``kdakit.tree_verify`` through
  ``kdakit.compat.sglang.fused_sigmoid_gating_delta_rule_update``; ReplaySSM verify
  (``cache_ring``) and ragged verify layouts (DSpARK / DFLASH ``qo_indptr``) run sglang's kernel.
- The fused chain verify that bypasses the kernel object (``SGLANG_OPT_FUSED_KDA_VERIFY=1``) is
  turned off by ``supports_fused_chain_verify = False``, so every verify reaches kdakit.
- Never through the kernel object, so sglang's own either way (``OUTSIDE_KERNEL``): the short
  convs, Kimi K3's fused decode, the DSpARK CuTe verify on SM10x, and any phase given another
  ``--linear-attn-*-backend`` (their Triton fallbacks do become kdakit's).

``KDAKIT_SGLANG_PHASES`` (comma-separated ``decode``, ``extend``, ``verify``; default all)
keeps the other phases on sglang's kernel. The plugin refuses (a warning, sglang's kernels left
in place) on an sglang version whose call sites it was not written against, on ROCm builds of
torch, and on an unknown phase name.

Argument conventions honoured as sglang 0.5.23's call sites pass them: padding slot 0 in eager
batches (a real, reserved slot: computed like any other) and -1 in CUDA graphs (no pool access,
zero output); int32 slot and offset tables; ``A_log [1, 1, HV, 1]``; gates ``[B, HV*K]``,
``[1, T, HV*K]`` or ``[1, T, HV, K]``; strided q/k/v views of the conv output; any slot stride of
the state pool; ``scale`` only in ``packed_decode`` (``K ** -0.5`` elsewhere); ``beta_is_raw``
as given.
"""
from __future__ import annotations

import contextvars
import importlib
import importlib.metadata
import logging
import os

import torch

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
KDA_TRITON_MODULE = "sglang.srt.layers.attention.linear.kernels.kda_triton"
KERNEL_TARGET = KDA_TRITON_MODULE + ".TritonKDAKernel"
# Wrapped only to learn whether a verify batch is ragged (sglang passes no such flag to the
# kernel, and reading query_start_loc would sync the stream).
VERIFY_TARGET = "sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend._forward_target_verify"
PHASES_ENV = "KDAKIT_SGLANG_PHASES"
ALL_PHASES = ("decode", "extend", "verify")
KERNEL_METHODS = ("packed_decode", "decode", "extend", "target_verify")

ON_KDAKIT = {
    "decode": ("packed_decode (default and safe gate) -> kdakit.packed_decode",
               "decode -> kdakit.recurrent_forward"),
    "extend": ("extend (eager, track_state snapshots, prefill CUDA graphs) -> kdakit chunk_kda",),
    "verify": ("target_verify of chains and trees (snapshots) -> kdakit.tree_verify",),
}
ON_SGLANG = {
    "decode": ("packed_decode with ReplaySSM rings (--enable-linear-replayssm)",),
    "extend": (),
    "verify": ("target_verify with ReplaySSM rings (cache_ring, --enable-linear-replayssm-spec)",
               "target_verify of ragged layouts (DSpARK / DFLASH qo_indptr)"),
}

OUTSIDE_KERNEL = ("the short convs", "Kimi K3's fused decode (kda_fused_decode, when the model hands it the norm gate)",
                  "the DSpARK CuTe verify (nv_cutedsl on SM10x)",
                  "phases given another --linear-attn-*-backend (flashinfer, cutedsl, helion, ...)")

# True while sglang's KDA backend runs a ragged verify batch (set by the VERIFY_TARGET hook).
_ragged_verify = contextvars.ContextVar("kdakit_sglang_ragged_verify", default=False)
# The kernel class register() made (a container: sglang's patch rebinds module globals that
# are the original class, and this must keep pointing at ours).
_registered: dict = {}
_warned: set = set()


def installed_sglang_version() -> str | None:
    """sglang's version from its distribution metadata (no import of sglang)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def enabled_phases() -> tuple[str, ...]:
    """The phases ``KDAKIT_SGLANG_PHASES`` gives to kdakit (all when unset or empty)."""
    raw = os.environ.get(PHASES_ENV, "").strip()
    if not raw:
        return ALL_PHASES
    phases = tuple(p.strip() for p in raw.split(",") if p.strip())
    unknown = sorted(set(phases) - set(ALL_PHASES))
    if unknown:
        raise ValueError(f"{PHASES_ENV}={raw!r} names unknown phases {unknown}; use a comma-separated subset of "
                         f"{', '.join(ALL_PHASES)}.")
    return tuple(p for p in ALL_PHASES if p in phases)


def refusal_reason() -> str | None:
    """Why the plugin must not activate in this process, or None."""
    version = installed_sglang_version()
    if version not in SUPPORTED_SGLANG_VERSIONS:
        return (f"sglang {version or '(not installed)'} is not a version whose KDA call sites this kdakit was "
                f"written against ({', '.join(SUPPORTED_SGLANG_VERSIONS)})")
    if torch.version.hip is not None:
        return "this is a ROCm build of torch; kdakit's kernels are built and checked for CUDA only"
    try:
        enabled_phases()
    except ValueError as err:
        return str(err)
    return None


def routing_table(phases) -> str:
    """The startup line: what runs on kdakit, what stays on sglang's kernel."""
    on_kdakit = [line for p in phases for line in ON_KDAKIT[p]]
    on_sglang = [line for p in ALL_PHASES for line in (ON_SGLANG[p] if p in phases else (f"all of {p}",))]
    return ("kdakit runs sglang's KDA kernel calls: " + "; ".join(on_kdakit or ["none"])
            + ". sglang's own Triton kernel runs: " + "; ".join(on_sglang or ["nothing"])
            + ". sglang's own code, which never calls the kernel object: " + "; ".join(OUTSIDE_KERNEL) + ".")


def _fallback(reason: str) -> None:
    """One warning per reason and process: a call kdakit does not cover runs sglang's kernel."""
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("kdakit: %s runs on sglang's own Triton KDA kernel (kdakit does not cover it).", reason)


def _replayssm_decode(kwargs) -> bool:
    return any(kwargs.get(n) is not None for n in ("replayssm_d", "replayssm_k", "replayssm_g", "replayssm_write_pos"))


def make_kernel_class(base, phases=ALL_PHASES):
    """The subclass of sglang's ``TritonKDAKernel`` (``base``) that routes ``phases`` to kdakit."""
    import kdakit
    from kdakit.compat.sglang import chunk_kda, fused_sigmoid_gating_delta_rule_update

    phases = tuple(phases)
    decode_on, extend_on, verify_on = ("decode" in phases), ("extend" in phases), ("verify" in phases)

    class KdakitKDAKernel(base):
        """sglang's KDA kernel object with kdakit's kernels (see ``kdakit.integrations.sglang``)."""

        kdakit_phases = phases
        # The attributes sglang's KDA backend reads, with what this class actually does.
        supports_packed_decode = True if decode_on else getattr(base, "supports_packed_decode", False)
        supports_packed_decode_safe_gate = True if decode_on else getattr(base, "supports_packed_decode_safe_gate",
                                                                          False)
        supports_track_state_snapshot = True if extend_on else getattr(base, "supports_track_state_snapshot", False)
        supports_safe_gate = True  # the extend kernel: both kdakit and the base take lower_bound
        supports_safe_gate_verify = True
        # The fused chain verify is sglang's own kernel called outside this object; False sends
        # every chain verify through target_verify.
        supports_fused_chain_verify = False if verify_on else getattr(base, "supports_fused_chain_verify", False)
        uses_state_checkpoints = False
        _announced = [False]

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not KdakitKDAKernel._announced[0]:
                KdakitKDAKernel._announced[0] = True
                logger.info(routing_table(phases))

        # -- decode ---------------------------------------------------------------------
        def packed_decode(self, mixed_qkv, a, b, *, A_log, dt_bias, scale, ssm_states, cache_indices, num_v_heads,
                          head_v_dim, lower_bound=None, **kwargs):
            if not decode_on or _replayssm_decode(kwargs):
                if decode_on:
                    _fallback("packed_decode with ReplaySSM rings")
                return super().packed_decode(mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias, scale=scale,
                                             ssm_states=ssm_states, cache_indices=cache_indices,
                                             num_v_heads=num_v_heads, head_v_dim=head_v_dim,
                                             lower_bound=lower_bound, **kwargs)
            if ssm_states.dim() != 4 or tuple(ssm_states.shape[1:3]) != (num_v_heads, head_v_dim):
                raise ValueError(f"packed_decode: `ssm_states` must be [slots, num_v_heads={num_v_heads}, "
                                 f"head_v_dim={head_v_dim}, K] (got {tuple(ssm_states.shape)}).")
            B = mixed_qkv.shape[0]
            out = mixed_qkv.new_empty(B, 1, num_v_heads, head_v_dim)
            kdakit.packed_decode(mixed_qkv, a.reshape(B, -1), b.reshape(B, -1), A_log.reshape(-1),
                                 dt_bias.reshape(-1), ssm_states, cache_indices, out, scale=scale,
                                 use_qk_l2norm=True, lower_bound=lower_bound)
            return out.transpose(0, 1)  # [1, B, HV, V], as sglang's decode paths return

        def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
                   lower_bound=None, **kwargs):
            if not decode_on:
                return super().decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                                      cache_indices=cache_indices, query_start_loc=query_start_loc,
                                      lower_bound=lower_bound, **kwargs)
            T, HV, V, K = q.shape[1], v.shape[2], v.shape[3], q.shape[3]
            out = torch.zeros((1, T, HV, V), dtype=q.dtype, device=q.device)
            kdakit.recurrent_forward(q, k, v, a.reshape(1, T, HV, K), b.reshape(1, T, HV), ssm_states,
                                     cache_indices, cu_seqlens=query_start_loc, A_log=A_log.reshape(-1),
                                     dt_bias=dt_bias.reshape(-1), lower_bound=lower_bound, beta_is_logit=True,
                                     use_qk_l2norm=True, out=out)
            return out

        # -- extend ---------------------------------------------------------------------
        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log=None,
                   dt_bias=None, lower_bound=None, beta_is_raw=False, return_intermediate_states=False, **kwargs):
            if not extend_on:
                return super().extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                                      query_start_loc=query_start_loc, A_log=A_log, dt_bias=dt_bias,
                                      lower_bound=lower_bound, beta_is_raw=beta_is_raw,
                                      return_intermediate_states=return_intermediate_states, **kwargs)
            track_state, track_chunk_idx = kwargs.get("track_state"), kwargs.get("track_chunk_idx")
            T, HV, K = q.shape[1], v.shape[2], q.shape[3]
            if g.dim() != 4:
                g = g.reshape(1, T, HV, K)
            # sglang reads the per-chunk states h only when it passed no snapshot buffer.
            want_h = bool(return_intermediate_states) and track_state is None
            result = chunk_kda(q, k, v, g, beta.reshape(1, T, HV), initial_state=ssm_states,
                               initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True,
                               cu_seqlens=query_start_loc, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                               output_intermediate_states=want_h, track_state=track_state,
                               track_chunk_idx=track_chunk_idx, beta_is_raw=bool(beta_is_raw))
            if want_h or not return_intermediate_states:
                return result
            return result, None

        # -- verify ---------------------------------------------------------------------
        def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                          intermediate_states_buffer, intermediate_state_indices, cache_steps, retrieve_parent_token,
                          lower_bound=None, cache_ring=False, replayssm_rawv=None, replayssm_rawk=None,
                          replayssm_g=None, replayssm_beta=None, **kwargs):
            N = query_start_loc.shape[0] - 1
            rings = (replayssm_rawv, replayssm_rawk, replayssm_g, replayssm_beta)
            reason = None
            if cache_ring or any(r is not None for r in rings) or intermediate_states_buffer is None:
                reason = "target_verify with ReplaySSM rings"
            elif _ragged_verify.get() or N <= 0 or q.shape[1] != N * int(cache_steps):
                reason = "target_verify of a ragged layout"
            if not verify_on or reason is not None:
                if verify_on:
                    _fallback(reason)
                return super().target_verify(
                    A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, ssm_states=ssm_states,
                    cache_indices=cache_indices, query_start_loc=query_start_loc,
                    intermediate_states_buffer=intermediate_states_buffer,
                    intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                    retrieve_parent_token=retrieve_parent_token, lower_bound=lower_bound, cache_ring=cache_ring,
                    replayssm_rawv=replayssm_rawv, replayssm_rawk=replayssm_rawk, replayssm_g=replayssm_g,
                    replayssm_beta=replayssm_beta, **kwargs)
            # sglang's tables run past the batch (padded rows); its kernel reads the first N.
            if cache_indices.shape[0] < N or intermediate_state_indices.shape[0] < N:
                raise ValueError(f"target_verify: `cache_indices` ({cache_indices.shape[0]}) and "
                                 f"`intermediate_state_indices` ({intermediate_state_indices.shape[0]}) need an "
                                 f"entry for each of the {N} requests of `query_start_loc`.")
            return fused_sigmoid_gating_delta_rule_update(
                A_log.reshape(-1), a, dt_bias, 1.0, 20.0, q, k, v, b, ssm_states, cache_indices[:N],
                use_qk_l2norm_in_kernel=True, cu_seqlens=query_start_loc, is_kda=True, lower_bound=lower_bound,
                disable_state_update=True, intermediate_states_buffer=intermediate_states_buffer,
                intermediate_state_indices=intermediate_state_indices[:N], cache_steps=cache_steps,
                retrieve_parent_token=retrieve_parent_token)

    KdakitKDAKernel.__qualname__ = KdakitKDAKernel.__name__
    KdakitKDAKernel.__module__ = __name__
    return KdakitKDAKernel


def _mark_ragged_verify(original, self, layer, forward_batch, *args, **kwargs):
    """AROUND hook of KDAAttnBackend._forward_target_verify: flags a ragged batch for the kernel."""
    spec_info = getattr(forward_batch, "spec_info", None)
    token = _ragged_verify.set(getattr(spec_info, "ragged_verify_layout", None) is not None)
    try:
        return original(self, layer, forward_batch, *args, **kwargs)
    finally:
        _ragged_verify.reset(token)


def register():
    """The ``sglang.srt.plugins`` entry point (sglang's ``load_plugins`` calls it with no
    arguments): registers the kernel class REPLACE, or logs why not. Returns the class, or None."""
    if "cls" in _registered:
        return _registered["cls"]
    reason = refusal_reason()
    if reason is not None:
        logger.warning("kdakit sglang plugin NOT active: %s. sglang's own KDA kernels stay in place.", reason)
        return None
    module = importlib.import_module(KDA_TRITON_MODULE)
    base = getattr(module, "TritonKDAKernel", None)
    missing = [m for m in KERNEL_METHODS if base is None or not callable(getattr(base, m, None))]
    if missing:
        logger.warning("kdakit sglang plugin NOT active: %s lacks %s. sglang's own KDA kernels stay in place.",
                       KERNEL_TARGET, ", ".join(missing))
        return None
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    phases = enabled_phases()
    cls = make_kernel_class(base, phases)
    HookRegistry.register(KERNEL_TARGET, cls, HookType.REPLACE)
    if "verify" in phases:
        HookRegistry.register(VERIFY_TARGET, _mark_ragged_verify, HookType.AROUND)
    _registered["cls"] = cls
    logger.info("kdakit sglang plugin active (sglang %s): %s replaced by %s.%s. %s", installed_sglang_version(),
                KERNEL_TARGET, __name__, cls.__name__, routing_table(phases))
    return cls
