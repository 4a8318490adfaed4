"""Hugging Face transformers' Kimi Linear (``KimiLinearForCausalLM``) on kdakit's kernels.

``enable()`` makes every Kimi Linear model of the process run its KDA layers on kdakit:

- prefill: the short conv through ``kdakit.causal_conv1d_varlen`` (``kdakit.compat.causal_conv1d``)
  and the recurrence through kdakit's chunked prefill (``kdakit.compat.fla.chunk_kda``);
- decode: the conv update through ``kdakit.causal_conv1d_update`` and the recurrence through
  kdakit's recurrent forward (``kdakit.compat.fla.fused_recurrent_kda_fwd``).

transformers' ``KimiLinearDeltaAttention.forward`` looks four functions up by name in its
module on every call (``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``,
``causal_conv1d_fn``, ``causal_conv1d_update``); ``enable()`` rebinds those names, so the
model's own cache objects (``DynamicCache`` with its conv and recurrent states) and
``generate()`` are unchanged, and it works whether transformers picked fla / causal-conv1d,
a hub kernel or its PyTorch loops when it was imported (with fla-core and Triton installed
on a machine without a GPU, transformers binds fla's Triton kernels, which cannot run there:
``enable()`` makes such a model run). ``disable()`` restores what was there.

The names are not a public transformers API, so ``enable()`` checks the layer rather than the
version: the module binds the four names, ``KimiLinearDeltaAttention.forward`` calls them, reads
its cache in one of the forms kdakit was written against (``LAYER_FORMS``: transformers 5.17-5.20
read ``cache.layers[i].conv_states[0]`` after ``has_previous_state(i)``; 5.21-5.23 call
``cache.get_conv_state(i, state_idx=0)`` / ``get_recurrent_state(...)``), and transformers' own
bodies of the four functions take no parameter kdakit's replacements do not. When one of these
fails it raises ``IntegrationError`` (a ``RuntimeError``) naming what is missing; a release
outside the tested range (``TESTED``) whose layer passes them gets a ``RuntimeWarning``. Calls
that kdakit cannot run exactly (packed sequences through ``cu_seq_lens_*`` / ``seq_idx``, an
activation other than SiLU) raise ``ValueError`` instead of computing something else.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings

import torch

# The transformers releases (major, minor) whose Kimi Linear was read and run with kdakit, first
# and last; the `transformers` extra asks for the same range.
TESTED = ((5, 17), (5, 23))
REQUIREMENT = "transformers>=5.17,<5.24"
MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
REPLACED = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
            "causal_conv1d_update")

_originals: dict | None = None


class IntegrationError(RuntimeError):
    """kdakit cannot be plugged into this transformers installation."""


# ----------------------------------------------------------------------------
# The four replacements, with the parameters transformers' own torch bodies take
# ----------------------------------------------------------------------------
# Keywords the model forwards from its ``**kwargs`` (TransformersKwargs) that no KDA kernel uses.
_IGNORED_KWARGS = frozenset({"num_items_in_batch", "output_hidden_states", "output_attentions",
                             "output_router_logits", "max_length_q", "max_length_k", "position_ids", "is_causal"})
# Packed (padding-free) sequences: one row holding several sequences. transformers' own
# kernels disagree on them (the conv honours seq_idx, the recurrence never sees cu_seqlens),
# so rather than pick one of those results, refuse.
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def _check_kwargs(fn: str, kwargs: dict) -> None:
    for key, value in kwargs.items():
        if key in _PACKED_KWARGS:
            if value is not None:
                raise ValueError(f"{fn} (kdakit): packed sequences (`{key}`) are not supported by the kdakit "
                                 "integration; pass each sequence as its own row with an attention mask.")
        elif key not in _IGNORED_KWARGS:
            raise ValueError(f"{fn} (kdakit): unexpected keyword `{key}`; kdakit.integrations.transformers knows "
                             f"the calls of transformers {_tested()}.")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # kdakit's kernels read a head's K (or V) values as one contiguous run. transformers' q/k/v
    # are views of the conv output: channel-last when our conv made them (already fine), with a
    # last-dim stride of T when the conv input was a cached window + new tokens (copied here).
    return t if t.stride(-1) == 1 else t.contiguous()


def chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunked KDA (prefill) on kdakit's chunked prefill. ``chunk_size`` only
    tiles the computation, so kdakit's own 64-token chunks give the same function."""
    from ..compat.fla import chunk_kda
    _check_kwargs("chunk_kimi_delta_attention", kwargs)
    q, k, v, g = (_last_dim_contiguous(t) for t in (query, key, value, g))
    return chunk_kda(q, k, v, g, _last_dim_contiguous(beta), initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def recurrent_kimi_delta_attention(query, key, value, g, beta, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' token-by-token KDA (decode) on kdakit's recurrent forward."""
    from ..compat.fla import fused_recurrent_kda, fused_recurrent_kda_fwd
    _check_kwargs("recurrent_kimi_delta_attention", kwargs)
    q, k, v, g, beta = (_last_dim_contiguous(t) for t in (query, key, value, g, beta))
    if (output_final_state and initial_state is not None and initial_state.dtype == torch.float32
            and initial_state.shape[0] == q.shape[0]):
        # The decode step's only caller copies the returned state into `initial_state` (the
        # cache's recurrent state) right after; updating it in place gives the same cache and
        # the same outputs without a second state-sized allocation and copy.
        return fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=initial_state, inplace_final_state=True,
                                       output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return fused_recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' stateless prefill conv on kdakit's varlen conv; the output is channel-last
    (so the q/k/v split after it is contiguous in the last dim)."""
    from ..compat.causal_conv1d import ACTIVATIONS, _conv_fn
    _check_kwargs("causal_conv1d_fn", kwargs)
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d_fn (kdakit): the model's activation {activation!r} is not supported "
                         "(kdakit's short conv applies SiLU or nothing: hidden_act 'silu' / 'swish').")
    return _conv_fn(hidden_states, weight, bias, None, None, False, None, activation, channel_last_out=True)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """transformers' decode conv (state ``[B, D, W]``, shifted in place) on kdakit's conv update."""
    from ..compat.causal_conv1d import ACTIVATIONS, causal_conv1d_update as update
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d_update (kdakit): the model's activation {activation!r} is not supported "
                         "(kdakit's short conv applies SiLU or nothing: hidden_act 'silu' / 'swish').")
    return update(hidden_states, conv_state, weight, bias=bias, activation=activation)


_REPLACEMENTS = {"chunk_kimi_delta_attention": chunk_kimi_delta_attention,
                 "recurrent_kimi_delta_attention": recurrent_kimi_delta_attention,
                 "causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update}


# ----------------------------------------------------------------------------
# enable / disable
# ----------------------------------------------------------------------------
def _tested() -> str:
    (a, b), (c, d) = TESTED
    return f"{a}.{b}-{c}.{d}"


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError as e:
        raise IntegrationError("kdakit.integrations.transformers needs transformers: pip install "
                               f"'kdakit[transformers]' ({REQUIREMENT}).") from e
    return transformers.__version__


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '5.20.1' or '5.24.0.dev0'; None when it has none."""
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    minor = "".join(itertools.takewhile(str.isdigit, parts[1]))
    return (int(parts[0]), int(minor)) if minor else None


# How KimiLinearDeltaAttention.forward reads its layer's cache: the names each form's forward uses
# (attributes and methods of `cache_params`). kdakit's replacements behave the same under both: the
# decode calls get the cache's own conv state (shifted in place) and recurrent state, and the
# forward copies the returned state into the cache (`update_recurrent_state`) right after.
LAYER_FORMS = {
    "layers": ("transformers 5.17-5.20: cache.has_previous_state(i), then cache.layers[i].conv_states[0] / "
               ".recurrent_states[0]; decode when that holds and seq_len == 1",
               ("has_previous_state", "layers", "conv_states", "recurrent_states")),
    "accessors": ("transformers 5.21-5.23: cache.get_conv_state(i, state_idx=0) / get_recurrent_state(...), "
                  "None before the first write; decode when conv_state is not None and seq_len == 1",
                  ("get_conv_state", "get_recurrent_state")),
}
# Every form writes the cache through these (the prefill conv window, the final recurrent state).
CACHE_WRITES = ("update_conv_state", "update_recurrent_state")


def _forward_names(kl) -> set:
    forward = inspect.unwrap(kl.KimiLinearDeltaAttention.forward)
    return set(getattr(getattr(forward, "__code__", None), "co_names", ()))


def layer_form(kl=None) -> str:
    """The key in ``LAYER_FORMS`` of how the installed ``KimiLinearDeltaAttention.forward`` reads
    its cache (``IntegrationError`` naming what is missing when it is none of them)."""
    if kl is None:
        kl = kimi_linear_module()
    called = _forward_names(kl)
    version = _transformers_version()
    missing_writes = [n for n in CACHE_WRITES if n not in called]
    if missing_writes:
        raise IntegrationError(f"transformers {version}'s KimiLinearDeltaAttention.forward does not write its cache "
                               f"through {', '.join(missing_writes)}: a form kdakit was not written against.")
    lacks = {}
    for key, (_, names) in LAYER_FORMS.items():
        lacks[key] = [n for n in names if n not in called]
        if not lacks[key]:
            return key
    raise IntegrationError(
        f"transformers {version}'s KimiLinearDeltaAttention.forward reads its cache in no form kdakit knows: "
        + "; ".join(f"{LAYER_FORMS[k][0].split(':')[0]} form ({k}) needs {', '.join(v)}" for k, v in lacks.items())
        + ", which it does not use.")


def _torch_body(fn):
    """transformers' PyTorch body behind a bound name (its fallback decorator keeps it as
    ``__wrapped__``), or None when it cannot be found (a hub-kernel module, say)."""
    body = inspect.unwrap(fn) if callable(fn) and hasattr(fn, "__wrapped__") else None
    return None if body is None or body is fn else body


def _check_parameters(kl, version: str) -> None:
    """Every named parameter of transformers' own body of each name is one kdakit's replacement
    takes (the forward calls the name as it would call the body)."""
    for name in REPLACED:
        body = _torch_body(_originals[name] if _originals is not None else getattr(kl, name))
        if body is None:
            continue
        ours = inspect.signature(_REPLACEMENTS[name]).parameters
        theirs = inspect.signature(body).parameters
        unknown = [p for p, v in theirs.items() if v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD) and p not in ours]
        if unknown:
            raise IntegrationError(f"transformers {version}'s {name} takes {', '.join(unknown)}, which kdakit's "
                                   f"replacement does not: a call kdakit was not written against.")


def kimi_linear_module(allow_untested_version: bool = False):
    """transformers' Kimi Linear modeling module, after checking that kdakit can plug into it:
    the four names bound and called by the KDA layer's forward, its cache read in a known form
    (``layer_form``), transformers' bodies of the four taking no parameter kdakit's do not. A
    release outside ``TESTED`` that passes these gets a ``RuntimeWarning`` (none with
    ``allow_untested_version=True``)."""
    version = _transformers_version()
    import importlib
    try:
        kl = importlib.import_module(MODULE)
    except ImportError as e:
        raise IntegrationError(f"transformers {version} has no Kimi Linear model ({MODULE}): {e}") from e
    missing = [name for name in (*REPLACED, "KimiLinearDeltaAttention") if not hasattr(kl, name)]
    if missing:
        raise IntegrationError(f"transformers {version}'s Kimi Linear has no {', '.join(missing)}: kdakit cannot "
                               "replace its KDA kernels.")
    called = _forward_names(kl)
    not_called = [name for name in REPLACED if name not in called]
    if not_called:
        raise IntegrationError(f"transformers {version}'s KimiLinearDeltaAttention.forward does not call "
                               f"{', '.join(not_called)} by name: rebinding it would change nothing.")
    layer_form(kl)
    _check_parameters(kl, version)
    release = _release(version)
    if not allow_untested_version and (release is None or not TESTED[0] <= release <= TESTED[1]):
        warnings.warn(f"kdakit.integrations.transformers was tested on transformers {_tested()} ({REQUIREMENT}); "
                      f"this is {version}. Its Kimi Linear layer looks like a known form, so kdakit plugs in; "
                      "check the outputs (kdakit demo).", RuntimeWarning, stacklevel=3)
    return kl


def enable(allow_untested_version: bool = False) -> None:
    """Run every transformers Kimi Linear model's KDA layers on kdakit (process-wide; models
    built before or after). Calling it again does nothing; ``disable()`` undoes it."""
    global _originals
    kl = kimi_linear_module(allow_untested_version)
    if _originals is not None:
        return
    _originals = {name: getattr(kl, name) for name in REPLACED}
    for name, fn in _REPLACEMENTS.items():
        setattr(kl, name, fn)


def disable() -> None:
    """Restore transformers' own KDA kernels (a no-op when not enabled)."""
    global _originals
    if _originals is None:
        return
    import importlib
    kl = importlib.import_module(MODULE)
    for name, fn in _originals.items():
        setattr(kl, name, fn)
    _originals = None


def is_enabled() -> bool:
    return _originals is not None


@contextlib.contextmanager
def enabled(allow_untested_version: bool = False):
    """``with enabled(): ...``: kdakit inside the block, the previous kernels after it."""
    was = is_enabled()
    enable(allow_untested_version)
    try:
        yield
    finally:
        if not was:
            disable()


def original(name: str):
    """The function transformers had bound to ``name`` before ``enable()`` (the current one when not enabled)."""
    if name not in REPLACED:
        raise ValueError(f"{name!r} is not one of the replaced names {REPLACED}.")
    if _originals is not None:
        return _originals[name]
    import importlib
    return getattr(importlib.import_module(MODULE), name)


def torch_functions(allow_untested_version: bool = False) -> dict:
    """transformers' own PyTorch bodies of the four functions (its fallback when fla and
    causal-conv1d are absent), whatever it bound at import: the readable reference that
    kdakit's tests and ``kdakit demo`` compare against on a machine without a GPU."""
    kl = kimi_linear_module(allow_untested_version)
    out = {}
    for name in REPLACED:
        fn = original(name) if _originals is not None else getattr(kl, name)
        body = _torch_body(fn)
        if body is None:
            raise IntegrationError(f"cannot find transformers' PyTorch body behind {name} ({fn!r}).")
        out[name] = body
    return out


@contextlib.contextmanager
def torch_fallback(allow_untested_version: bool = False):
    """``with torch_fallback(): ...``: transformers' Kimi Linear on its own PyTorch bodies inside
    the block (as without fla / causal-conv1d installed), whatever was bound before, restored after."""
    kl = kimi_linear_module(allow_untested_version)
    bodies = torch_functions(allow_untested_version)
    saved = {name: getattr(kl, name) for name in REPLACED}
    for name, fn in bodies.items():
        setattr(kl, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(kl, name, fn)


# ----------------------------------------------------------------------------
# A tiny model (kdakit demo, tests): no download, random weights from a seed
# ----------------------------------------------------------------------------
TINY_CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "dense", "sparse"], num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, initializer_range=0.1)


def tiny_model(seed: int = 0, dtype=torch.float32, device="cpu", **overrides):
    """A ``KimiLinearForCausalLM`` of ``TINY_CONFIG`` (3 KDA layers, 1 MLA layer, 2 MoE MLPs;
    ~200k parameters) with seeded random weights, in eval mode. ``initializer_range`` 0.1
    (not 0.02) so that random weights give logits with clear argmaxes."""
    kimi_linear_module()
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    config = KimiLinearConfig(**{**TINY_CONFIG, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = KimiLinearForCausalLM(config)
    return model.eval().to(device=device, dtype=dtype)
