"""Every drop-in's parameters against its peer's: names, positional order, kinds and defaults.

fla's signatures are read with ``inspect.signature`` from the installed fla-core package
(skipped when it is not importable). sglang does not import on a machine without a GPU, so
its signatures are transcribed below, as data, from the sglang 0.5.23 wheel's source (the
file of each function is named next to it); update them with sglang.
"""
import inspect

import pytest
import torch

import kdakit.compat.fla as kfla
import kdakit.compat.sglang as ksgl

REQ = inspect.Parameter.empty
P, KW, VAR_KW = "positional", "keyword-only", "**kwargs"


def described(fn):
    """``[(name, kind, default)]`` with the kinds reduced to positional / keyword-only / **kwargs."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        kind = {inspect.Parameter.POSITIONAL_OR_KEYWORD: P, inspect.Parameter.KEYWORD_ONLY: KW,
                inspect.Parameter.VAR_KEYWORD: VAR_KW}[p.kind]
        out.append((p.name, kind, p.default if kind != VAR_KW else REQ))
    return out


# ----------------------------------------------------------------------------
# fla-core (installed)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,module", [("chunk_kda", "fla.ops.kda.chunk"),
                                         ("fused_recurrent_kda", "fla.ops.kda.fused_recurrent"),
                                         ("fused_recurrent_kda_fwd", "fla.ops.kda.fused_recurrent")])
def test_fla_signature(name, module):
    theirs = getattr(pytest.importorskip(module), name)
    assert described(getattr(kfla, name)) == described(theirs)


# ----------------------------------------------------------------------------
# sglang 0.5.23 (transcribed from its source)
# ----------------------------------------------------------------------------
def pos(*items):
    """Positional-or-keyword parameters: a bare name is required, a pair has a default."""
    return [(i, P, REQ) if isinstance(i, str) else (i[0], P, i[1]) for i in items]


def kwonly(*items):
    return [(i, KW, REQ) if isinstance(i, str) else (i[0], KW, i[1]) for i in items]


VAR = [("kwargs", VAR_KW, REQ)]
PAD_SLOT_ID = -1  # sglang/kernels/ops/mamba/causal_conv1d_triton.py

SGLANG = {
    # sglang/kernels/ops/mamba/causal_conv1d_triton.py (the one sglang's KDA backend imports)
    "causal_conv1d_fn": pos(
        "x", "weight", "bias", "conv_states", "query_start_loc", "seq_lens_cpu", ("cache_indices", None),
        ("has_initial_state", None), ("activation", "silu"), ("pad_slot_id", PAD_SLOT_ID),
        ("validate_data", False), ("block_table", None)) + VAR,
    # sglang/kernels/ops/mamba/causal_conv1d_triton.py
    "causal_conv1d_update": pos(
        "x", "conv_state", "weight", ("bias", None), ("activation", None), ("cache_seqlens", None),
        ("conv_state_indices", None), ("num_accept_tokens", None), ("intermediate_conv_window", None),
        ("intermediate_state_indices", None), ("retrieve_next_token", None), ("retrieve_next_sibling", None),
        ("retrieve_parent_token", None), ("pad_slot_id", PAD_SLOT_ID), ("metadata", None),
        ("validate_data", False)),
    # sglang/kernels/ops/attention/fla/kda.py
    "chunk_kda": pos(
        "q", "k", "v", "g", "beta", ("scale", None), ("initial_state", None), ("initial_state_indices", None),
        ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None), ("A_log", None), ("dt_bias", None),
        ("lower_bound", None), ("output_intermediate_states", False), ("track_state", None),
        ("track_chunk_idx", None), ("beta_is_raw", False), ("chunk_indices", None),
        ("chunk_offsets", None)) + VAR,
    # sglang/kernels/ops/attention/fla/fused_recurrent.py
    "fused_recurrent_kda_packed_decode": pos(
        "mixed_qkv", "a", "b", "A_log", "dt_bias", "scale", "initial_state", "out", "ssm_state_indices",
        ("use_qk_l2norm_in_kernel", False), ("lower_bound", None)),
    # sglang/kernels/ops/attention/helion/kda_decode.py
    "helion_fused_recurrent_kda_packed_decode": pos(
        "mixed_qkv", "a", "b", "A_log", "dt_bias", "scale", "initial_state", "out", "ssm_state_indices",
        ("use_qk_l2norm_in_kernel", False), ("lower_bound", None)),
    # sglang/kernels/ops/attention/kda_decode_mtp.py
    "fused_kda_decode_mtp_dspark": kwonly(
        "x_q", "x_k", "x_v", "w_q", "w_k", "w_v", "cs_q", "cs_k", "cs_v", "g", "beta", "A_log", "dt_bias",
        "recurrent_state", "intermediate_ssm", "intermediate_state_indices", "intermediate_conv_q",
        "intermediate_conv_k", "intermediate_conv_v", "ssm_state_indices", "cu_seqlens", "lower_bound",
        ("scale", None), ("replayssm_rawv", None), ("replayssm_rawk", None), ("replayssm_g", None),
        ("replayssm_beta", None), ("onorm_gate", None), ("onorm_weight", None), ("onorm_eps", None)),
    # sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py
    "fused_sigmoid_gating_delta_rule_update": pos(
        "A_log", "a", "dt_bias", "softplus_beta", "softplus_threshold", "q", "k", "v", "b",
        "initial_state_source", "initial_state_indices", ("scale", None), ("use_qk_l2norm_in_kernel", False),
        ("cu_seqlens", None), ("is_kda", False), ("lower_bound", None), ("disable_state_update", False),
        ("intermediate_states_buffer", None), ("intermediate_state_indices", None), ("cache_steps", None),
        ("retrieve_parent_token", None), ("cache_ring", False), ("replayssm_rawv", None),
        ("replayssm_rawk", None), ("replayssm_g", None), ("replayssm_beta", None),
        ("match_cutedsl_decode", False)),
    # sglang/kernels/ops/attention/linear/kda_replayssm_spec_decode.py (both functions)
    "commit_kda_replayssm_spec": pos(
        "checkpoint_state", "rawv_cache", "rawk_cache", "gk_cache", "beta_cache", "ssm_state_indices",
        "accept_lens", "max_cache_len", "num_k_heads", ("mamba_track_indices", None),
        ("mamba_steps_to_track", None), ("use_qk_l2norm_in_kernel", True), ("null_block_id", 0)),
}
SGLANG["commit_kda_replayssm_spec_all_layers"] = SGLANG["commit_kda_replayssm_spec"]


@pytest.mark.parametrize("name", sorted(SGLANG))
def test_sglang_signature(name):
    assert described(getattr(ksgl, name)) == SGLANG[name]


def test_every_sglang_drop_in_is_checked():
    """A new public function of kdakit.compat.sglang* needs its sglang signature above (the
    Helion packed decode is re-exported from kdakit.ops and listed there too)."""
    public = {n for n, f in vars(ksgl).items() if inspect.isfunction(f) and not n.startswith("_")
              and f.__module__.startswith("kdakit.compat")}
    assert public <= set(SGLANG), f"not checked: {sorted(public - set(SGLANG))}"


# ----------------------------------------------------------------------------
# sglang parameters kdakit takes but does not implement: refused, never ignored
# ----------------------------------------------------------------------------
def test_sglang_chunk_plan_with_intermediate_states_refused():
    x = torch.randn(1, 4, 1, 16)
    with pytest.raises(ValueError, match="chunk_indices"):
        ksgl.chunk_kda(x, x, x, x, torch.rand(1, 4, 1), initial_state=torch.zeros(1, 1, 16, 16),
                       initial_state_indices=torch.zeros(1, dtype=torch.int32), output_intermediate_states=True,
                       chunk_indices=torch.zeros(1, 2, dtype=torch.int32))


def test_sglang_match_cutedsl_decode_refused():
    x = torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="match_cutedsl_decode"):
        ksgl.fused_sigmoid_gating_delta_rule_update(torch.zeros(1), x.view(1, 2, 16), torch.zeros(16), 1.0, 20.0,
                                                    x, x, x, torch.zeros(1, 2, 1), torch.zeros(1, 1, 16, 16),
                                                    torch.zeros(1, dtype=torch.int32), is_kda=True,
                                                    use_qk_l2norm_in_kernel=True, match_cutedsl_decode=True)


def test_sglang_causal_conv1d_update_takes_metadata(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "reference")
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(2, 8, generator=gen), torch.randn(8, 4, generator=gen)
    state = torch.randn(2, 8, 3, generator=gen)
    s1, s2 = state.clone(), state.clone()
    a = ksgl.causal_conv1d_update(x, s1, weight, None, "silu")
    b = ksgl.causal_conv1d_update(x, s2, weight, None, "silu", metadata=object(), validate_data=True)
    assert torch.equal(a, b) and torch.equal(s1, s2)
