"""kdakit.compat.fla against fla-core 0.6.0: signature parity with fla's own functions,
results against fla's naive recurrence (fla's Triton kernels do not run on CPU), the
documented semantics (layouts, in place or not, indices) and the exact error texts."""
import inspect
import itertools

import pytest
import torch

from kdakit.compat.fla import fused_recurrent_kda, fused_recurrent_kda_fwd

from fla_oracle import fla_log_gate, fla_varlen
from helpers import POISON, assert_close, kda_params, sweep

BACKENDS = ["reference", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def cu_from(seqlens):
    return torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int64)


def inputs(H, HV, K, V, T, gen, B=1):
    return (torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
            torch.randn(B, T, HV, V, generator=gen), torch.randn(B, T, HV, K, generator=gen),
            torch.randn(B, T, HV, generator=gen))


# ----------------------------------------------------------------------------
# Signature parity
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fused_recurrent_kda", "fused_recurrent_kda_fwd"])
def test_signature_matches_fla(name):
    fr = pytest.importorskip("fla.ops.kda.fused_recurrent")
    import kdakit.compat.fla as ours
    theirs = inspect.signature(getattr(fr, name))
    mine = inspect.signature(getattr(ours, name))
    assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == \
           [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


# ----------------------------------------------------------------------------
# fused_recurrent_kda (public, never in place)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("state_v_first", [False, True], ids=["k-major", "v-major"])
@pytest.mark.parametrize("gate", sweep(["log", "default", "safe", "safe-no-A"], keep=2))
def test_public_varlen_against_fla_naive(backend, state_v_first, gate):
    gen = torch.Generator().manual_seed(20)
    H, HV, K, V = 1, 2, 16, 24
    seqlens = [2, 3]
    cu = cu_from(seqlens)
    q, k, v, g, b = inputs(H, HV, K, V, sum(seqlens), gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    h0_kmajor = torch.randn(2, HV, K, V, generator=gen)
    h0 = h0_kmajor.transpose(-1, -2).contiguous() if state_v_first else h0_kmajor.clone()
    h0_before = h0.clone()
    kw = {}
    if gate == "log":
        g = -torch.rand_like(g)
        g_log = g
    else:
        lb = None if gate == "default" else -2.0
        a_log = None if gate == "safe-no-A" else A_log
        kw = dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, lower_bound=lb)
        g_log = fla_log_gate(g, a_log, dt_bias, lb)
    o_fla, _, finals = fla_varlen(q, k, v, g_log, torch.sigmoid(b), cu, list(h0_kmajor), use_qk_l2norm=True)
    o, ht = fused_recurrent_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                state_v_first=state_v_first, cu_seqlens=cu, **kw)
    assert_close(o, o_fla, 1e-5, "o vs fla naive")
    assert ht.dtype == torch.float32 and ht is not h0
    expected = torch.stack(finals)
    assert_close(ht, expected.transpose(-1, -2) if state_v_first else expected, 1e-5, "final state")
    assert torch.equal(h0, h0_before), "fused_recurrent_kda never updates initial_state"


@pytest.mark.parametrize("cu,state_v_first,V", [
    pytest.param([2, 4, 7], False, 24, id="both-ends-kmajor"),
    pytest.param([0, 2, 6], False, 80, id="tail-kmajor-3-programs"),
    pytest.param([1, 3, 9], False, 24, id="head-kmajor"),
    pytest.param([0, 1, 2, 3, 4, 5], True, 40, id="tail-vmajor-one-token-2-tiles"),
])
def test_public_rows_outside_cu_seqlens_are_zero(backend, cu, state_v_first, V, monkeypatch):
    """fla allocates ``o`` zeroed; kdakit allocates it uninitialized and writes the rows of
    tokens before the first sequence and after the last as zeros itself (in every V tile of
    every program). A first sequence past token 0 passes only the default checks."""
    monkeypatch.delenv("KDAKIT_CHECKS", raising=False)
    gen = torch.Generator().manual_seed(23)
    H, HV, K, T = 1, 2, 16, 9
    q, k, v, g, b = inputs(H, HV, K, V, T, gen)
    first, last = cu[0], cu[-1]
    cu = torch.tensor(cu, dtype=torch.int64)
    g = -torch.rand_like(g)
    h0 = torch.randn(cu.numel() - 1, HV, K, V, generator=gen)
    real_empty_like = torch.empty_like
    # uninitialized memory that is not zero by chance
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: real_empty_like(x, **kw).fill_(POISON))
    o, _ = fused_recurrent_kda(q, k, v, g, b, initial_state=h0.transpose(-1, -2).contiguous() if state_v_first
                               else h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                               state_v_first=state_v_first)
    monkeypatch.setattr(torch, "empty_like", real_empty_like)
    assert torch.equal(o[0, :first], torch.zeros_like(o[0, :first])), "rows before the first sequence are zero"
    assert torch.equal(o[0, last:], torch.zeros_like(o[0, last:])), "rows after the last sequence are zero"
    assert bool(torch.isfinite(o[0, first:last]).all()) and bool((o[0, first:last] != POISON).all())
    if first == 0:
        o_fla, _, _ = fla_varlen(q, k, v, g, torch.sigmoid(b), cu, list(h0), use_qk_l2norm=True)
        assert_close(o[:, :last], o_fla[:, :last], 1e-5, "covered rows")


def test_public_equal_length_batch_no_state_and_neg_eigval(backend):
    gen = torch.Generator().manual_seed(21)
    B, T, H, HV, K, V = 2, 3, 1, 2, 16, 16
    q, k, v, g, b = inputs(H, HV, K, V, T, gen, B=B)
    q, k = q * K ** -0.5, k * K ** -0.5
    g = -torch.rand_like(g)
    o, ht = fused_recurrent_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, b, scale=0.3,
                                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, output_final_state=True)
    assert o.dtype == torch.bfloat16 and o.shape == v.shape and ht.shape == (B, HV, K, V)
    for i in range(B):
        o_fla, _, finals = fla_varlen(q[i:i + 1].bfloat16(), k[i:i + 1].bfloat16(), v[i:i + 1].bfloat16(),
                                      g[i:i + 1], 2 * torch.sigmoid(b[i:i + 1]), cu_from([T]), [None],
                                      use_qk_l2norm=False, scale=0.3)
        assert_close(o[i:i + 1], o_fla, 1e-2, f"o[{i}]")
        assert_close(ht[i], finals[0], 1e-5, f"ht[{i}]")
    o2, ht2 = fused_recurrent_kda(q, k, v, g, b)
    assert ht2 is None and o2.dtype == torch.float32


def test_public_error_texts_exact():
    gen = torch.Generator().manual_seed(22)
    q, k, v, g, b = inputs(1, 2, 16, 16, 3, gen, B=2)
    cu = cu_from([1, 2])
    with pytest.raises(ValueError) as e:
        fused_recurrent_kda(q, k, v, g, b, cu_seqlens=cu)
    assert str(e.value) == ("The batch size is expected to be 1 rather than 2 when using `cu_seqlens`."
                            "Please flatten variable-length inputs before processing.")
    h0 = torch.zeros(3, 2, 16, 16)
    with pytest.raises(ValueError) as e:
        fused_recurrent_kda(q[:1], k[:1], v[:1], g[:1], b[:1], initial_state=h0, cu_seqlens=cu)
    assert str(e.value) == ("The number of initial states is expected to be equal to the number of input "
                            "sequences, i.e., 2 rather than 3.")
    with pytest.raises(ValueError) as e:
        fused_recurrent_kda(q, k, v, g, b, allow_neg_eigval=True)
    assert str(e.value) == "`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`."
    with pytest.raises(ValueError) as e:
        fused_recurrent_kda(q, k, v, g, b, state_v_first=True, transpose_state_layout=True)
    assert str(e.value) == "Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`."
    assert torch.equal(h0, torch.zeros_like(h0))


def test_public_deprecated_transpose_state_layout(backend):
    gen = torch.Generator().manual_seed(23)
    q, k, v, g, b = inputs(1, 2, 16, 24, 2, gen)
    g = -torch.rand_like(g)
    b = torch.rand_like(b)
    h0 = torch.randn(1, 2, 24, 16, generator=gen)  # V-major
    with pytest.warns(DeprecationWarning):
        o, ht = fused_recurrent_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                    transpose_state_layout=True)
    o_ref, ht_ref = fused_recurrent_kda(q, k, v, g, b, initial_state=h0, output_final_state=True, state_v_first=True)
    assert ht.shape == (1, 2, 24, 16)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


def test_public_honours_indices_and_out(backend):
    """Documented difference: fla 0.6.0 drops ssm_state_indices / num_accepted_tokens / out."""
    gen = torch.Generator().manual_seed(24)
    H, HV, K, V = 1, 2, 16, 24
    q, k, v, g, b = inputs(H, HV, K, V, 3, gen)
    g, b = -torch.rand_like(g), torch.rand_like(b)
    pool = torch.randn(5, HV, K, V, generator=gen)  # K-major
    before = pool.clone()
    cu = cu_from([2, 1])
    idx = torch.tensor([[0, 3], [4, -1]], dtype=torch.int32)
    acc = torch.tensor([2, 1], dtype=torch.int32)
    out = torch.full_like(v, POISON)
    o, ht = fused_recurrent_kda(q, k, v, g, b, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                ssm_state_indices=idx, num_accepted_tokens=acc, out=out)
    o_fla, ts_fla, _ = fla_varlen(q, k, v, g, b, cu, [before[3], before[4]], use_qk_l2norm=False)
    assert o is out
    assert_close(out, o_fla, 1e-5)
    assert ht.shape == (3, HV, K, V)  # per-token states, not in place
    assert_close(ht, ts_fla, 1e-5)
    assert torch.equal(pool, before)


# ----------------------------------------------------------------------------
# fused_recurrent_kda_fwd (the serving entry)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("state_v_first", [False, True], ids=["k-major", "v-major"])
def test_fwd_inplace_decode_1d_indices(backend, state_v_first):
    """fla's sglang/vLLM decode call: one token per request, pool updated in place."""
    gen = torch.Generator().manual_seed(25)
    N, H, HV, K, V = 3, 2, 4, 16, 24
    q, k, v, a, b = inputs(H, HV, K, V, N, gen)
    A_log, dt_bias = kda_params(HV, K, generator=gen)
    shape = (6, HV, V, K) if state_v_first else (6, HV, K, V)
    pool = torch.randn(*shape, generator=gen)
    before = pool.clone()
    idx = torch.tensor([5, -1, 1], dtype=torch.int32)  # -1: zeros, never written (fla: out of bounds)
    cu = torch.arange(N + 1, dtype=torch.int32)
    out = torch.full_like(v, POISON)
    kmajor = lambda s: s.transpose(-1, -2) if state_v_first else s  # noqa: E731
    o_fla, _, finals = fla_varlen(q, k, v, fla_log_gate(a, A_log, dt_bias, None), torch.sigmoid(b), cu,
                                  [kmajor(before[5]), None, kmajor(before[1])], use_qk_l2norm=True)
    o, ht = fused_recurrent_kda_fwd(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                    state_v_first=state_v_first, cu_seqlens=cu, ssm_state_indices=idx,
                                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, out=out)
    assert o is out and ht is pool
    assert_close(out, o_fla, 1e-5)
    assert_close(kmajor(pool[5]), finals[0], 1e-5)
    assert_close(kmajor(pool[1]), finals[2], 1e-5)
    for s in (0, 2, 3, 4):
        assert torch.equal(pool[s], before[s])


def test_fwd_inplace_2d_indices_num_accepted(backend):
    gen = torch.Generator().manual_seed(26)
    H, HV, K, V = 1, 2, 16, 24
    seqlens = [3, 2]
    cu = cu_from(seqlens)
    q, k, v, g, b = inputs(H, HV, K, V, 5, gen)
    g = -torch.rand_like(g)
    pool = torch.randn(9, HV, K, V, generator=gen)  # K-major, fla's default
    before = pool.clone()
    idx = torch.tensor([[2, 6, 7], [8, 1, -1]], dtype=torch.int64)
    acc = torch.tensor([3, 2], dtype=torch.int64)  # start from slot 7 and slot 1
    o_fla, ts_fla, _ = fla_varlen(q, k, v, g, torch.sigmoid(b), cu, [before[7], before[1]], use_qk_l2norm=True)
    o, ht = fused_recurrent_kda_fwd(q, k, v, g, b, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                                    num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True)
    assert ht is pool
    assert_close(o, o_fla, 1e-5)
    for slot, t in ((2, 0), (6, 1), (7, 2), (8, 3), (1, 4)):
        assert_close(pool[slot], ts_fla[t], 1e-5, f"slot {slot} <- token {t}")
    for s in (0, 3, 4, 5):
        assert torch.equal(pool[s], before[s])


def test_fwd_not_inplace_per_sequence_and_errors(backend):
    gen = torch.Generator().manual_seed(27)
    H, HV, K, V = 1, 2, 16, 16
    q, k, v, g, b = inputs(H, HV, K, V, 3, gen)
    g, b = -torch.rand_like(g), torch.rand_like(b)
    cu = cu_from([1, 2])
    h0 = torch.randn(2, HV, K, V, generator=gen)
    before = h0.clone()
    o, ht = fused_recurrent_kda_fwd(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                    inplace_final_state=False, cu_seqlens=cu)
    _, _, finals = fla_varlen(q, k, v, g, b, cu, list(before), use_qk_l2norm=False)
    assert_close(ht, torch.stack(finals), 1e-5)
    assert torch.equal(h0, before)
    _, none = fused_recurrent_kda_fwd(q, k, v, g, b, initial_state=h0, inplace_final_state=False, cu_seqlens=cu)
    assert none is None
    with pytest.raises(ValueError, match="needs `initial_state`"):
        fused_recurrent_kda_fwd(q, k, v, g, b, cu_seqlens=cu)
    with pytest.raises(ValueError) as e:
        fused_recurrent_kda_fwd(q, k, v, g, b, initial_state=h0[:1], cu_seqlens=cu)
    assert str(e.value) == ("The number of initial states is expected to be equal to the number of input "
                            "sequences, i.e., 2 rather than 1.")
    with pytest.raises(ValueError) as e:  # a V-major pool passed as K-major (K != V shows it)
        fused_recurrent_kda_fwd(q, k, v[..., :8], g, b, initial_state=h0[..., :8].transpose(-1, -2).contiguous(),
                                cu_seqlens=cu)
    assert "state_v_first=True" in str(e.value)
    assert torch.equal(h0, before)


def test_identity_slots_cached_and_grown():
    """Sequence n uses state n: one cached arange per (device, stream), grown when a batch is
    larger; the smaller one is kept (a graph captured with it still reads it)."""
    from kdakit.compat import fla as compat
    from kdakit import buffers
    buffers._KEPT.pop(("identity slots", torch.device("cpu"), 0), None)
    small = compat.identity_slots(torch.device("cpu"), 3)
    assert small.tolist() == [0, 1, 2] and small.dtype == torch.int32
    again = compat.identity_slots(torch.device("cpu"), 5)
    assert again.data_ptr() == small.data_ptr(), "no new tensor while the cached one is long enough"
    big = compat.identity_slots(torch.device("cpu"), 5000)
    assert torch.equal(big, torch.arange(5000, dtype=torch.int32))
    kept = buffers._KEPT[("identity slots", torch.device("cpu"), 0)]
    assert kept[0].data_ptr() == small.data_ptr() and kept[-1].data_ptr() == big.data_ptr()


def test_public_no_sequence_gives_zero_rows(backend, monkeypatch):
    """cu_seqlens of no sequence: every row of the allocated ``o`` is outside, so zero."""
    monkeypatch.delenv("KDAKIT_CHECKS", raising=False)
    gen = torch.Generator().manual_seed(24)
    q, k, v, g, b = inputs(1, 2, 16, 16, 4, gen)
    o, ht = fused_recurrent_kda(q, k, v, -torch.rand_like(g), b, cu_seqlens=torch.tensor([2], dtype=torch.int64),
                                output_final_state=True)
    assert torch.equal(o, torch.zeros_like(o)) and ht.shape[0] == 0
