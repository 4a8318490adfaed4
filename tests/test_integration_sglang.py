"""kdakit as sglang 0.5.23's KDA kernel (kdakit/integrations/sglang.py), on sglang's own code:
the plugin loaded through sglang's ``load_plugins`` (the entry point of this package), sglang's
own ``KDAKernelDispatcher`` built per phase and found holding kdakit's kernel, then every call
site's argument pattern (``CALL_SITES``, from sglang/srt/layers/attention/linear/kda_backend.py
and kda_prefill_graph.py) driven through the dispatcher and checked against a float64
recurrence written here, with the pool bitwise unchanged where sglang requires it. On the
PyTorch reference backend and (tiny shapes) kdakit's Triton kernels in the interpreter.

Needs sglang's wheel without its dependencies plus a few small packages (see
tests/sglang_env.py and .ci/run); skipped when they are not installed."""
from __future__ import annotations

import itertools
import logging
import os

import pytest
import torch
import torch.nn.functional as F

import sglang_env

F64 = torch.float64
NAN = float("nan")

# ---------------------------------------------------------------------------------------------
# sglang 0.5.23's call sites into the KDA kernel object (through the dispatcher): positional
# names, then keywords, exactly as sglang passes them.
# ---------------------------------------------------------------------------------------------
CALL_SITES = {
    # sglang/srt/layers/attention/linear/kda_backend.py, KDAAttnBackend.forward_decode
    "packed_decode": dict(
        positional=("mixed_qkv", "a", "b"),
        keywords=("A_log", "dt_bias", "scale", "ssm_states", "cache_indices", "num_v_heads", "head_v_dim",
                  "lower_bound", "replayssm_d", "replayssm_k", "replayssm_g", "replayssm_write_pos",
                  "replayssm_force_flush")),
    # same function, the path without packed support (and sglang's K3 decode before kdakit)
    "decode": dict(
        positional=(),
        keywords=("q", "k", "v", "a", "b", "A_log", "dt_bias", "ssm_states", "cache_indices", "query_start_loc",
                  "lower_bound")),
    # kda_backend.py, KDAAttnBackend.forward_extend
    "extend_eager": dict(
        positional=(),
        keywords=("q", "k", "v", "g", "beta", "ssm_states", "cache_indices", "query_start_loc", "A_log", "dt_bias",
                  "lower_bound", "beta_is_raw", "extend_seq_lens_cpu", "extend_prefix_lens", "layer_id",
                  "is_spec_decode", "return_intermediate_states", "track_ssm_h_src", "track_state",
                  "track_chunk_idx", "state_checkpoint_cu_starts", "num_state_checkpoints",
                  "state_checkpoint_every_n_tokens", "state_checkpoint_indices", "track_ssm_h_batch_src")),
    # kda_prefill_graph.py, kda_extend_in_graph (breakable prefill CUDA graphs)
    "extend_graph": dict(
        positional=(),
        keywords=("q", "k", "v", "g", "beta", "ssm_states", "cache_indices", "query_start_loc", "A_log", "dt_bias",
                  "lower_bound", "beta_is_raw", "extend_seq_lens_cpu", "is_spec_decode",
                  "return_intermediate_states", "track_state", "track_chunk_idx", "chunk_indices", "chunk_offsets")),
    # kda_backend.py, KDAAttnBackend._forward_target_verify (keywords only)
    "target_verify": dict(
        positional=(),
        keywords=("A_log", "dt_bias", "q", "k", "v", "a", "b", "ssm_states", "cache_indices", "query_start_loc",
                  "intermediate_states_buffer", "intermediate_state_indices", "cache_steps",
                  "retrieve_parent_token", "lower_bound")),
}

H, HV, K, V = 2, 4, 16, 16          # grouped value heads (HV = 2 H), as sglang's tests allow
CONV_DIM = 2 * H * K + HV * V
LOWER_BOUND = -5.0                   # Kimi K3's safe gate


def call_site(method, site, values):
    """Calls a dispatcher method with exactly the arguments the call site passes."""
    spec = CALL_SITES[site]
    assert set(values) == set(spec["positional"]) | set(spec["keywords"]), \
        sorted(set(values) ^ (set(spec["positional"]) | set(spec["keywords"])))
    return method(*(values[n] for n in spec["positional"]),
                  **{n: values[n] for n in spec["keywords"]})


# ---------------------------------------------------------------------------------------------
# sglang, imported once per worker, with the plugin loaded through sglang's load_plugins
# ---------------------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@pytest.fixture(scope="module")
def sg():
    try:
        mods = sglang_env.import_sglang_kda()
    except ImportError as err:  # the wheel is CPython 3.11 only; CI installs it (.ci/run)
        pytest.skip(f"sglang 0.5.23's KDA modules do not import here ({err}); "
                    f"pip install --no-deps sglang==0.5.23 {' '.join(sglang_env.SGLANG_PACKAGES)}")
    kt = mods["sglang.srt.layers.attention.linear.kernels.kda_triton"]
    plugins = mods["sglang.srt.plugins"]
    # sglang's patch rebinds every module global that is the original class, this module's
    # included: the original is kept in a container.
    held = {"original": kt.TritonKDAKernel}
    records = _Records()
    for name in ("kdakit.integrations.sglang", "sglang.srt.plugins"):
        logging.getLogger(name).addHandler(records)
        logging.getLogger(name).setLevel(logging.INFO)
    old = os.environ.get("SGLANG_PLUGINS")
    os.environ["SGLANG_PLUGINS"] = "kdakit"
    try:
        plugins.load_plugins()
    finally:
        if old is None:
            del os.environ["SGLANG_PLUGINS"]
        else:
            os.environ["SGLANG_PLUGINS"] = old
    return dict(mods=mods, kt=kt, kb=mods["sglang.srt.layers.attention.linear.kda_backend"],
                lu=mods["sglang.srt.layers.attention.linear.utils"], plugins=plugins, held=held, log=records.lines,
                hooks=mods["sglang.srt.plugins.hook_registry"])


@pytest.fixture
def dispatcher(sg):
    B = sg["lu"].LinearAttnKernelBackend
    return sg["kb"].KDAKernelDispatcher(B.TRITON, B.TRITON, B.TRITON)


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


# ---------------------------------------------------------------------------------------------
# The float64 recurrence (sglang's conventions: gate, β = sigmoid(b), q/k L2 norm, K**-0.5)
# ---------------------------------------------------------------------------------------------
def l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gate64(a, A_log, dt_bias, lower_bound):
    x = a.double() + dt_bias.double().view(HV, K)
    A = A_log.double().reshape(HV, 1).exp()
    if lower_bound is None:
        return -A * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(A * x)


def steps64(q, k, v, a, b, A_log, dt_bias, S, *, lower_bound=None, beta_is_raw=True, scale=None):
    """Tokens ``q, k [T, H, K]``, ``v [T, HV, V]``, ``a [T, HV, K]``, ``b [T, HV]`` from state
    ``S [HV, V, K]``. Returns (o [T, HV, V], state after each token [T, HV, V, K])."""
    scale = K ** -0.5 if scale is None else scale
    rep = HV // H
    o, states = [], []
    S = S.double().clone()
    for t in range(q.shape[0]):
        qt = l2n(q[t].double()).repeat_interleave(rep, 0) * scale
        kt = l2n(k[t].double()).repeat_interleave(rep, 0)
        g = gate64(a[t], A_log, dt_bias, lower_bound)
        beta = torch.sigmoid(b[t].double()) if beta_is_raw else b[t].double()
        S = S * g.exp()[:, None, :]
        u = beta[:, None] * (v[t].double() - torch.einsum("hvk,hk->hv", S, kt))
        S = S + u[:, :, None] * kt[:, None, :]
        o.append(torch.einsum("hvk,hk->hv", S, qt))
        states.append(S.clone())
    return torch.stack(o), torch.stack(states)


def check(out, ref, tol, what):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = float((out - ref).abs().max())
    scale = max(1.0, float(ref.abs().max()))
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol * scale:.1e}"


def pool_words(pool):
    """The pool's whole storage (gaps between slots included) as int32 words."""
    n = (pool.shape[0] - 1) * pool.stride(0) + pool[0].numel()
    return torch.as_strided(pool, (n,), (1,)).view(torch.int32).clone()


def slot_words_mask(pool, slots):
    keep = torch.ones((pool.shape[0] - 1) * pool.stride(0) + pool[0].numel(), dtype=torch.bool)
    for s in slots:
        keep[s * pool.stride(0): s * pool.stride(0) + pool[0].numel()] = False
    return keep


def make_pool(gen, slots=9, gap=5):
    """``[slots, HV, V, K]`` float32 with a slot stride past HV*V*K (the page-major envelope
    view); gap words NaN, slot 0 the reserved dummy."""
    inner = HV * V * K
    flat = torch.full((slots * (inner + gap),), NAN)
    pool = flat.as_strided((slots, HV, V, K), (inner + gap, V * K, K, 1))
    for s in range(slots):
        pool[s] = torch.randn(HV, V, K, generator=gen) * 0.3
    return pool


def params(gen):
    A_log = (torch.rand(HV, generator=gen) * 2 - 1).view(1, 1, HV, 1)   # sglang's [1, 1, HV, 1]
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5
    return A_log, dt_bias


def conv_output(gen, T, dtype=torch.float32):
    """The post-conv ``[T, q|k|v]`` rows and sglang's views of them (strided, last dim contiguous)."""
    qkv = torch.randn(T, CONV_DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
    return qkv, q.unflatten(-1, (-1, K)).unsqueeze(0), k.unflatten(-1, (-1, K)).unsqueeze(0), \
        v.unflatten(-1, (-1, V)).unsqueeze(0)


def gate_slice(gen, T, dtype=torch.float32):
    """``a [T, HV*K]`` as a slice of a wider fused projection (row stride past HV*K)."""
    return torch.randn(T, HV * K + 24, generator=gen).to(dtype)[:, :HV * K]


# ---------------------------------------------------------------------------------------------
# The plugin, loaded by sglang
# ---------------------------------------------------------------------------------------------
def test_load_plugins_replaces_sglangs_kernel(sg):
    from kdakit.integrations import sglang as integ
    cls = sg["kt"].TritonKDAKernel
    assert cls is not sg["held"]["original"] and issubclass(cls, sg["held"]["original"])
    assert cls.__module__ == "kdakit.integrations.sglang"
    assert sg["kb"].TritonKDAKernel is cls          # the backend's own binding follows (isinstance checks)
    log = "\n".join(sg["log"])
    assert "Loaded plugin kdakit from group sglang.srt.plugins" in log
    assert "kdakit sglang plugin active (sglang 0.5.23)" in log
    assert "sglang's own Triton kernel runs: packed_decode with ReplaySSM rings" in log
    assert integ.register() is cls                  # idempotent: a second call registers nothing new


@pytest.mark.parametrize("verify", ["TRITON", "NV_CUTEDSL"])
def test_dispatcher_uses_kdakit_for_every_phase(sg, verify, caplog):
    B = sg["lu"].LinearAttnKernelBackend
    with caplog.at_level(logging.INFO):
        d = sg["kb"].KDAKernelDispatcher(B.TRITON, B.TRITON, getattr(B, verify))
    cls = sg["kt"].TritonKDAKernel
    for kernel in (d.decode_kernel, d.extend_kernel, d.verify_kernel, d.triton_kernel):
        assert type(kernel) is cls and isinstance(kernel, sg["kb"].TritonKDAKernel)
    assert d.supports_packed_decode is True and d.supports_packed_decode_safe_gate is True
    # the kernel the backend asserts on before a tracked extend, with and without the safe gate
    for lb in (None, LOWER_BOUND):
        eff = d.effective_extend_kernel(lb, 128, 2)
        assert type(eff) is cls and eff.supports_track_state_snapshot is True
    assert d.verify_kernel.supports_fused_chain_verify is False    # every chain verify reaches kdakit
    assert "decode=KdakitKDAKernel, verify=KdakitKDAKernel, extend=KdakitKDAKernel packed_decode=True" \
        in caplog.text


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("padding", ["eager_slot0", "graph_minus1"])
@pytest.mark.parametrize("lower_bound", [None, LOWER_BOUND])
def test_packed_decode_call_site(dispatcher, backend, padding, lower_bound):
    gen = torch.Generator().manual_seed(1)
    pool = make_pool(gen)
    live = [5, 2, 7]
    pad = 0 if padding == "eager_slot0" else -1
    idx = torch.tensor(live + [pad, pad], dtype=torch.int32)
    Bn = idx.numel()
    qkv, *_ = conv_output(gen, Bn)
    a, b = gate_slice(gen, Bn), torch.randn(1, Bn, HV, generator=gen)
    A_log, dt_bias = params(gen)
    before = pool_words(pool)
    init = pool.clone()
    out = call_site(dispatcher.packed_decode, "packed_decode", dict(
        mixed_qkv=qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, ssm_states=pool,
        cache_indices=idx, num_v_heads=HV, head_v_dim=V, lower_bound=lower_bound, replayssm_d=None,
        replayssm_k=None, replayssm_g=None, replayssm_write_pos=None, replayssm_force_flush=None))
    assert out.shape == (1, Bn, HV, V) and out.dtype == qkv.dtype
    q = qkv[:, :H * K].view(Bn, H, K)
    k = qkv[:, H * K:2 * H * K].view(Bn, H, K)
    v = qkv[:, 2 * H * K:].view(Bn, HV, V)
    for i, s in enumerate(live):
        o, st = steps64(q[i:i + 1], k[i:i + 1], v[i:i + 1], a[i:i + 1].view(1, HV, K), b[0, i:i + 1], A_log, dt_bias,
                        init[s], lower_bound=lower_bound)
        check(out[0, i], o[0], 1e-5, f"row {i} output")
        check(pool[s], st[0], 1e-5, f"slot {s} state")
    if pad < 0:
        assert torch.equal(out[0, len(live):], torch.zeros_like(out[0, len(live):]))
    touched = live + ([0] if pad == 0 else [])
    keep = slot_words_mask(pool, touched)
    assert torch.equal(pool_words(pool)[keep], before[keep]), "slots outside the batch changed"


@pytest.mark.parametrize("padding", ["eager_slot0", "graph_minus1"])
def test_decode_call_site_safe_gate(dispatcher, backend, padding):
    """The non-packed decode: q/k/v views, a [B, HV*K], b [1, B, HV], query_start_loc with the
    CUDA graph's empty ranges for padded rows."""
    gen = torch.Generator().manual_seed(2)
    pool = make_pool(gen)
    live = [3, 8, 1]
    Bn = 5
    if padding == "eager_slot0":
        idx = torch.tensor(live + [0, 0], dtype=torch.int32)
        qsl = torch.arange(Bn + 1, dtype=torch.int32)
    else:
        idx = torch.tensor(live + [-1, -1], dtype=torch.int32)
        qsl = torch.tensor([0, 1, 2, 3, 3, 3], dtype=torch.int32)
    qkv, q, k, v = conv_output(gen, Bn)
    a, b = gate_slice(gen, Bn), torch.randn(1, Bn, HV, generator=gen)
    A_log, dt_bias = params(gen)
    init, before = pool.clone(), pool_words(pool)
    out = call_site(dispatcher.decode, "decode", dict(
        q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
        query_start_loc=qsl, lower_bound=LOWER_BOUND))
    assert out.shape == (1, Bn, HV, V) and out.dtype == q.dtype
    for i, s in enumerate(live):
        o, st = steps64(q[0, i:i + 1], k[0, i:i + 1], v[0, i:i + 1], a[i:i + 1].view(1, HV, K), b[0, i:i + 1],
                        A_log, dt_bias, init[s], lower_bound=LOWER_BOUND)
        check(out[0, i], o[0], 1e-5, f"row {i} output")
        check(pool[s], st[0], 1e-5, f"slot {s} state")
    keep = slot_words_mask(pool, live + ([0] if padding == "eager_slot0" else []))
    assert torch.equal(pool_words(pool)[keep], before[keep])


# ---------------------------------------------------------------------------------------------
# Extend
# ---------------------------------------------------------------------------------------------
def extend_reference(q, k, v, a, b, A_log, dt_bias, init, slots, seqlens, *, beta_is_raw=True, lower_bound=None):
    """Per sequence: (o rows, states after each token, initial state) in float64."""
    out, per_seq = torch.zeros(q.shape[1], HV, V, dtype=F64), []
    start = 0
    for s, n in zip(slots, seqlens):
        S0 = init[s] if s >= 0 else torch.zeros(HV, V, K)
        if n == 0:
            per_seq.append((None, S0.double()))
            continue
        o, st = steps64(q[0, start:start + n], k[0, start:start + n], v[0, start:start + n], a[0, start:start + n],
                        b[0, start:start + n], A_log, dt_bias, S0, lower_bound=lower_bound, beta_is_raw=beta_is_raw)
        out[start:start + n] = o
        per_seq.append((st, S0.double()))
        start += n
    return out, per_seq


# The interpreter runs the chunked kernels slowly: one case of each call site on Triton.
EXTEND_CASES = [("reference", False, None), ("reference", True, None), ("reference", False, LOWER_BOUND),
                ("reference", True, LOWER_BOUND), ("triton", True, LOWER_BOUND)]


@pytest.mark.parametrize("backend_name, tracked, lower_bound", EXTEND_CASES)
def test_extend_eager_call_site(dispatcher, monkeypatch, backend_name, tracked, lower_bound):
    monkeypatch.setenv("KDAKIT_BACKEND", backend_name)
    gen = torch.Generator().manual_seed(3)
    pool = make_pool(gen)
    seqlens = [70, 5, 130, 0]                  # crosses 64-token chunk boundaries; an empty padding row
    slots = [4, 6, 2, 0]                       # eager padding: sglang's reserved slot 0
    pool[6] = 0.0                              # a fresh request: sglang zeroes its slot first
    T = sum(seqlens)
    qkv, q, k, v = conv_output(gen, T)
    a = gate_slice(gen, T).unsqueeze(0).unflatten(-1, (-1, K))   # [1, T, HV, K], a strided view
    b = torch.randn(1, T, HV, generator=gen)
    A_log, dt_bias = params(gen)
    idx = torch.tensor(slots, dtype=torch.int32)
    qsl = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32)
    chunk_idx = torch.tensor([1, -1, 2, -1], dtype=torch.int32)     # snapshots after 64 and 128 tokens
    track = torch.full((4, HV, V, K), NAN) if tracked else None
    init, before = pool.clone(), pool_words(pool)
    res = call_site(dispatcher.extend, "extend_eager", dict(
        q=q, k=k, v=v, g=a, beta=b, ssm_states=pool, cache_indices=idx, query_start_loc=qsl, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, beta_is_raw=True, extend_seq_lens_cpu=list(seqlens),
        extend_prefix_lens=torch.tensor([16, 0, 40, 0]), layer_id=0, is_spec_decode=False,
        return_intermediate_states=tracked, track_ssm_h_src=torch.tensor([1, 4]) if tracked else None,
        track_state=track, track_chunk_idx=chunk_idx if tracked else None, state_checkpoint_cu_starts=None,
        num_state_checkpoints=0, state_checkpoint_every_n_tokens=0, state_checkpoint_indices=None,
        track_ssm_h_batch_src=torch.tensor([0, 2]) if tracked else None))
    if tracked:
        assert isinstance(res, tuple) and len(res) == 2
        o = res[0]
    else:
        assert isinstance(res, torch.Tensor)
        o = res
    ref, per_seq = extend_reference(q, k, v, a, b, A_log, dt_bias, init, slots, seqlens, lower_bound=lower_bound)
    assert o.shape == (1, T, HV, V)
    check(o[0], ref, 2e-5, "extend output")
    for n, (s, (st, _)) in enumerate(zip(slots[:3], per_seq)):
        check(pool[s], st[-1], 2e-5, f"sequence {n} final state")
    if tracked:
        for n, c in enumerate(chunk_idx.tolist()):
            if c >= 0:
                check(track[n], per_seq[n][0][c * 64 - 1], 2e-5, f"sequence {n} snapshot at chunk {c}")
    keep = slot_words_mask(pool, slots)          # slot 0 included: sglang's padding may write it
    assert torch.equal(pool_words(pool)[keep], before[keep])


def test_extend_intermediate_states_without_snapshot_buffer(dispatcher):
    """return_intermediate_states without track_state: sglang reads h, the state at the start of
    every 64-token chunk, [1, NT, HV, V, K] over the sequences."""
    gen = torch.Generator().manual_seed(4)
    pool = make_pool(gen)
    seqlens, slots = [70, 130], [3, 5]
    T = sum(seqlens)
    qkv, q, k, v = conv_output(gen, T)
    a = torch.randn(1, T, HV, K, generator=gen)
    b = torch.randn(1, T, HV, generator=gen)
    A_log, dt_bias = params(gen)
    init = pool.clone()
    o, h = dispatcher.extend(q, k, v, a, b, ssm_states=pool, cache_indices=torch.tensor(slots, dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 70, 200], dtype=torch.int32), A_log=A_log,
                             dt_bias=dt_bias, lower_bound=None, beta_is_raw=True, return_intermediate_states=True,
                             track_state=None, track_chunk_idx=None)
    _, per_seq = extend_reference(q, k, v, a, b, A_log, dt_bias, init, slots, seqlens)
    want = []
    for (st, S0), n in zip(per_seq, seqlens):
        want += [S0] + [st[c * 64 - 1] for c in range(1, -(-n // 64))]
    assert h.shape == (1, len(want), HV, V, K)
    check(h[0], torch.stack(want), 2e-5, "h")


@pytest.mark.parametrize("backend_name, beta_is_raw", [("reference", False), ("reference", True), ("triton", False)])
def test_extend_prefill_graph_call_site(dispatcher, monkeypatch, backend_name, beta_is_raw):
    """kda_extend_in_graph's pattern: tables sized for the bucket (cache_indices -1 and empty
    sequences past the batch), T the bucket's token count, beta_is_raw as given (False for a 4-D
    gate: b is taken as β), a writable tensor back (sglang masks it in place)."""
    monkeypatch.setenv("KDAKIT_BACKEND", backend_name)
    gen = torch.Generator().manual_seed(5)
    pool = make_pool(gen)
    max_seqs, bucket = 4, 160
    seqlens, slots = [70, 60], [7, 2]
    n_tok = sum(seqlens)
    idx = torch.tensor(slots + [-1] * (max_seqs - 2), dtype=torch.int32)
    cu = torch.tensor([0, 70, 130, 130, 130], dtype=torch.int32)
    chunks = [(0, 0), (0, 1), (1, 0)]
    chunk_indices = torch.tensor(chunks + [(0, 1 << 20)] * (bucket // 64 + max_seqs - len(chunks)),
                                 dtype=torch.int32)
    chunk_offsets = torch.tensor([0, 2, 3, 3, 3], dtype=torch.int32)
    qkv, q, k, v = conv_output(gen, bucket)
    a = torch.randn(1, bucket, HV, K, generator=gen)
    b = torch.randn(1, bucket, HV, generator=gen)
    if not beta_is_raw:
        b = torch.sigmoid(b)
    A_log, dt_bias = params(gen)
    track = torch.full((max_seqs, HV, V, K), NAN)
    chunk_idx = torch.tensor([1, 0, -1, -1], dtype=torch.int32)
    init, before = pool.clone(), pool_words(pool)
    o = call_site(dispatcher.extend, "extend_graph", dict(
        q=q, k=k, v=v, g=a, beta=b, ssm_states=pool, cache_indices=idx, query_start_loc=cu, A_log=A_log,
        dt_bias=dt_bias, lower_bound=None, beta_is_raw=beta_is_raw, extend_seq_lens_cpu=None, is_spec_decode=False,
        return_intermediate_states=False, track_state=track, track_chunk_idx=chunk_idx, chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets))
    assert isinstance(o, torch.Tensor) and o.shape == (1, bucket, HV, V)
    o.masked_fill_((torch.arange(bucket) >= n_tok).view(1, -1, 1, 1), 0)   # what sglang does next
    ref, per_seq = extend_reference(q[:, :n_tok], k[:, :n_tok], v[:, :n_tok], a[:, :n_tok], b[:, :n_tok], A_log,
                                    dt_bias, init, slots, seqlens, beta_is_raw=beta_is_raw)
    check(o[0, :n_tok], ref, 2e-5, "extend output")
    for n, s in enumerate(slots):
        check(pool[s], per_seq[n][0][-1], 2e-5, f"sequence {n} final state")
    check(track[0], per_seq[0][0][63], 2e-5, "snapshot after 64 tokens")
    check(track[1], per_seq[1][1], 2e-5, "snapshot at chunk 0 (the initial state)")
    keep = slot_words_mask(pool, slots)
    assert torch.equal(pool_words(pool)[keep], before[keep])


# ---------------------------------------------------------------------------------------------
# Target verify
# ---------------------------------------------------------------------------------------------
TREE8 = [-1, 0, 0, 1, 1, 2, 3, 5]      # entry 0 unused by sglang (node 0 starts from the committed state)


@pytest.mark.parametrize("shape", ["chain_kimi_linear", "chain_k3_safe_gate", "chain_glm5", "tree8"])
def test_target_verify_call_site(dispatcher, backend, shape):
    gen = torch.Generator().manual_seed(6)
    pool = make_pool(gen)
    tree = shape == "tree8"
    draft = 8 if tree else 4                      # num_spec 3, or a tree of 8 nodes
    live = [6, 3, 8]
    bs = 4                                        # a padded request (graph: -1)
    T = bs * draft
    idx = torch.tensor(live + [-1], dtype=torch.int32)
    qsl = torch.arange(0, T + 1, draft, dtype=torch.int32)
    spec_slots = pool.shape[0] - 1
    tbl = torch.cat([torch.arange(spec_slots, dtype=torch.int32),
                     torch.full((3,), spec_slots, dtype=torch.int32)])   # padded past bs, clamped to pool size
    snaps = torch.full((spec_slots + 1, draft + 2, HV, V, K), NAN)      # row pitch past draft
    qkv, q, k, v = conv_output(gen, T)
    a2 = gate_slice(gen, T)
    a = {"chain_kimi_linear": a2, "tree8": a2, "chain_k3_safe_gate": a2.unsqueeze(0).unflatten(-1, (-1, K)),
         "chain_glm5": a2.unsqueeze(0)}[shape]
    b = torch.randn(1, T, HV, generator=gen)
    lower_bound = LOWER_BOUND if shape == "chain_k3_safe_gate" else None
    parents = torch.tensor([TREE8] * bs, dtype=torch.int32) if tree else None
    A_log, dt_bias = params(gen)
    before, snaps_before = pool_words(pool), snaps.clone()
    out = call_site(dispatcher.target_verify, "target_verify", dict(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, ssm_states=pool, cache_indices=idx,
        query_start_loc=qsl, intermediate_states_buffer=snaps, intermediate_state_indices=tbl, cache_steps=draft,
        retrieve_parent_token=parents, lower_bound=lower_bound))
    assert out.shape == (1, T, HV, V) and out.dtype == q.dtype
    assert torch.equal(pool_words(pool), before), "target_verify modified the state pool"
    ag = a2.view(T, HV, K)
    for i, s in enumerate(live):
        node_state = {}
        for t in range(draft):
            p = TREE8[t] if tree else t - 1
            S0 = pool[s] if (t == 0 or p < 0) else node_state[p]
            j = i * draft + t
            o, st = steps64(q[0, j:j + 1], k[0, j:j + 1], v[0, j:j + 1], ag[j:j + 1], b[0, j:j + 1], A_log, dt_bias,
                            S0, lower_bound=lower_bound)
            node_state[t] = st[0]
            check(out[0, j], o[0], 2e-5, f"request {i} node {t} output")
            check(snaps[tbl[i], t], st[0], 2e-5, f"request {i} node {t} snapshot")
    written = torch.zeros(snaps.shape[:2], dtype=torch.bool)
    for i in range(len(live)):
        written[int(tbl[i]), :draft] = True
    assert torch.equal(snaps[~written].view(torch.int32), snaps_before[~written].view(torch.int32)), \
        "snapshot rows outside the batch's were written"


@pytest.mark.parametrize("site", ["decode", "chain", "tree8"])
def test_agrees_with_sglangs_own_triton_kernel(sg, dispatcher, site):
    """The same call, on sglang's original Triton kernel (its fused_sigmoid_gating_delta_rule_update
    in Triton's interpreter) and on kdakit's: outputs of live rows, pools, snapshots. (sglang's
    packed decode and chunked extend kernels do not run in the interpreter.)"""
    gen = torch.Generator().manual_seed(7)
    pool = make_pool(gen)
    sglang_kernel = sg["held"]["original"]()
    if site == "decode":
        Bn, live = 4, [3, 8, 1]
        qkv, q, k, v = conv_output(gen, Bn)
        A_log, dt_bias = params(gen)
        args = dict(q=q, k=k, v=v, a=gate_slice(gen, Bn), b=torch.randn(1, Bn, HV, generator=gen), A_log=A_log,
                    dt_bias=dt_bias, ssm_states=pool, cache_indices=torch.tensor(live + [-1], dtype=torch.int32),
                    query_start_loc=torch.arange(Bn + 1, dtype=torch.int32), lower_bound=LOWER_BOUND)
        rows = torch.arange(len(live))
    else:
        draft, bs = (8, 3) if site == "tree8" else (4, 3)
        T = bs * draft
        qkv, q, k, v = conv_output(gen, T)
        A_log, dt_bias = params(gen)
        args = dict(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=gate_slice(gen, T),
                    b=torch.randn(1, T, HV, generator=gen), ssm_states=pool,
                    cache_indices=torch.tensor([6, 3, -1], dtype=torch.int32),
                    query_start_loc=torch.arange(0, T + 1, draft, dtype=torch.int32),
                    intermediate_states_buffer=torch.zeros(pool.shape[0], draft, HV, V, K),
                    intermediate_state_indices=torch.arange(pool.shape[0], dtype=torch.int32), cache_steps=draft,
                    retrieve_parent_token=torch.tensor([TREE8] * bs, dtype=torch.int32) if site == "tree8" else None,
                    lower_bound=None)
        rows = torch.arange(2 * draft)
    theirs_args = {n: (t.clone() if n in ("ssm_states", "intermediate_states_buffer") else t) for n, t in args.items()}
    method = "decode" if site == "decode" else "target_verify"
    from triton.runtime.errors import InterpreterError
    try:
        theirs = getattr(sglang_kernel, method)(**theirs_args)
    except InterpreterError as err:  # Triton 3.6's interpreter rejects sglang's kernel; 3.9's runs it
        import triton
        pytest.skip(f"sglang's Triton kernel does not run in Triton {triton.__version__}'s interpreter ({err})")
    ours = getattr(dispatcher, method)(**args)
    check(ours[0, rows], theirs[0, rows], 1e-5, "output")
    check(args["ssm_states"].nan_to_num(), theirs_args["ssm_states"].nan_to_num(), 1e-5, "pool")
    if site != "decode":
        check(args["intermediate_states_buffer"][:2], theirs_args["intermediate_states_buffer"][:2], 1e-5,
              "snapshots")


# ---------------------------------------------------------------------------------------------
# What kdakit does not cover runs sglang's kernel, visibly
# ---------------------------------------------------------------------------------------------
def _spy(monkeypatch, cls, name):
    calls = []

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return "sglang's kernel"
    monkeypatch.setattr(cls, name, spy)
    return calls


def test_replayssm_decode_and_verify_fall_back(sg, dispatcher, monkeypatch, caplog):
    original = sg["held"]["original"]
    calls_d = _spy(monkeypatch, original, "packed_decode")
    calls_v = _spy(monkeypatch, original, "target_verify")
    ring = torch.zeros(1)
    with caplog.at_level(logging.WARNING, logger="kdakit.integrations.sglang"):
        got = dispatcher.packed_decode(torch.zeros(2, CONV_DIM), torch.zeros(2, HV * K), torch.zeros(1, 2, HV),
                                       A_log=torch.zeros(1, 1, HV, 1), dt_bias=torch.zeros(HV * K), scale=0.25,
                                       ssm_states=torch.zeros(3, HV, V, K),
                                       cache_indices=torch.ones(2, dtype=torch.int32),
                                       num_v_heads=HV, head_v_dim=V, lower_bound=None, replayssm_d=ring,
                                       replayssm_k=ring, replayssm_g=ring, replayssm_write_pos=ring,
                                       replayssm_force_flush=None)
        assert got == "sglang's kernel" and calls_d[0]["replayssm_d"] is ring
        got = dispatcher.target_verify(A_log=None, dt_bias=None, q=torch.zeros(1, 8, H, K), k=None, v=None, a=None,
                                       b=None, ssm_states=None, cache_indices=torch.ones(2, dtype=torch.int32),
                                       query_start_loc=torch.tensor([0, 4, 8], dtype=torch.int32),
                                       intermediate_states_buffer=None, intermediate_state_indices=None,
                                       cache_steps=4, retrieve_parent_token=None, lower_bound=None, cache_ring=True,
                                       replayssm_rawv=ring, replayssm_rawk=ring, replayssm_g=ring, replayssm_beta=ring)
        assert got == "sglang's kernel" and calls_v[0]["cache_ring"] is True
    assert "packed_decode with ReplaySSM rings runs on sglang's own Triton KDA kernel" in caplog.text
    assert "target_verify with ReplaySSM rings runs on sglang's own Triton KDA kernel" in caplog.text


def test_ragged_verify_falls_back(sg, dispatcher, monkeypatch):
    """A ragged layout (fewer tokens than requests x draft; or flagged by the backend hook) is
    sglang's; kdakit's verify takes equal-length requests only."""
    from kdakit.integrations import sglang as integ
    calls = _spy(monkeypatch, sg["held"]["original"], "target_verify")
    args = dict(A_log=None, dt_bias=None, q=torch.zeros(1, 7, H, K), k=None, v=None, a=None, b=None, ssm_states=None,
                cache_indices=torch.ones(2, dtype=torch.int32),
                query_start_loc=torch.tensor([0, 3, 7], dtype=torch.int32), intermediate_states_buffer=torch.zeros(1),
                intermediate_state_indices=torch.zeros(2, dtype=torch.int32), cache_steps=4,
                retrieve_parent_token=None, lower_bound=None)
    assert dispatcher.target_verify(**args) == "sglang's kernel"
    token = integ._ragged_verify.set(True)
    try:
        args.update(q=torch.zeros(1, 8, H, K), query_start_loc=torch.tensor([0, 4, 8], dtype=torch.int32))
        assert dispatcher.target_verify(**args) == "sglang's kernel"
    finally:
        integ._ragged_verify.reset(token)
    assert len(calls) == 2
    # the hook that raises the flag is on sglang's backend method
    hooked = sg["kb"].KDAAttnBackend._forward_target_verify
    assert hooked is not None and "kdakit" in repr(sg["hooks"].HookRegistry._hooks.get(integ.VERIFY_TARGET))


def test_phases_env_keeps_other_phases_on_sglang(sg, monkeypatch):
    from kdakit.integrations import sglang as integ
    cls = integ.make_kernel_class(sg["held"]["original"], ("extend",))
    calls = _spy(monkeypatch, sg["held"]["original"], "decode")
    kernel = cls()
    assert kernel.decode(None, None, None, None, None, A_log=None, dt_bias=None, ssm_states=None, cache_indices=None,
                         query_start_loc=None) == "sglang's kernel"
    assert len(calls) == 1
    assert cls.supports_packed_decode == sg["held"]["original"].supports_packed_decode
    assert cls.supports_packed_decode_safe_gate is False
    monkeypatch.setenv(integ.PHASES_ENV, "decode,prefill")
    with pytest.raises(ValueError, match="unknown phases \\['prefill'\\]"):
        integ.enabled_phases()
    assert "unknown phases" in integ.refusal_reason()
    monkeypatch.setenv(integ.PHASES_ENV, " verify , decode ")
    assert integ.enabled_phases() == ("decode", "verify")


# ---------------------------------------------------------------------------------------------
# When it does not load: what the engineer sees
# ---------------------------------------------------------------------------------------------
def test_unknown_sglang_version_refuses_and_says_why(sg, monkeypatch, caplog):
    """sglang's load_plugins on a release whose call sites kdakit does not know: the plugin runs,
    registers nothing, and says so at WARNING (shown even before sglang configures logging)."""
    from kdakit.integrations import sglang as integ
    registry = sg["hooks"].HookRegistry
    monkeypatch.setattr(integ, "_registered", {})
    monkeypatch.setattr(integ, "installed_sglang_version", lambda: "0.6.0")
    monkeypatch.setattr(sg["plugins"], "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "kdakit")
    hooks_before = {t: list(h) for t, h in registry._hooks.items()}
    with caplog.at_level(logging.INFO):
        sg["plugins"].load_plugins()
    assert {t: list(h) for t, h in registry._hooks.items()} == hooks_before
    assert ("kdakit sglang plugin NOT active: sglang 0.6.0 is not a version whose KDA call sites this kdakit was "
            "written against (0.5.23). sglang's own KDA kernels stay in place.") in caplog.text
    assert any(r.levelno == logging.WARNING and "NOT active" in r.getMessage() for r in caplog.records)


def test_not_in_sglang_plugins_is_logged(sg, monkeypatch, caplog):
    monkeypatch.setattr(sg["plugins"], "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    with caplog.at_level(logging.INFO):
        sg["plugins"].load_plugins()
    assert "Skipping plugin kdakit (not in SGLANG_PLUGINS)" in caplog.text


def test_rocm_torch_refuses(monkeypatch):
    from kdakit.integrations import sglang as integ
    monkeypatch.setattr(integ, "installed_sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "ROCm" in integ.refusal_reason()


# ---------------------------------------------------------------------------------------------
# benchmarks/gpu_sglang_plugin_check.py on the CPU: its peer of sglang's kernels, its checks
# ---------------------------------------------------------------------------------------------
def test_gpu_check_script_peer_runs_its_checks_on_cpu(sg, tmp_path):
    """The script's --build-peer layout from the wheel's kernel folders (zipped here from the
    installed package, as the wheel holds them), then its --cpu-interpret checks in a fresh
    process: the peer's stand-in package imports and its argument patterns run."""
    import subprocess
    import sys
    import zipfile
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, bench)
    try:
        import gpu_sglang_plugin_check as script
    finally:
        sys.path.remove(bench)
    site = os.path.dirname(sglang_env.sglang_root())
    wheel = tmp_path / "sglang-0.5.23-kernels.zip"
    with zipfile.ZipFile(wheel, "w") as zf:
        for folder in script.PEER_FOLDERS:
            for root, _, files in os.walk(os.path.join(site, folder)):
                for f in files:
                    if f.endswith(".py"):
                        path = os.path.join(root, f)
                        zf.write(path, os.path.relpath(path, site))
    peer = script.build_peer(str(tmp_path / "peer"), str(wheel))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([peer, os.path.dirname(bench)]), "TRITON_INTERPRET": "1",
           "KDAKIT_BACKEND": "triton"}
    run = subprocess.run([sys.executable, os.path.join(bench, "gpu_sglang_plugin_check.py"), "--cpu-interpret"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    if run.returncode == 3:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, run.stdout + run.stderr
    for case in ("decode N=3", "target_verify chain4 N=3", "target_verify tree8 N=3"):
        assert f"ok   {case}:" in run.stdout, run.stdout
