"""kdakit.compat.fla against the scenarios of fla's own forward-only KDA tests.

fla's ``tests/ops/test_kda.py`` runs ``chunk_kda`` / ``fused_recurrent_kda`` /
``fused_recurrent_kda_fwd`` with: ``A_log`` shaped ``[1, 1, H, 1]``, head dims 60, 100, 128
and 256, log-decays with -1000 entries (masked channels), the gate in kernel on and off
(default and safe gate, ``A_log`` / ``dt_bias`` None), ``state_v_first`` and the sigmoid of
beta in kernel, fp16 and fp32 inputs. These tests run the same scenarios (same shapes,
dtypes and options, a shorter T) on the drop-ins, checked against fla's plain-torch naive
references (``naive_recurrent_kda`` and its gate functions), with fla's tolerance: a
relative error of at most 5e-3. All on the reference backend; a few tiny ones under the
Triton interpreter (``KDAKIT_BACKEND=triton``). ``benchmarks/gpu_fla_conformance.py`` runs
fla's own test module against the drop-ins on a GPU.
"""
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

from kdakit.compat.fla import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd

from helpers import rel_err

naive = pytest.importorskip("fla.ops.kda.naive")
gate_mod = pytest.importorskip("fla.ops.kda.gate")

TOL = 5e-3  # fla's forward tolerance for these tests


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "reference")


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")


def check(name, got, ref, tol=TOL):
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def oracle(q, k, v, g_log, beta, h0, scale=None):
    """fla's naive recurrence in float32 (inputs upcast, so the oracle itself does not round)."""
    return naive.naive_recurrent_kda(q.float(), k.float(), v.float(), g_log.float(), beta.float(), scale=scale,
                                     initial_state=h0, output_final_state=True)


def poisoned_copy(g):
    """``g`` in a buffer followed by 1e30s: a kernel that reads past the last head dim of a
    non-power-of-two D turns the result non-finite instead of silently reading zeros."""
    D = g.shape[-1]
    pad = 1 << (D - 1).bit_length()
    buf = torch.full((g.numel() + pad,), 1e30, dtype=g.dtype)
    return buf[:g.numel()].view_as(g).copy_(g)


# ----------------------------------------------------------------------------
# chunk_kda: fla's test_chunk_varlen_prefill (varlen, -1000 masks, A_log [1, 1, H, 1])
# ----------------------------------------------------------------------------
def varlen_prefill_inputs(H, D, mask_p, cu, dtype, use_gate_in_kernel, safe_gate, seed=42):
    gen = torch.Generator().manual_seed(seed)
    T, N = cu[-1], len(cu) - 1
    q = torch.randn(1, T, H, D, generator=gen).to(dtype)
    k = F.normalize(torch.randn(1, T, H, D, generator=gen), p=2, dim=-1).to(dtype)
    v = torch.randn(1, T, H, D, generator=gen).to(dtype)
    g = torch.randn(1, T, H, D, generator=gen).to(dtype if use_gate_in_kernel else torch.float)
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log = torch.log(torch.empty(1, 1, H, 1).uniform_(1, 16, generator=gen))
        dt_bias = torch.randn(H * D, generator=gen)
    else:
        g = F.logsigmoid(g) * (torch.rand(g.shape, generator=gen) > mask_p)
    mask = torch.rand(g.shape, generator=gen) > mask_p
    g = g * mask + (~mask) * (-1000)  # masked channels: the raw gate or the log-decay is -1000
    if safe_gate:
        g = g.clamp(-5, 0)
    beta = torch.rand(1, T, H, generator=gen).sigmoid().to(dtype)
    h0 = torch.randn(N, H, D, D, generator=gen)
    return q, k, v, g, beta, A_log, dt_bias, h0


def varlen_oracle(q, k, v, g, beta, A_log, dt_bias, h0, cu, use_gate_in_kernel):
    outs, finals = [], []
    for i in range(len(cu) - 1):
        s = slice(cu[i], cu[i + 1])
        g_i = gate_mod.naive_kda_gate(g[:, s].float(), A_log, dt_bias) if use_gate_in_kernel else g[:, s]
        o, ht = oracle(q[:, s], k[:, s], v[:, s], g_i, beta[:, s], h0[i])
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, 1), torch.cat(finals, 0)


# fla's cases (H, D, mask_p, dtype, gate in kernel, safe gate) with shorter sequences; the
# 70-token sequences cross kdakit's 64-token chunk.
VARLEN_PREFILL = [
    (4, 60, 0.1, [0, 15], torch.float16, True, False),
    (2, 64, 0.9, [0, 25, 44, 70], torch.float16, True, False),
    (2, 128, 0.5, [0, 25, 44, 70], torch.float16, False, False),
    (2, 100, 0, [0, 15, 30, 40], torch.float16, True, False),
    (1, 256, 0, [0, 6, 15], torch.float16, False, True),
]


@pytest.mark.parametrize("H,D,mask_p,cu,dtype,use_gate_in_kernel,safe_gate", VARLEN_PREFILL,
                         ids=[f"D{c[1]}-mask{c[2]}-gate{c[5]}-safe{c[6]}" for c in VARLEN_PREFILL])
def test_chunk_varlen_prefill(H, D, mask_p, cu, dtype, use_gate_in_kernel, safe_gate):
    q, k, v, g, beta, A_log, dt_bias, h0 = varlen_prefill_inputs(H, D, mask_p, cu, dtype, use_gate_in_kernel,
                                                                 safe_gate)
    o, ht = chunk_kda(F.normalize(q, p=2, dim=-1), k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                      initial_state=h0.clone(), output_final_state=True, cu_seqlens=torch.LongTensor(cu),
                      cu_seqlens_cpu=torch.LongTensor(cu), use_gate_in_kernel=use_gate_in_kernel,
                      safe_gate=safe_gate, disable_recompute=False)
    ref, ref_ht = varlen_oracle(F.normalize(q.float(), p=2, dim=-1), k, v, g, beta, A_log, dt_bias, h0, cu,
                                use_gate_in_kernel)
    assert o.dtype == dtype and ht.dtype == torch.float32
    check("o", o, ref)
    check("ht", ht, ref_ht)


@pytest.mark.parametrize("gate", ["default", "safe", "safe-no-A", "log-safe"])
def test_chunk_equal_length_gate_options(gate):
    """fla's test_chunk forward: a [B, T] batch, GVA, the gate in kernel (A_log [HV], dt_bias
    [HV*K]) or log-decays clamped to [-5, 0] with safe_gate, the L2 norm in kernel."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, HV, D = 2, 24, 1, 2, 64  # fla: B=2, T=1024, H=2, HV=4
    q, k = torch.rand(B, T, H, D, generator=gen).half(), torch.rand(B, T, H, D, generator=gen).half()
    v = torch.rand(B, T, HV, D, generator=gen).half()
    g = torch.randn(B, T, HV, D, generator=gen)
    beta = torch.randn(B, T, HV, generator=gen).sigmoid().half()
    h0 = torch.randn(B, HV, D, D, generator=gen)
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV * D, generator=gen)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    if gate == "default":
        g_log = gate_mod.naive_kda_gate(g, A_log, dt_bias)
    elif gate in ("safe", "safe-no-A"):
        kw.update(safe_gate=True, lower_bound=-5.0, A_log=A_log if gate == "safe" else None)
        g_log = gate_mod.naive_kda_lowerbound_gate(g, kw["A_log"], dt_bias)
    else:
        g = F.logsigmoid(g).clamp(-5, 0)
        g_log, kw = g, dict(safe_gate=True, lower_bound=-5.0)
    o, ht = chunk_kda(q, k, v, g.half() if "A_log" in kw else g, beta, scale=0.1, initial_state=h0.clone(),
                      output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    if "A_log" in kw:  # the oracle sees the raw gate the kernel saw
        g_log = (gate_mod.naive_kda_gate(g.half(), A_log, dt_bias) if gate == "default"
                 else gate_mod.naive_kda_lowerbound_gate(g.half(), kw["A_log"], dt_bias))
    ref, ref_ht = oracle(F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1), v, g_log, beta, h0,
                         scale=0.1)
    check("o", o, ref)
    check("ht", ht, ref_ht)


# ----------------------------------------------------------------------------
# fused_recurrent_kda: fla's test_fused_recurrent (poisoned g for non-power-of-two D)
# ----------------------------------------------------------------------------
FUSED_RECURRENT = [
    (1, 16, 1, 1, 64, 1, 1, False),
    (2, 12, 3, 3, 60, 1, 1, False),
    (2, 6, 2, 2, 100, 0.1, 1, True),
    (1, 6, 2, 2, 128, 0.1, 1, False),
    (2, 12, 2, 4, 60, 1, 1, False),
    (1, 6, 1, 4, 128, 0.1, 1, True),
    (1, 4, 1, 1, 256, 0.1, 1, False),
]


@pytest.mark.parametrize("B,T,H,HV,D,scale,normalizer,l2_in_kernel", FUSED_RECURRENT,
                         ids=[f"B{c[0]}-H{c[2]}-HV{c[3]}-D{c[4]}-l2{c[7]}" for c in FUSED_RECURRENT])
def test_fused_recurrent(B, T, H, HV, D, scale, normalizer, l2_in_kernel):
    gen = torch.Generator().manual_seed(42)
    q, k = torch.rand(B, T, H, D, generator=gen), torch.rand(B, T, H, D, generator=gen)
    v = torch.rand(B, T, HV, D, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, D, generator=gen)) / normalizer
    beta = torch.randn(B, T, HV, generator=gen).sigmoid()
    h0 = torch.randn(B, HV, D, D, generator=gen)
    qn, kn = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
    o, ht = fused_recurrent_kda(q if l2_in_kernel else qn, k if l2_in_kernel else kn, v, poisoned_copy(g), beta,
                                scale=scale, initial_state=h0.clone(), output_final_state=True,
                                use_qk_l2norm_in_kernel=l2_in_kernel)
    ref, ref_ht = oracle(qn, kn, v, g, beta, h0, scale=scale)
    check("o", o, ref)
    check("ht", ht, ref_ht)


@pytest.mark.parametrize("B,T,H,D,allow_neg_eigval", [(2, 16, 4, 64, False), (2, 16, 4, 64, True),
                                                      (1, 20, 3, 60, True)])
def test_fused_recurrent_use_beta_sigmoid_in_kernel(B, T, H, D, allow_neg_eigval):
    gen = torch.Generator().manual_seed(42)
    q, k, v = (torch.rand(B, T, H, D, generator=gen) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, T, H, D, generator=gen))
    beta_post = torch.randn(B, T, H, generator=gen).sigmoid()
    beta_raw = torch.logit(beta_post.clamp(1e-4, 1 - 1e-4))
    h0 = torch.randn(B, H, D, D, generator=gen)
    qn, kn = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
    o, ht = fused_recurrent_kda(qn, kn, v, g, beta_raw, initial_state=h0.clone(), output_final_state=True,
                                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval)
    ref, ref_ht = oracle(qn, kn, v, g, torch.sigmoid(beta_raw) * (2 if allow_neg_eigval else 1), h0)
    check("o", o, ref)
    check("ht", ht, ref_ht)


@pytest.mark.parametrize("B,T,H,D,scale", [(1, 16, 1, 64, 1), (2, 8, 2, 60, 1), (2, 6, 2, 100, 0.1),
                                           (1, 6, 2, 128, 0.1)])
def test_fused_recurrent_state_v_first(B, T, H, D, scale):
    gen = torch.Generator().manual_seed(42)
    q, k, v = (torch.rand(B, T, H, D, generator=gen) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, T, H, D, generator=gen))
    beta = torch.randn(B, T, H, generator=gen).sigmoid()
    h0_kv = torch.randn(B, H, D, D, generator=gen)
    h0_vk = h0_kv.transpose(-1, -2).contiguous()
    qn, kn = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
    ref, ref_ht = oracle(qn, kn, v, g, beta, h0_kv, scale=scale)
    o_kv, ht_kv = fused_recurrent_kda(qn, kn, v, g, beta, scale=scale, initial_state=h0_kv.clone(),
                                      output_final_state=True, state_v_first=False)
    o_vk, ht_vk = fused_recurrent_kda(qn, kn, v, g, beta, scale=scale, initial_state=h0_vk.clone(),
                                      output_final_state=True, state_v_first=True)
    check("o k-major", o_kv, ref)
    check("o v-major", o_vk, ref)
    check("ht k-major", ht_kv, ref_ht)
    check("ht v-major", ht_vk.transpose(-1, -2), ref_ht)
    check("v-major against k-major", o_vk, o_kv, 1e-4)  # fla's own tolerance between the layouts
    with pytest.warns(DeprecationWarning):
        fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, transpose_state_layout=True)
    with pytest.raises(ValueError):
        fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, state_v_first=True, transpose_state_layout=True)


# fla's test_fused_recurrent_gate_in_kernel cases, A_log / dt_bias in each shape fla reads.
GATE_IN_KERNEL = [
    (1, 16, 1, 1, 64, 1, True, False, False, torch.float, "flat"),
    (2, 12, 2, 2, 64, 1, True, True, False, torch.float, "fla-test"),
    (2, 12, 2, 4, 64, 0.1, True, True, True, torch.float16, "2d"),
    (1, 6, 1, 4, 128, 1, True, False, False, torch.float16, "fla-test"),
    (1, 6, 2, 2, 128, 0.1, True, True, True, torch.float16, "flat"),
    (1, 16, 1, 1, 64, 1, False, False, True, torch.float, "flat"),
    (2, 12, 2, 4, 64, 1, False, True, True, torch.float, "2d"),
    (1, 10, 3, 3, 60, 1, True, True, False, torch.float16, "fla-test"),
    (1, 8, 1, 2, 100, 1, True, True, True, torch.float, "2d"),
]


def shaped(A_log, dt_bias, HV, D, form):
    """``flat``: A_log [HV], dt_bias [HV*K]; ``fla-test``: A_log [1, 1, HV, 1] as fla's varlen
    tests make it; ``2d``: dt_bias [HV, K] (the layer's parameter shape)."""
    if form == "fla-test":
        return (None if A_log is None else A_log.view(1, 1, HV, 1)), dt_bias
    if form == "2d":
        return A_log, (None if dt_bias is None else dt_bias.view(HV, D))
    return A_log, dt_bias


@pytest.mark.parametrize("B,T,H,HV,D,scale,has_a_log,has_dt_bias,safe_gate,dtype,form", GATE_IN_KERNEL,
                         ids=[f"HV{c[3]}-D{c[4]}-A{c[6]}-bias{c[7]}-safe{c[8]}-{str(c[9])[6:]}-{c[10]}"
                              for c in GATE_IN_KERNEL])
def test_fused_recurrent_gate_in_kernel(B, T, H, HV, D, scale, has_a_log, has_dt_bias, safe_gate, dtype, form):
    gen = torch.Generator().manual_seed(42)
    q, k = torch.rand(B, T, H, D, generator=gen).to(dtype), torch.rand(B, T, H, D, generator=gen).to(dtype)
    v = torch.rand(B, T, HV, D, generator=gen).to(dtype)
    beta = torch.rand(B, T, HV, generator=gen).sigmoid().to(dtype)
    g_raw = torch.randn(B, T, HV, D, generator=gen)
    A_log = torch.log(torch.empty(HV).uniform_(1, 16, generator=gen)) if has_a_log else None
    dt_bias = torch.randn(HV * D, generator=gen) if has_dt_bias else None
    h0 = torch.randn(B, HV, D, D, generator=gen)
    lower_bound = -5.0 if safe_gate else None
    g_log = (gate_mod.naive_kda_lowerbound_gate(g_raw, A_log, dt_bias) if safe_gate
             else gate_mod.naive_kda_gate(g_raw, A_log, dt_bias))
    a_in, b_in = shaped(A_log, dt_bias, HV, D, form)
    o, ht = fused_recurrent_kda(q, k, v, g_raw, beta, A_log=a_in, dt_bias=b_in, scale=scale,
                                initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                                use_gate_in_kernel=True, lower_bound=lower_bound)
    ref, ref_ht = oracle(F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1), v, g_log, beta, h0,
                         scale=scale)
    check("o", o, ref, 2e-3 if dtype == torch.float else TOL)  # fla: 2e-3 against its own kernel
    check("ht", ht, ref_ht, 2e-3 if dtype == torch.float else TOL)


@pytest.mark.parametrize("use_gate_in_kernel,safe_gate", [(False, False), (True, False), (True, True)])
def test_fused_recurrent_vllm_decode(use_gate_in_kernel, safe_gate):
    """fla's test_fused_recurrent_vllm_decode (GPU-only in fla): one token per request, the
    pool updated in place at random slots, the other slots untouched; A_log made as
    ``[1, 1, H, 1]`` then squeezed, as fla does."""
    gen = torch.Generator().manual_seed(42)
    B, H, D, scale, dtype = 5, 4, 64, 0.5, torch.bfloat16
    slots_total = B * 3
    pool = torch.randn(slots_total, H, D, D, generator=gen)
    idx = torch.randperm(slots_total, generator=gen)[:B].int()
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[idx.long()] = False
    pool[untouched] = 1e30
    q, k, v = (torch.rand(1, B, H, D, generator=gen).to(dtype) for _ in range(3))
    g = torch.randn(1, B, H, D, generator=gen).to(dtype if use_gate_in_kernel else torch.float)
    A_log = dt_bias = lower_bound = None
    if use_gate_in_kernel:
        A_log = torch.log(torch.empty(1, 1, H, 1).uniform_(1, 16, generator=gen)).squeeze()
        dt_bias = torch.randn(H * D, generator=gen)
        lower_bound = -5.0 if safe_gate else None
        g_log = (gate_mod.naive_kda_lowerbound_gate(g, A_log, dt_bias) if safe_gate
                 else gate_mod.naive_kda_gate(g, A_log, dt_bias))
    else:
        g = F.logsigmoid(g)
        g_log = g
    beta = torch.randn(1, B, H, generator=gen).sigmoid().to(dtype)
    ref_pool = pool.clone()
    refs = []
    for i in range(B):
        s, slot = slice(i, i + 1), int(idx[i])
        o_i, ht_i = oracle(F.normalize(q[:, s].float(), dim=-1), F.normalize(k[:, s].float(), dim=-1), v[:, s],
                           g_log[:, s], beta[:, s], ref_pool[slot:slot + 1].clone(), scale=scale)
        refs.append(o_i)
        ref_pool[slot] = ht_i[0]
    tri_pool = pool.clone()
    o, _ = fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                                   initial_state=tri_pool, scale=scale, output_final_state=False,
                                   inplace_final_state=True, cu_seqlens=torch.arange(B + 1, dtype=torch.int32),
                                   ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                                   use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound)
    check("o", o, torch.cat(refs, 1))
    check("ht", tri_pool[idx.long()], ref_pool[idx.long()])
    assert torch.equal(tri_pool[untouched], ref_pool[untouched]), "slots outside ssm_state_indices are untouched"


@pytest.mark.parametrize("D", [60, 100, 256])
def test_fused_recurrent_masked_log_decays(D):
    """Precomputed log-decays with -1000 entries (as fla's varlen tests mask channels) through
    the recurrent drop-in: finite and equal to fla's naive recurrence."""
    gen = torch.Generator().manual_seed(7)
    T, H = 8, 1
    cu = [0, 3, 8]
    q = F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
    v = torch.randn(1, T, H, D, generator=gen).half()
    g = F.logsigmoid(torch.randn(1, T, H, D, generator=gen))
    mask = torch.rand(g.shape, generator=gen) > 0.5
    g = g * mask + (~mask) * (-1000)
    beta = torch.rand(1, T, H, generator=gen).sigmoid()
    h0 = torch.randn(2, H, D, D, generator=gen)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True,
                                cu_seqlens=torch.LongTensor(cu))
    ref, ref_ht = varlen_oracle(q, k, v, g, beta, None, None, h0, cu, False)
    check("o", o, ref)
    check("ht", ht, ref_ht)


# ----------------------------------------------------------------------------
# Outside what kdakit supports: a ValueError that says so
# ----------------------------------------------------------------------------
def small(D=16, H=2, T=3):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, T, H, D, generator=gen), torch.randn(1, T, H, D, generator=gen),
            torch.randn(1, T, H, D, generator=gen), torch.randn(1, T, H, D, generator=gen),
            torch.rand(1, T, H, generator=gen))


@pytest.mark.parametrize("entry", ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd"])
def test_gate_parameter_counts_and_head_dims_refused(entry):
    fn = {"chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda,
          "fused_recurrent_kda_fwd": fused_recurrent_kda_fwd}[entry]
    q, k, v, g, b = small()
    extra = dict(inplace_final_state=False) if entry == "fused_recurrent_kda_fwd" else {}
    with pytest.raises(ValueError, match=r"`A_log` must have HV=2 elements.*got shape \(1, 1, 3, 1\)"):
        fn(q, k, v, g, b, A_log=torch.zeros(1, 1, 3, 1), dt_bias=torch.zeros(32), use_gate_in_kernel=True, **extra)
    with pytest.raises(ValueError, match=r"`dt_bias` must have HV\*K=32 elements.*got shape \(2, 15\)"):
        fn(q, k, v, g, b, A_log=torch.zeros(2), dt_bias=torch.zeros(2, 15), use_gate_in_kernel=True, **extra)
    q, k, v, g, b = small(D=288)
    with pytest.raises(ValueError, match=r"head dims must be in \[1, 256\]"):
        fn(q, k, v, g, b, **extra)


def test_gate_parameters_not_contiguous_are_read_by_value():
    """A strided ``A_log`` / ``dt_bias`` (fla's kernel would read them as if contiguous) gives
    the same result as contiguous copies."""
    q, k, v, g, b = small()
    A_full, bias_full = torch.randn(2, 2), torch.randn(16, 4)
    A_log, dt_bias = A_full[:, 0], bias_full.t()[1:3]           # [2] stride 2, [2, 16] strided
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, output_final_state=True)
    got = fused_recurrent_kda(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, **kw)
    want = fused_recurrent_kda(q, k, v, g, b, A_log=A_log.contiguous(), dt_bias=dt_bias.contiguous(), **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = chunk_kda(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, **kw)
    want = chunk_kda(q, k, v, g, b, A_log=A_log.contiguous(), dt_bias=dt_bias.contiguous(), **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------
# A tiny subset under the Triton interpreter
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("H,D,mask_p,cu,use_gate_in_kernel", [
    (2, 60, 0.1, [0, 15], True),          # A_log [1, 1, H, 1], non-power-of-two D
    (1, 100, 0.5, [0, 70, 80], False),    # -1000 log-decays across a chunk boundary
], ids=["D60-gate", "D100-masked"])
def test_triton_chunk_varlen_prefill(triton_backend, H, D, mask_p, cu, use_gate_in_kernel):
    q, k, v, g, beta, A_log, dt_bias, h0 = varlen_prefill_inputs(H, D, mask_p, cu, torch.float16,
                                                                 use_gate_in_kernel, False)
    o, ht = chunk_kda(F.normalize(q, p=2, dim=-1), k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                      initial_state=h0.clone(), output_final_state=True, cu_seqlens=torch.LongTensor(cu),
                      use_gate_in_kernel=use_gate_in_kernel)
    ref, ref_ht = varlen_oracle(F.normalize(q.float(), p=2, dim=-1), k, v, g, beta, A_log, dt_bias, h0, cu,
                                use_gate_in_kernel)
    check("o", o, ref)
    check("ht", ht, ref_ht)


def test_triton_fused_recurrent_odd_dim_gate_shapes(triton_backend):
    """D = 60 with poisoned g past the head dim, A_log [1, 1, HV, 1], dt_bias [HV, K], the safe gate."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, HV, D = 2, 4, 1, 2, 60
    q, k = torch.rand(B, T, H, D, generator=gen), torch.rand(B, T, H, D, generator=gen)
    v = torch.rand(B, T, HV, D, generator=gen)
    g_raw = torch.randn(B, T, HV, D, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV * D, generator=gen)
    h0 = torch.randn(B, HV, D, D, generator=gen)
    o, ht = fused_recurrent_kda(q, k, v, poisoned_copy(g_raw), beta, A_log=A_log.view(1, 1, HV, 1),
                                dt_bias=dt_bias.view(HV, D), initial_state=h0.clone(), output_final_state=True,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                                state_v_first=False)
    g_log = gate_mod.naive_kda_lowerbound_gate(g_raw, A_log, dt_bias)
    ref, ref_ht = oracle(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g_log, beta, h0)
    check("o", o, ref)
    check("ht", ht, ref_ht)
