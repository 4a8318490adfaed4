"""sglang's tree target-verify drop-ins (kdakit/compat/sglang_tree.py): parents from
first-child / next-sibling links, the tree conv, and fused_sigmoid_gating_delta_rule_update
(is_kda=True, retrieve_parent_token) equal to kdakit.tree_verify; unsupported modes raise."""
import pytest
import torch

import kdakit
from kdakit import reference
from kdakit.compat import sglang

BACKENDS = ["reference", "triton"]
W = 4


def links(parents_rows):
    """sglang's retrieve_next_token (first child) and retrieve_next_sibling of each node."""
    N, T = len(parents_rows), len(parents_rows[0])
    nxt = torch.full((N, T), -1, dtype=torch.int64)
    sib = torch.full((N, T), -1, dtype=torch.int64)
    for n, par in enumerate(parents_rows):
        last_child = {}
        for t in range(1, T):
            p = par[t]
            if p in last_child:
                sib[n, last_child[p]] = t
            else:
                nxt[n, p] = t
            last_child[p] = t
    return nxt, sib


TREES = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 0, 3, 3], [-1, 0, 1, 2, 3, 4]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_drop_in_follows_the_links(backend, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    g = torch.Generator().manual_seed(3)
    N, T, C, slots = 3, 6, 40, 5
    x_tok = torch.randn(N, T, C, generator=g).to(torch.bfloat16)
    conv_state = torch.randn(slots, C, W - 1, generator=g).to(torch.bfloat16)
    weight, bias = torch.randn(C, W, generator=g) * 0.5, torch.randn(C, generator=g) * 0.1
    slot_idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    rows = torch.tensor([2, 0, 1], dtype=torch.int32)
    inter = torch.full((4, T + 1, C, W - 1), 7.0, dtype=torch.bfloat16)
    nxt, sib = links(TREES)
    parent_out = torch.full((N, T), 99, dtype=torch.int64)
    before = conv_state.clone()
    out = sglang.causal_conv1d_update(x_tok.transpose(1, 2), conv_state, weight, bias, "silu",
                                      conv_state_indices=slot_idx, intermediate_conv_window=inter,
                                      intermediate_state_indices=rows, retrieve_next_token=nxt,
                                      retrieve_next_sibling=sib, retrieve_parent_token=parent_out)
    assert out.shape == (N, C, T)
    want_parents = torch.tensor(TREES)
    want_parents[:, 0] = 0  # sglang leaves node 0's entry 0
    assert torch.equal(parent_out, want_parents)
    assert torch.equal(conv_state, before), "the persistent windows are only read"
    for n in (0, 2):
        y, windows = reference.tree_conv(x_tok[n].float(), conv_state[int(slot_idx[n])].float(), weight, TREES[n],
                                         bias, activation_dtype=torch.bfloat16)
        tol = 0 if backend == "reference" else 1e-2  # the interpreter rounds to bf16 by truncation
        assert (out[n].transpose(0, 1).float() - y).abs().max() <= tol * y.abs().max()
        assert torch.equal(inter[int(rows[n]), :T], windows.to(torch.bfloat16))
    assert (inter[[0, 3]] == 7.0).all() and (inter[:, T] == 7.0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_sigmoid_gating_drop_in_equals_tree_verify(backend, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    g = torch.Generator().manual_seed(5)
    N, T, H, HV, K, V, slots = 3, 6, 1, 2, 16, 24, 5
    q, k = torch.randn(1, N * T, H, K, generator=g), torch.randn(1, N * T, H, K, generator=g)
    v, a = torch.randn(1, N * T, HV, V, generator=g), torch.randn(N * T, HV * K, generator=g)
    b = torch.randn(1, N * T, HV, generator=g)
    A_log, dt_bias = torch.rand(HV, generator=g), torch.randn(HV * K, generator=g) * 0.5
    state = torch.randn(slots, HV, V, K, generator=g) * 0.5
    slot_idx, rows = torch.tensor([3, -1, 0], dtype=torch.int32), torch.tensor([1, 2, 0], dtype=torch.int32)
    parents = torch.tensor(TREES, dtype=torch.int32)
    parents[:, 0] = 0
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    snaps = torch.full((3, T, HV, V, K), 7.0)
    o = sglang.fused_sigmoid_gating_delta_rule_update(
        A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, state, slot_idx, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        is_kda=True, lower_bound=-3.0, disable_state_update=True, intermediate_states_buffer=snaps,
        intermediate_state_indices=rows, cache_steps=T, retrieve_parent_token=parents)
    assert o.shape == v.shape and o.dtype == q.dtype
    want_snaps = torch.full_like(snaps, 7.0)
    want = kdakit.tree_verify(q.view(N, T, H, K), k.view(N, T, H, K), v.view(N, T, HV, V), a.view(N, T, HV, K),
                              b.view(N, T, HV), A_log, dt_bias, state, slot_idx, rows, parents,
                              snapshots=want_snaps, lower_bound=-3.0, backend=backend)
    assert torch.equal(o.view(N, T, HV, V), want)
    assert torch.equal(snaps, want_snaps)
    assert torch.equal(o.view(N, T, HV, V)[1], torch.zeros(T, HV, V))
    common = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu, is_kda=True, disable_state_update=True,
                  intermediate_states_buffer=snaps, intermediate_state_indices=rows)
    with pytest.raises(ValueError, match="is_kda=True"):
        sglang.fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, state, slot_idx,
                                                      **dict(common, is_kda=False))
    with pytest.raises(ValueError, match="target verify only"):
        sglang.fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, state, slot_idx,
                                                      **dict(common, disable_state_update=False))
    with pytest.raises(ValueError, match="softplus with beta=1"):
        sglang.fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, 2.0, 20.0, q, k, v, b, state, slot_idx,
                                                      **common)
