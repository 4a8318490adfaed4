"""kdakit.compat.causal_conv1d (causal-conv1d 1.7's signatures on kdakit's conv kernels):
against an independent float64 conv (torch.nn.functional.conv1d), against transformers'
PyTorch bodies of the same two functions, on both backends; what it refuses, it refuses
with a ValueError before touching anything."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from kdakit.compat.causal_conv1d import causal_conv1d_fn, causal_conv1d_update


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def conv64(x, w, bias=None, init=None, activation=None):
    """The causal depthwise conv in float64: ``init`` (zeros) before the first token."""
    B, D, T = x.shape
    W = w.shape[1]
    init = torch.zeros(B, D, W - 1, dtype=torch.float64) if init is None else init.double()
    full = torch.cat([init, x.double()], -1)
    out = F.conv1d(full, w.double().unsqueeze(1), None if bias is None else bias.double(), groups=D)
    if activation is not None:
        out = F.silu(out)
    return out, full[..., -(W - 1):]


def make_x(B, D, T, layout, dtype, gen):
    if layout == "channel_last":  # a [B, T, D] tensor seen as [B, D, T], as transformers passes it
        return torch.randn(B, T, D, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(B, D, T, generator=gen).to(dtype)


@pytest.mark.parametrize("layout,B,D,T,W,activation", [
    ("contiguous", 2, 24, 9, 4, "silu"), ("channel_last", 2, 24, 9, 4, None), ("contiguous", 1, 16, 3, 4, "swish"),
    ("channel_last", 3, 8, 5, 2, "silu")])
def test_fn_against_float64(backend, layout, B, D, T, W, activation):
    gen = torch.Generator().manual_seed(B * 100 + T)
    x = make_x(B, D, T, layout, torch.float32, gen)
    w, bias = torch.randn(D, W, generator=gen) * 0.5, torch.randn(D, generator=gen) * 0.1
    out = causal_conv1d_fn(x, w, bias, activation=activation)
    ref, _ = conv64(x, w, bias, activation=activation)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.stride() == x.stride(), "the output keeps x's layout (causal-conv1d allocates it empty_like)"
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_fn_initial_and_final_states(backend, layout):
    gen = torch.Generator().manual_seed(3)
    B, D, T, W = 2, 12, 2, 4  # T < W-1: the final window still holds initial columns
    x = make_x(B, D, T, layout, torch.float32, gen)
    w = torch.randn(D, W, generator=gen)
    init = torch.randn(B, D, W - 1, generator=gen)
    init_before = init.clone()
    out, final = causal_conv1d_fn(x, w, initial_states=init, return_final_states=True, activation="silu")
    ref, ref_final = conv64(x, w, init=init, activation="silu")
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(final.double(), ref_final)
    assert torch.equal(init, init_before), "initial_states is read, never written"
    into = torch.full((B, D, W - 1), float("nan"))
    out2, final2 = causal_conv1d_fn(x, w, return_final_states=True, final_states_out=into)
    assert final2 is into
    ref2, ref_final2 = conv64(x, w)
    torch.testing.assert_close(out2.double(), ref2, atol=2e-6, rtol=1e-5)
    assert torch.equal(into.double(), ref_final2)


def test_fn_bf16_weights_and_activations(backend):
    """A bf16 model hands over bf16 conv weights and activations: the conv runs in float32 on the
    bf16 values and rounds its output once."""
    gen = torch.Generator().manual_seed(5)
    x = make_x(2, 16, 6, "channel_last", torch.bfloat16, gen)
    w = (torch.randn(16, 4, generator=gen) * 0.5).to(torch.bfloat16)
    out = causal_conv1d_fn(x, w, activation="silu")
    ref, _ = conv64(x, w, activation="silu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("S,T,activation", [(3, 1, "silu"), (4, 1, "silu"), (4, 3, "silu"), (6, 1, None),
                                             (6, 2, "silu")],
                         ids=["S=W-1", "S=W(transformers)", "S=W-3-tokens", "S=W+2-no-act", "S=W+2-2-tokens"])
def test_update_against_float64(backend, S, T, activation):
    gen = torch.Generator().manual_seed(S * 10 + T)
    B, D, W = 3, 20, 4
    state = torch.randn(B, D, S, generator=gen)
    x = torch.randn(B, T, D, generator=gen).transpose(1, 2)  # as transformers' decode step passes it
    w = torch.randn(D, W, generator=gen) * 0.5
    full = torch.cat([state, x], -1).double()
    ref = F.conv1d(full, w.double().unsqueeze(1), groups=D)[..., -T:]
    ref = F.silu(ref) if activation else ref
    out = causal_conv1d_update(x, state, w, activation=activation)
    assert out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(state.double(), full[..., -S:]), "the whole state shifts by T, newest column last"


def test_update_2d_x_and_state_indices(backend):
    gen = torch.Generator().manual_seed(11)
    slots, B, D, W = 5, 3, 8, 4
    state = torch.randn(slots, D, W, generator=gen)
    before = state.clone()
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)  # -1: a padding row
    x = torch.randn(B, D, generator=gen)
    w = torch.randn(D, W, generator=gen)
    out = causal_conv1d_update(x, state, w, activation="silu", conv_state_indices=idx)
    assert out.shape == (B, D)
    for row, s in enumerate(idx.tolist()):
        if s < 0:
            assert torch.equal(out[row], torch.zeros(D))
            continue
        full = torch.cat([before[s], x[row, :, None]], -1).double()
        ref = F.silu(F.conv1d(full[None], w.double().unsqueeze(1), groups=D)[0, :, -1])
        torch.testing.assert_close(out[row].double(), ref, atol=2e-6, rtol=1e-5)
        assert torch.equal(state[s].double(), full[..., -W:])
    for s in (1, 2, 4):
        assert torch.equal(state[s], before[s]), "rows no index names stay untouched"


def test_against_transformers_torch_bodies(backend):
    kt = pytest.importorskip("kdakit.integrations.transformers")
    pytest.importorskip("transformers")
    bodies = kt.torch_functions()
    gen = torch.Generator().manual_seed(2)
    B, D, T, W = 2, 24, 7, 4
    x = make_x(B, D, T, "channel_last", torch.float32, gen)
    w = torch.randn(D, W, generator=gen)
    torch.testing.assert_close(causal_conv1d_fn(x, w, activation="silu"),
                               bodies["causal_conv1d_fn"](x, w, activation="silu"), atol=2e-6, rtol=1e-5)
    state = torch.randn(B, D, W, generator=gen)
    step = torch.randn(B, 1, D, generator=gen).transpose(1, 2)
    theirs_state = state.clone()
    theirs = bodies["causal_conv1d_update"](step, theirs_state, w, None, "silu")
    ours = causal_conv1d_update(step, state, w, activation="silu")
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)
    assert torch.equal(state, theirs_state)


def test_signatures_are_causal_conv1d_s():
    assert list(inspect.signature(causal_conv1d_fn).parameters) == [
        "x", "weight", "bias", "seq_idx", "initial_states", "return_final_states", "final_states_out", "activation"]
    assert list(inspect.signature(causal_conv1d_update).parameters) == [
        "x", "conv_state", "weight", "bias", "activation", "cache_seqlens", "conv_state_indices"]


@pytest.mark.parametrize("case,match", [
    (dict(seq_idx=torch.zeros(1, 5, dtype=torch.int32)), "seq_idx"),
    (dict(activation="gelu"), "activation"),
    (dict(initial_states=torch.zeros(1, 8, 2)), "initial_states"),
    (dict(final_states_out=torch.zeros(1, 8, 3)), "return_final_states"),
])
def test_fn_refuses_clearly(case, match):
    with pytest.raises(ValueError, match=match):
        causal_conv1d_fn(torch.randn(1, 8, 5), torch.randn(8, 4), **case)


def test_update_refuses_clearly():
    state = torch.randn(2, 8, 4)
    before = state.clone()
    with pytest.raises(ValueError, match="cache_seqlens"):
        causal_conv1d_update(torch.randn(2, 8), state, torch.randn(8, 4), cache_seqlens=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="S >= W-1"):
        causal_conv1d_update(torch.randn(2, 8), torch.randn(2, 8, 2), torch.randn(8, 4))
    with pytest.raises(ValueError, match="channels"):
        causal_conv1d_update(torch.randn(2, 9), state, torch.randn(8, 4))
    assert torch.equal(state, before)
