"""The float64 reference itself: it is the oracle of every kernel test, so it is checked
against fla-core's naive recurrence, against its own unfused chains (fused decode, verify
vs plain decode, ring vs snapshot commit) and against the formulas of docs/design.md by hand."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from kdakit import reference

from helpers import POISON, assert_close, kda_params, pick_slots, random_pool, untouched_slots

F64 = torch.float64
W = 4          # short-conv width of the Kimi models
EXACT = 1e-12  # two float64 paths of the same math


# ----------------------------------------------------------------------------
# The math of docs/design.md written out by hand, independent of kdakit.reference
# ----------------------------------------------------------------------------
def hand_l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def hand_gate(a, A_log, dt_bias, lower_bound):
    """``a [..., HV, K]``; torch's softplus returns ``x`` above its threshold of 20, as the math asks."""
    HV, K = a.shape[-2:]
    x = a + dt_bias.view(HV, K)
    A = A_log.exp()[:, None]
    return -A * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(A * x)


def f64_params(HV, K, gen):
    return tuple(p.double() for p in kda_params(HV, K, generator=gen))


def live_rows(idx):
    return [(n, int(s)) for n, s in enumerate(idx.tolist()) if s >= 0]


def assert_poisoned(t, what):
    assert torch.equal(t, torch.full_like(t, POISON)), f"{what} must not be written"


def assert_untouched(pool, before, idx, what):
    for s in untouched_slots(pool.shape[0], idx):
        assert torch.equal(pool[s], before[s]), f"{what}: slot {s} is not used and must stay bitwise"


# (H, HV, K, V): GVA and K != V in every list.
SHAPES = [
    pytest.param(2, 4, 16, 24, id="gva-H2-HV4-K16-V24"),
    pytest.param(2, 2, 24, 16, id="H2-HV2-K24-V16"),
]
ACT_DTYPES = [pytest.param(F64, id="f64-act"), pytest.param(torch.bfloat16, id="bf16-act")]


# ----------------------------------------------------------------------------
# 1. recurrent_forward against fla-core's naive_recurrent_kda
# ----------------------------------------------------------------------------
GATES = [
    pytest.param(False, None, id="log-decay-g"),
    pytest.param(True, None, id="raw-default-gate"),
    pytest.param(True, -2.0, id="raw-safe-gate-2"),
]


@pytest.mark.parametrize("H,HV,K,V", SHAPES)
@pytest.mark.parametrize("raw_gate,lower_bound", GATES)
@pytest.mark.parametrize("beta_is_logit", [True, False], ids=["beta-logit", "beta-prob"])
@pytest.mark.parametrize("use_qk_l2norm", [True, False], ids=["l2norm", "no-l2norm"])
def test_recurrent_forward_matches_fla_naive(H, HV, K, V, raw_gate, lower_bound, beta_is_logit, use_qk_l2norm):
    naive = pytest.importorskip("fla.ops.kda.naive")
    gen = torch.Generator().manual_seed(10)
    seqlens = [3, 1, 4, 2]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(seqlens)])
    N, T, slots = len(seqlens), sum(seqlens), 7
    # Without the L2 norm keep |k| ~ 1 so the delta rule stays contractive.
    qk_scale = 1.0 if use_qk_l2norm else K ** -0.5
    q = torch.randn(1, T, H, K, generator=gen, dtype=F64) * qk_scale
    k = torch.randn(1, T, H, K, generator=gen, dtype=F64) * qk_scale
    v = torch.randn(1, T, HV, V, generator=gen, dtype=F64)
    if raw_gate:
        A_log, dt_bias = f64_params(HV, K, gen)
        g_in = torch.randn(1, T, HV, K, generator=gen, dtype=F64)
        g_log = hand_gate(g_in, A_log, dt_bias, lower_bound)
    else:
        A_log = dt_bias = None
        g_in = g_log = -torch.rand(1, T, HV, K, generator=gen, dtype=F64)
    if beta_is_logit:
        beta_in = torch.randn(1, T, HV, generator=gen, dtype=F64)
        beta = torch.sigmoid(beta_in)
    else:
        beta_in = beta = torch.rand(1, T, HV, generator=gen, dtype=F64)
    state = random_pool(slots, HV, V, K, F64, generator=gen)
    idx = pick_slots(slots, N, num_padding=1, generator=gen)
    before = state.clone()

    def run(padding_rows):
        out = torch.full((1, T, HV, V), POISON, dtype=F64)
        token_states = torch.full((T, HV, V, K), POISON, dtype=F64)
        result = reference.recurrent_forward(
            q, k, v, g_in, beta_in, state, idx, out, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, beta_is_logit=beta_is_logit,
            token_states=token_states, padding_rows=padding_rows, compute_dtype=F64)
        assert result is out
        return out, token_states

    # SPEC: the sequence with slot < 0 is a padding row (zeros); the others as below.
    pad_out, pad_states = run(True)
    state.copy_(before)
    # fla's semantics (compat, initial_state=None): the slot < 0 sequence starts from zeros.
    out, token_states = run(False)
    for n in range(N):
        rows = slice(int(cu_seqlens[n]), int(cu_seqlens[n + 1]))
        if int(idx[n]) < 0:
            assert not pad_out[0, rows].any() and not pad_states[rows].any(), "padding row must be zero"
        else:
            assert torch.equal(pad_out[0, rows], out[0, rows]) and torch.equal(pad_states[rows], token_states[rows])

    # fla naive: K-major state [B, HV, K, V], log-space g, post-sigmoid beta, no L2 norm, float32 math.
    qn, kn = (hand_l2(q), hand_l2(k)) if use_qk_l2norm else (q, k)
    for n in range(N):
        slot = int(idx[n])
        S = before[slot].transpose(-1, -2)[None] if slot >= 0 else None
        for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
            step = slice(t, t + 1)
            o, S = naive.naive_recurrent_kda(qn[:, step], kn[:, step], v[:, step], g_log[:, step], beta[:, step],
                                             initial_state=S, output_final_state=True)
            assert_close(out[0, t], o[0, 0], 1e-5, f"seq {n} token {t}: out vs fla naive")
            assert_close(token_states[t], S[0].transpose(-1, -2), 1e-5, f"seq {n} token {t}: token state vs fla")
        if slot >= 0:
            assert_close(state[slot], S[0].transpose(-1, -2), 1e-5, f"seq {n}: final state vs fla naive")
            assert torch.equal(state[slot], token_states[t]), "final state must equal the last token state"
    assert_untouched(state, before, idx, "state")


def test_recurrent_forward_without_write_back_leaves_pool_bitwise():
    gen = torch.Generator().manual_seed(11)
    H, HV, K, V, T, slots = 1, 2, 16, 24, 5, 4
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen, dtype=F64)
    g = -torch.rand(1, T, HV, K, generator=gen, dtype=F64)
    beta = torch.rand(1, T, HV, generator=gen, dtype=F64)
    state = random_pool(slots, HV, V, K, F64, generator=gen)
    before = state.clone()
    cu_seqlens, idx = torch.tensor([0, 2, 5]), torch.tensor([3, 1], dtype=torch.int32)
    out = torch.full((1, T, HV, V), POISON, dtype=F64)
    reference.recurrent_forward(q, k, v, g, beta, state, idx, out, cu_seqlens=cu_seqlens,
                                write_final_state=False, compute_dtype=F64)
    assert torch.equal(state, before), "write_final_state=False must not write the pool"
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------
# 2. fused_decode == causal_conv1d_update -> packed_decode -> gated_rmsnorm_op
# ----------------------------------------------------------------------------
def test_causal_conv1d_update_is_a_causal_depthwise_conv():
    """Five updates from a zero window equal a left-padded depthwise conv1d + SiLU: the window
    holds the previous inputs oldest first and the new x is appended at its end."""
    gen = torch.Generator().manual_seed(20)
    B, C, steps, slots = 3, 12, 5, 5
    x = torch.randn(B, steps, C, generator=gen, dtype=F64)
    weight = torch.randn(C, W, generator=gen) * 0.5
    bias = torch.randn(C, generator=gen) * 0.1
    conv = torch.randn(slots, C, W - 1, generator=gen, dtype=F64)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    conv[idx[idx >= 0].long()] = 0.0
    before = conv.clone()
    for t in range(steps):
        out = torch.full((B, C), POISON, dtype=F64)
        reference.causal_conv1d_update(x[:, t], conv, weight, idx, out, bias=bias, compute_dtype=F64)
        assert torch.equal(out[1], torch.zeros(C, dtype=F64)), "padding row must be zero"
        for n, slot in live_rows(idx):
            seq = F.pad(x[n, : t + 1].T, (W - 1, 0))  # [C, W-1+t+1], zeros before the first token
            want = F.silu(F.conv1d(seq[None], weight.double()[:, None, :], bias.double(), groups=C))[0, :, -1]
            assert_close(out[n], want, EXACT, f"row {n} step {t}: conv output")
            assert torch.equal(conv[slot], seq[:, -(W - 1):]), f"row {n} step {t}: window = last W-1 inputs"
    assert_untouched(conv, before, idx, "conv pool")


@pytest.mark.parametrize("H,HV,K,V", SHAPES)
@pytest.mark.parametrize("act_dtype", ACT_DTYPES)
@pytest.mark.parametrize("lower_bound", [None, -2.0], ids=["default-gate", "safe-gate-2"])
@pytest.mark.parametrize("with_norm", [True, False], ids=["onorm", "no-onorm"])
def test_fused_decode_equals_unfused_chain(H, HV, K, V, act_dtype, lower_bound, with_norm):
    gen = torch.Generator().manual_seed(21)
    B, slots = 4, 7
    C = 2 * H * K + HV * V
    qkv = torch.randn(B, C, generator=gen).to(act_dtype)
    conv_weight = torch.randn(C, W, generator=gen) * 0.5
    conv_bias = torch.randn(C, generator=gen) * 0.1
    conv_pool = torch.randn(slots, C, W - 1, generator=gen).to(act_dtype)
    a = torch.randn(B, HV * K, generator=gen, dtype=F64)
    b = torch.randn(B, HV, generator=gen, dtype=F64)
    A_log, dt_bias = f64_params(HV, K, gen)
    state = random_pool(slots, HV, V, K, F64, generator=gen)
    idx = pick_slots(slots, B, num_padding=1, generator=gen)
    norm_gate = torch.randn(B, HV * V, generator=gen, dtype=F64) if with_norm else None
    norm_weight = torch.rand(V, generator=gen) + 0.5 if with_norm else None
    eps = 1e-5

    state_f, conv_f = state.clone(), conv_pool.clone()
    out_f = torch.full((B, 1, HV, V), POISON, dtype=F64)
    result = reference.fused_decode(qkv, conv_weight, conv_f, a, b, A_log, dt_bias, state_f, idx, out_f,
                                    conv_bias=conv_bias, lower_bound=lower_bound, norm_gate=norm_gate,
                                    norm_weight=norm_weight, norm_eps=eps, compute_dtype=F64)
    assert result is out_f

    state_u, conv_u = state.clone(), conv_pool.clone()
    mixed = torch.full((B, C), POISON, dtype=act_dtype)  # the unfused conv stores in the activation dtype
    reference.causal_conv1d_update(qkv, conv_u, conv_weight, idx, mixed, bias=conv_bias, compute_dtype=F64)
    out_u = torch.full((B, 1, HV, V), POISON, dtype=F64)
    reference.packed_decode(mixed, a, b, A_log, dt_bias, state_u, idx, out_u, use_qk_l2norm=True,
                            lower_bound=lower_bound, compute_dtype=F64)
    if with_norm:
        y = torch.full((B, HV, V), POISON, dtype=F64)
        reference.gated_rmsnorm_op(out_u.view(B, HV, V), norm_gate.view(B, HV, V), norm_weight, y, eps=eps,
                                   compute_dtype=F64)
        out_u = y.view(B, 1, HV, V)

    assert_close(out_f, out_u, EXACT, "fused vs unfused out")
    pad = (idx < 0).nonzero().flatten()
    assert torch.equal(out_f[pad], torch.zeros_like(out_f[pad])), "padding rows must be zero"
    live = [s for _, s in live_rows(idx)]
    assert_close(state_f[live], state_u[live], EXACT, "fused vs unfused state")
    assert torch.equal(conv_f, conv_u), "fused and unfused conv windows must agree bitwise"
    for n, slot in live_rows(idx):
        shifted = torch.cat([conv_pool[slot, :, 1:], qkv[n, :, None]], dim=-1)
        assert torch.equal(conv_f[slot], shifted), f"row {n}: window shifts left and appends x"
    assert_untouched(state_f, state, idx, "state")
    assert_untouched(conv_f, conv_pool, idx, "conv pool")


# ----------------------------------------------------------------------------
# 3. mtp_verify against plain one-token decoding; commits
# ----------------------------------------------------------------------------
def make_model(gen, H, HV, K, V, slots, act_dtype):
    """Parameters and pools: separate q/k/v conv weights [H*K, W] / [HV*V, W] and windows."""
    widths = (H * K, H * K, HV * V)
    A_log, dt_bias = f64_params(HV, K, gen)
    return dict(
        A_log=A_log, dt_bias=dt_bias,
        conv_weights=tuple(torch.randn(c, W, generator=gen) * 0.5 for c in widths),
        conv_bias=tuple(torch.randn(c, generator=gen) * 0.1 for c in widths),
        conv_states=tuple(torch.randn(slots, c, W - 1, generator=gen).to(act_dtype) for c in widths),
        state=random_pool(slots, HV, V, K, F64, generator=gen),
        norm_weight=torch.rand(V, generator=gen) + 0.5,
    )


def make_tokens(gen, N, T, H, HV, K, V, act_dtype):
    """Pre-conv q/k/v in the activation dtype, raw gate and beta, output-norm gate."""
    return dict(
        q=torch.randn(N, T, H, K, generator=gen).to(act_dtype),
        k=torch.randn(N, T, H, K, generator=gen).to(act_dtype),
        v=torch.randn(N, T, HV, V, generator=gen).to(act_dtype),
        a=torch.randn(N, T, HV, K, generator=gen, dtype=F64),
        b=torch.randn(N, T, HV, generator=gen, dtype=F64),
        norm_gate=torch.randn(N, T, HV, V, generator=gen, dtype=F64),
    )


def plain_decode(tok, model, state, conv_states, idx, lower_bound, with_norm, accept_lens=None):
    """The oracle: one ``reference.fused_decode`` per token on the q|k|v-packed conv pool
    (three separate convs are one conv over the concatenated channels). Updates ``state``
    and ``conv_states`` in place; with ``accept_lens`` row n decodes only its first
    accept_lens[n] tokens (later steps run as padding rows).

    Returns outs [N, T, HV, V], states [N, T, HV, V, K] and windows (q, k, v) [N, T, C, W-1]
    after each step, and the post-conv activations [N, T, C] (from causal_conv1d_update).
    """
    N, T, H, K = tok["q"].shape
    HV, V = tok["v"].shape[-2:]
    widths = [c.shape[1] for c in conv_states]
    packed = torch.cat(conv_states, dim=1)
    packed_for_conv_only = packed.clone()
    weight, bias = torch.cat(model["conv_weights"]), torch.cat(model["conv_bias"])
    outs = torch.zeros(N, T, HV, V, dtype=F64)
    states = torch.zeros(N, T, HV, V, K, dtype=F64)
    windows = torch.zeros(N, T, sum(widths), W - 1, dtype=packed.dtype)
    post = torch.zeros(N, T, sum(widths), dtype=F64)
    gathered = idx.clamp_min(0).long()
    for t in range(T):
        step_idx = idx.clone()
        if accept_lens is not None:
            step_idx[accept_lens <= t] = -1
        qkv = torch.cat([tok["q"][:, t].flatten(1), tok["k"][:, t].flatten(1), tok["v"][:, t].flatten(1)], -1)
        out = torch.full((N, 1, HV, V), POISON, dtype=F64)
        reference.fused_decode(
            qkv, weight, packed, tok["a"][:, t].flatten(1), tok["b"][:, t], model["A_log"], model["dt_bias"],
            state, step_idx, out, conv_bias=bias, lower_bound=lower_bound,
            norm_gate=tok["norm_gate"][:, t].flatten(1) if with_norm else None,
            norm_weight=model["norm_weight"] if with_norm else None, compute_dtype=F64)
        mixed = torch.full(qkv.shape, POISON, dtype=qkv.dtype)
        reference.causal_conv1d_update(qkv, packed_for_conv_only, weight, step_idx, mixed, bias=bias,
                                       compute_dtype=F64)
        outs[:, t], states[:, t], windows[:, t], post[:, t] = out[:, 0], state[gathered], packed[gathered], mixed
    for pool, new in zip(conv_states, torch.split(packed, widths, dim=1)):
        pool.copy_(new)
    return outs, states, torch.split(windows, widths, dim=2), post


def verify_buffers(scratch_rows, slots, T, H, HV, K, V, widths, act_dtype):
    """Poisoned snapshot / conv-window scratch and rings, one position longer than T."""
    L = T + 1
    return dict(
        snapshots=torch.full((scratch_rows, L, HV, V, K), POISON, dtype=F64),
        intermediate_conv=tuple(torch.full((scratch_rows, L, c, W - 1), POISON, dtype=act_dtype) for c in widths),
        rings=(torch.full((slots, H, L, K), POISON, dtype=act_dtype),
               torch.full((slots, HV, L, V), POISON, dtype=act_dtype),
               torch.full((slots, HV, L, K), POISON, dtype=F64),
               torch.full((slots, HV, L), POISON, dtype=F64)),
    )


def run_verify(tok, model, state, conv_states, idx, scratch, bufs, *, ring_mode, lower_bound, with_norm):
    N, T, _, _ = tok["q"].shape
    HV, V = tok["v"].shape[-2:]
    out = torch.full((N, T, HV, V), POISON, dtype=F64)
    result = reference.mtp_verify(
        tok["q"], tok["k"], tok["v"], tok["a"], tok["b"], model["A_log"], model["dt_bias"], state, idx, scratch, out,
        conv_weights=model["conv_weights"], conv_states=conv_states, intermediate_conv=bufs["intermediate_conv"],
        conv_bias=model["conv_bias"], snapshots=bufs["snapshots"], rings=bufs["rings"] if ring_mode else None,
        lower_bound=lower_bound, norm_gate=tok["norm_gate"] if with_norm else None,
        norm_weight=model["norm_weight"] if with_norm else None, compute_dtype=F64)
    assert result is out
    return out


VERIFY_GATES = [
    pytest.param(None, True, id="default-gate-onorm"),
    pytest.param(-2.0, False, id="safe-gate-2-no-onorm"),
]


@pytest.mark.parametrize("H,HV,K,V", SHAPES)
@pytest.mark.parametrize("act_dtype", ACT_DTYPES)
@pytest.mark.parametrize("lower_bound,with_norm", VERIFY_GATES)
@pytest.mark.parametrize("ring_mode", [False, True], ids=["snapshots", "ring"])
def test_mtp_verify_matches_plain_decode(H, HV, K, V, act_dtype, lower_bound, with_norm, ring_mode):
    gen = torch.Generator().manual_seed(30)
    N, T, slots = 4, 3, 7
    scratch_rows = N + 1  # one scratch row belongs to nobody
    model = make_model(gen, H, HV, K, V, slots, act_dtype)
    tok = make_tokens(gen, N, T, H, HV, K, V, act_dtype)
    idx = pick_slots(slots, N, num_padding=1, generator=gen)
    scratch = torch.randperm(scratch_rows, generator=gen)[:N].to(torch.int32)
    widths = [c.shape[1] for c in model["conv_states"]]
    bufs = verify_buffers(scratch_rows, slots, T, H, HV, K, V, widths, act_dtype)
    state, conv_states = model["state"], model["conv_states"]
    state_before, conv_before = state.clone(), [c.clone() for c in conv_states]

    out = run_verify(tok, model, state, conv_states, idx, scratch, bufs, ring_mode=ring_mode,
                     lower_bound=lower_bound, with_norm=with_norm)

    assert torch.equal(state, state_before), "verify must not write the persistent state pool"
    for c, cb in zip(conv_states, conv_before):
        assert torch.equal(c, cb), "verify must not write the persistent conv pools"
    want_out, want_states, want_windows, post = plain_decode(
        tok, model, state_before.clone(), [c.clone() for c in conv_before], idx, lower_bound, with_norm)

    live = live_rows(idx)
    pad = (idx < 0).nonzero().flatten()
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padding rows must be zero"
    rows = [n for n, _ in live]
    assert_close(out[rows], want_out[rows], EXACT, "verify out vs plain decode")
    owned = [int(scratch[n]) for n in rows]
    for n, slot in live:
        r = int(scratch[n])
        for i, name in enumerate("qkv"):
            inter = bufs["intermediate_conv"][i]
            assert torch.equal(inter[r, :T], want_windows[i][n]), f"row {n}: conv_{name} windows after each step"
            assert_poisoned(inter[r, T:], f"row {n}: conv_{name} beyond T")
        if not ring_mode:
            assert_close(bufs["snapshots"][r, :T], want_states[n], EXACT, f"row {n}: snapshots vs plain decode")
            assert_poisoned(bufs["snapshots"][r, T:], f"row {n}: snapshot beyond T")
    for r in set(range(scratch_rows)) - set(owned):  # padding rows and the spare row
        assert_poisoned(bufs["snapshots"][r], f"scratch row {r} (not owned by a live request)")
        for inter in bufs["intermediate_conv"]:
            assert_poisoned(inter[r], f"conv scratch row {r} (not owned by a live request)")

    ring_k, ring_v, ring_g, ring_beta = bufs["rings"]
    if not ring_mode:
        for ring in bufs["rings"]:
            assert_poisoned(ring, "rings in snapshot mode")
        return
    assert_poisoned(bufs["snapshots"], "snapshots in ring mode")
    for n, slot in live:
        k_post = post[n, :, H * K: 2 * H * K].view(T, H, K).transpose(0, 1)  # post-conv, pre-L2-norm
        v_post = post[n, :, 2 * H * K:].view(T, HV, V).transpose(0, 1)
        assert_close(ring_k[slot, :, :T], k_post, EXACT, f"row {n}: ring_k")
        assert_close(ring_v[slot, :, :T], v_post, EXACT, f"row {n}: ring_v")
        g = hand_gate(tok["a"][n], model["A_log"], model["dt_bias"], lower_bound).transpose(0, 1)
        assert_close(ring_g[slot, :, :T], g, EXACT, f"row {n}: ring_g")
        assert_close(ring_beta[slot, :, :T], torch.sigmoid(tok["b"][n]).T, EXACT, f"row {n}: ring_beta")
        for ring in bufs["rings"]:
            assert_poisoned(ring[slot, :, T:], f"row {n}: ring beyond T")
    for s in untouched_slots(slots, idx):
        for ring in bufs["rings"]:
            assert_poisoned(ring[s], f"ring of unused slot {s}")


@pytest.mark.parametrize("act_dtype", ACT_DTYPES)
@pytest.mark.parametrize("lower_bound,with_norm", VERIFY_GATES)
def test_speculative_loop_commits_agree_with_plain_decode(act_dtype, lower_bound, with_norm):
    """Rounds of verify + commit with random accept lengths. Copy A commits snapshots (state and
    conv windows); copy B commits the rings plus the conv windows from snapshots. Both must equal
    plain decoding of the accepted tokens only."""
    gen = torch.Generator().manual_seed(31)
    H, HV, K, V = 2, 4, 16, 24
    N, T, slots, rounds = 4, 3, 7, 4
    model = make_model(gen, H, HV, K, V, slots, act_dtype)
    idx = pick_slots(slots, N, num_padding=1, generator=gen)
    scratch = torch.randperm(N, generator=gen).to(torch.int32)
    widths = [c.shape[1] for c in model["conv_states"]]
    state0, conv0 = model["state"], model["conv_states"]
    snap_state, snap_conv = state0.clone(), [c.clone() for c in conv0]
    ring_state, ring_conv = state0.clone(), [c.clone() for c in conv0]
    plain_state, plain_conv = state0.clone(), [c.clone() for c in conv0]
    live = live_rows(idx)
    rows, live_slots = [n for n, _ in live], [s for _, s in live]

    for rnd in range(rounds):
        tok = make_tokens(gen, N, T, H, HV, K, V, act_dtype)
        accept_lens = torch.randint(1, T + 1, (N,), generator=gen, dtype=torch.int32)
        bufs_a = verify_buffers(N, slots, T, H, HV, K, V, widths, act_dtype)
        bufs_b = verify_buffers(N, slots, T, H, HV, K, V, widths, act_dtype)
        out_a = run_verify(tok, model, snap_state, snap_conv, idx, scratch, bufs_a, ring_mode=False,
                           lower_bound=lower_bound, with_norm=with_norm)
        out_b = run_verify(tok, model, ring_state, ring_conv, idx, scratch, bufs_b, ring_mode=True,
                           lower_bound=lower_bound, with_norm=with_norm)
        reference.commit_snapshots(snap_state, bufs_a["snapshots"], idx, scratch, accept_lens - 1,
                                   conv_states=snap_conv, intermediate_conv=bufs_a["intermediate_conv"])
        reference.commit_ring(ring_state, *bufs_b["rings"], idx, accept_lens, compute_dtype=F64)
        reference.commit_snapshots(ring_state, None, idx, scratch, accept_lens - 1,
                                   conv_states=ring_conv, intermediate_conv=bufs_b["intermediate_conv"])
        want_out, _, _, _ = plain_decode(tok, model, plain_state, plain_conv, idx, lower_bound, with_norm,
                                         accept_lens=accept_lens)

        where = f"round {rnd} (accept_lens={accept_lens.tolist()})"
        for n in rows:
            acc = int(accept_lens[n])
            assert_close(out_a[n, :acc], want_out[n, :acc], EXACT, f"{where} row {n}: snapshot-mode verify out")
            assert_close(out_b[n, :acc], want_out[n, :acc], EXACT, f"{where} row {n}: ring-mode verify out")
        assert_close(snap_state[live_slots], plain_state[live_slots], EXACT, f"{where}: snapshot commit vs plain")
        assert_close(ring_state[live_slots], snap_state[live_slots], EXACT, f"{where}: ring commit vs snapshot")
        for i, name in enumerate("qkv"):
            assert torch.equal(snap_conv[i], plain_conv[i]), f"{where}: conv_{name} after snapshot commit"
            assert torch.equal(ring_conv[i], plain_conv[i]), f"{where}: conv_{name} after ring-path commit"
        for pool, what in [(snap_state, "snapshot-committed"), (ring_state, "ring-committed")]:
            assert_untouched(pool, state0, idx, f"{where} {what} state")


# ----------------------------------------------------------------------------
# 4. commit_ring: track slots and skipped rows
# ----------------------------------------------------------------------------
def test_commit_ring_track_slots_and_skipped_rows():
    gen = torch.Generator().manual_seed(40)
    H, HV, K, V, L, slots = 1, 2, 16, 24, 4, 10
    ring_k = torch.randn(slots, H, L, K, generator=gen, dtype=F64)
    ring_v = torch.randn(slots, HV, L, V, generator=gen, dtype=F64)
    ring_g = -torch.rand(slots, HV, L, K, generator=gen, dtype=F64)
    ring_beta = torch.rand(slots, HV, L, generator=gen, dtype=F64)
    state = random_pool(slots, HV, V, K, F64, generator=gen)
    before = state.clone()
    null_block_id = 0
    #                       replayed  track>=acc  null block  acc=0  padding  track=-1  acc=L, track last
    slot_indices = torch.tensor([2,        3,          0,        4,     -1,      1,        8], dtype=torch.int32)
    accept_lens = torch.tensor([3,         2,          3,        0,      2,      4,        4], dtype=torch.int32)
    track_slots = torch.tensor([5,         6,          7,        9,      9,      7,        9], dtype=torch.int32)
    track_steps = torch.tensor([1,         2,          0,        0,      0,     -1,        3], dtype=torch.int32)

    reference.commit_ring(state, ring_k, ring_v, ring_g, ring_beta, slot_indices, accept_lens,
                          track_slots=track_slots, track_steps=track_steps, null_block_id=null_block_id,
                          compute_dtype=F64)

    def replay(slot, steps):
        """States after each of the first ``steps`` ring entries, by recurrent_forward (checked vs fla above)."""
        k = ring_k[slot, :, :steps].transpose(0, 1)[None]
        token_states = torch.empty(steps, HV, V, K, dtype=F64)
        pool = before[slot][None].clone()
        reference.recurrent_forward(k, k, ring_v[slot, :, :steps].transpose(0, 1)[None],
                                    ring_g[slot, :, :steps].transpose(0, 1)[None], ring_beta[slot, :, :steps].T[None],
                                    pool, torch.tensor([0]), torch.empty(1, steps, HV, V, dtype=F64),
                                    token_states=token_states, compute_dtype=F64)
        return token_states

    written = {}
    for slot, acc, track_slot, track_step in [(2, 3, 5, 1), (3, 2, None, None), (1, 4, None, None), (8, 4, 9, 3)]:
        states = replay(slot, acc)
        written[slot] = states[-1]
        if track_slot is not None:
            written[track_slot] = states[track_step]
    for s in range(slots):
        if s in written:
            assert_close(state[s], written[s], EXACT, f"slot {s}")
        else:
            assert torch.equal(state[s], before[s]), (
                f"slot {s} must stay bitwise (skipped row, untracked step, or unused slot)")


def test_commit_ring_default_null_block_commits_slot_zero():
    gen = torch.Generator().manual_seed(41)
    H, HV, K, V, L, slots = 1, 1, 16, 16, 2, 2
    rings = (torch.randn(slots, H, L, K, generator=gen, dtype=F64), torch.randn(slots, HV, L, V, generator=gen, dtype=F64),
             -torch.rand(slots, HV, L, K, generator=gen, dtype=F64), torch.rand(slots, HV, L, generator=gen, dtype=F64))
    state = random_pool(slots, HV, V, K, F64, generator=gen)
    before = state.clone()
    reference.commit_ring(state, *rings, torch.tensor([0]), torch.tensor([1]), compute_dtype=F64)
    assert not torch.equal(state[0], before[0]), "with null_block_id=-1 slot 0 is a real slot"
    assert torch.equal(state[1], before[1])


# ----------------------------------------------------------------------------
# 5. gated RMSNorm and the gate by hand
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [F64, torch.bfloat16], ids=["f64-out", "bf16-out"])
def test_gated_rmsnorm_matches_hand_formula(out_dtype):
    gen = torch.Generator().manual_seed(50)
    B, HV, V, eps = 3, 2, 24, 1e-5
    x = torch.randn(B, HV, V, generator=gen, dtype=F64) * 3.0
    gate = torch.randn(B, HV, V, generator=gen, dtype=F64)
    weight = torch.rand(V, generator=gen) + 0.5
    rms = torch.sqrt((x ** 2).sum(-1, keepdim=True) / V + eps)
    want = x / rms * weight.double() / (1.0 + torch.exp(-gate))
    assert_close(reference.gated_rmsnorm(x, gate, weight.double(), eps), want, EXACT, "gated_rmsnorm")
    out = torch.full((B, HV, V), POISON, dtype=out_dtype)
    assert reference.gated_rmsnorm_op(x, gate, weight, out, eps=eps, compute_dtype=F64) is out
    fn = reference.gated_rmsnorm(x, gate, weight.double(), eps)
    assert torch.equal(out, fn.to(out_dtype)), "gated_rmsnorm_op must write gated_rmsnorm rounded to out's dtype"
    assert_close(out, want, EXACT if out_dtype == F64 else 4e-3, "gated_rmsnorm_op vs hand formula")


def test_kda_gate_default_branch_and_softplus_threshold():
    HV, K = 2, 8
    x = torch.tensor([-30.0, -1.0, 0.0, 5.0, 19.5, 20.0, 20.5, 100.0], dtype=F64).expand(HV, K)
    A_log = torch.tensor([-0.5, 0.7], dtype=F64)
    dt_bias = torch.linspace(-1.0, 1.0, HV * K, dtype=F64)
    a = x - dt_bias.view(HV, K)  # so that a + dt_bias is x (up to rounding)
    xs = a + dt_bias.view(HV, K)
    A = torch.exp(A_log)[:, None]
    g = reference.kda_gate(a, A_log, dt_bias.view(HV, K))
    above = xs > 20.0
    assert torch.equal(g[above], (-A * xs)[above]), "softplus(x) must be exactly x above 20"
    # log1p(e^x) differs from x by ~1e-9 at x = 20.5: the line above pins the threshold.
    assert not torch.equal((-A * torch.log1p(torch.exp(xs)))[above], (-A * xs)[above])
    want = -A * torch.log1p(torch.exp(xs))  # log(1 + e^x), exact also for x = -30
    assert torch.allclose(g[~above], want[~above], rtol=1e-12, atol=1e-300), "softplus(x) = log(1 + e^x) at x <= 20"
    assert (g <= 0).all() and torch.isfinite(g).all()


@pytest.mark.parametrize("lower_bound", [-5.0, -2.0, -0.5])
def test_kda_gate_safe_branch(lower_bound):
    gen = torch.Generator().manual_seed(51)
    HV, K = 3, 8
    a = torch.randn(2, HV, K, generator=gen, dtype=F64) * 4.0
    A_log = torch.randn(HV, generator=gen, dtype=F64)
    dt_bias = torch.randn(HV, K, generator=gen, dtype=F64)
    g = reference.kda_gate(a, A_log, dt_bias, lower_bound)
    want = lower_bound / (1.0 + torch.exp(-torch.exp(A_log)[:, None] * (a + dt_bias)))
    assert_close(g, want, EXACT, "safe gate")
    assert ((g >= lower_bound) & (g <= 0)).all(), "safe gate stays in [L, 0]"
    assert torch.equal(reference.kda_beta(a[..., 0]), torch.sigmoid(a[..., 0]))
