"""Speculative verify and the commits: kernels against the float64 reference, the
speculative loop against plain one-token decoding, ring commit == snapshot commit
bitwise, and the DSpARK / ReplaySSM drop-ins with their exact error texts."""
import dataclasses

import pytest
import torch

import kdakit
from kdakit import reference
from kdakit.compat import sglang

from helpers import RING_FORMS, assert_close, with_ring_form, sweep

BACKENDS = ["reference", "triton"]


@pytest.fixture
def use_ring_form(monkeypatch):
    """Force ring mode's form whatever the batch size (tests use tiny batches): the public
    entry's calls pick the pinned config with that form."""
    from kdakit.ops import mtp_verify as mtp_verify_module
    pinned = mtp_verify_module.mtp_verify_config

    def use(form):
        monkeypatch.setattr(mtp_verify_module, "mtp_verify_config",
                            lambda *a, **kw: with_ring_form(pinned(*a, **kw), form))
    return use
F64 = torch.float64
W = 4


def make_problem(seed, *, N=3, T=3, H=1, HV=2, K=16, V=24, slots=6, scratch=5, act=torch.bfloat16,
                 conv=True, norm=False, padding=True):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(act)
    p = dict(q=rnd(N, T, H, K), k=rnd(N, T, H, K), v=rnd(N, T, HV, V), a=rnd(N, T, HV, K), b=rnd(N, T, HV),
             A_log=torch.rand(HV, generator=g), dt_bias=torch.randn(HV * K, generator=g) * 0.5,
             state=torch.randn(slots, HV, V, K, generator=g) * 0.5)
    slots_used = torch.randperm(slots, generator=g)[:N].to(torch.int32)
    if padding:
        slots_used[1] = -1
    p["slot_indices"] = slots_used
    p["scratch_indices"] = torch.randperm(scratch, generator=g)[:N].to(torch.int32)
    channels = (H * K, H * K, HV * V)
    if conv:
        p["conv_weights"] = tuple(torch.randn(c, W, generator=g) * 0.5 for c in channels)
        p["conv_states"] = tuple(rnd(slots, c, W - 1) for c in channels)
    if norm:
        p["norm_gate"] = rnd(N, T, HV, V)
        p["norm_weight"] = torch.rand(V, generator=g) + 0.5
    dims = dict(N=N, T=T, H=H, HV=HV, K=K, V=V, slots=slots, scratch=scratch, act=act, channels=channels)
    return p, dims


def fresh_buffers(d, *, mode, snap_dtype=torch.float32, poison=7.0):
    """Scratch buffers one step longer than needed, poisoned, so stray writes show."""
    T, act = d["T"], d["act"]
    bufs = {"intermediate_conv": tuple(torch.full((d["scratch"], T + 1, c, W - 1), poison, dtype=act)
                                       for c in d["channels"])}
    if mode == "snapshot":
        bufs["snapshots"] = torch.full((d["scratch"], T + 1, d["HV"], d["V"], d["K"]), poison, dtype=snap_dtype)
    else:
        L = T + 1
        bufs["rings"] = (torch.full((d["slots"], d["H"], L, d["K"]), poison, dtype=act),
                         torch.full((d["slots"], d["HV"], L, d["V"]), poison, dtype=act),
                         torch.full((d["slots"], d["HV"], L, d["K"]), poison),
                         torch.full((d["slots"], d["HV"], L), poison))
    return bufs


def call_verify_triton(p, bufs, *, conv, lower_bound, config):
    """``call_verify`` on the Triton backend with an explicit launch ``config``."""
    from kdakit.ops.mtp_verify import mtp_verify_triton
    out = torch.empty(p["v"].shape, dtype=p["q"].dtype)
    return mtp_verify_triton(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                             p["slot_indices"], p["scratch_indices"], out,
                             conv_weights=p["conv_weights"] if conv else None,
                             conv_states=p["conv_states"] if conv else None,
                             intermediate_conv=bufs["intermediate_conv"] if conv else None, conv_bias=None,
                             snapshots=bufs.get("snapshots"), rings=bufs.get("rings"), scale=p["q"].shape[-1] ** -0.5,
                             lower_bound=lower_bound, norm_gate=p.get("norm_gate"), norm_weight=p.get("norm_weight"),
                             norm_eps=1e-6, config=config)


def call_verify(p, bufs, *, conv, lower_bound, backend=None, f64=False):
    kw = dict(snapshots=bufs.get("snapshots"), rings=bufs.get("rings"), lower_bound=lower_bound,
              norm_gate=p.get("norm_gate"), norm_weight=p.get("norm_weight"))
    if conv:
        kw.update(conv_weights=p["conv_weights"], conv_states=p["conv_states"],
                  intermediate_conv=bufs["intermediate_conv"])
    if f64:
        if conv:
            kw["conv_weights"] = tuple(w.double() for w in p["conv_weights"])
        kw = {key: val for key, val in kw.items() if key not in ("norm_weight",)}
        kw["norm_weight"] = None if p.get("norm_weight") is None else p["norm_weight"].double()
        out = torch.empty(p["v"].shape, dtype=F64)
        return reference.mtp_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"].double(),
                                    p["dt_bias"].double(), p["state"].double(), p["slot_indices"],
                                    p["scratch_indices"], out, compute_dtype=F64, **kw)
    return kdakit.mtp_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                             p["slot_indices"], p["scratch_indices"], backend=backend, **kw)


def both_ring_forms(cases):
    """Each ring-mode case once per form (``mtp_verify.ring_form``: the batch size picks one)."""
    out = []
    for case in cases:
        mode, *rest = case.values
        out += ([pytest.param(f"ring-{form}", *rest, id=f"{case.id}-{form}") for form in RING_FORMS]
                if mode == "ring" else [case])
    return out


CASES = both_ring_forms([  # (mode, conv, norm, lower_bound, act, K, V, T)
    pytest.param("snapshot", True, False, -5.0, torch.bfloat16, 16, 24, 3, id="snapshot-conv-safegate-bf16-K16-V24"),
    pytest.param("ring", True, True, -2.0, torch.bfloat16, 16, 16, 3, id="ring-conv-norm-bf16"),
    pytest.param("snapshot", False, True, None, torch.float32, 24, 16, 3, id="snapshot-noconv-norm-defaultgate-f32"),
    pytest.param("ring", False, False, None, torch.float32, 16, 32, 3, id="ring-noconv-f32-K16-V32"),
    # a longer chain
    pytest.param("ring", False, False, -1.0, torch.float32, 16, 16, 6, id="ring-noconv-f32-6-steps"),
    pytest.param("ring", True, False, None, torch.float32, 16, 40, 8, id="ring-conv-defaultgate-f32-V40-8-steps"),
    pytest.param("snapshot", True, False, None, torch.float32, 24, 16, 8, id="snapshot-conv-f32-8-steps"),
    # ring mode's chunk form past 8 steps (16-step tiles), K not a power of two or a multiple
    # of the state kernel's K chunk; and a single step
    pytest.param("ring", False, False, -5.0, torch.float32, 48, 24, 11, id="ring-noconv-f32-K48-V24-11-steps"),
    pytest.param("ring", True, False, None, torch.bfloat16, 16, 16, 1, id="ring-conv-bf16-1-step"),
])


def test_ring_form_follows_the_batch():
    """The chunk form once there are enough (request, value head) pairs to fill the GPU; the
    recurrence below, where its single launch is faster (results/mtp_ring_forms_h200.json)."""
    from kdakit.ops.mtp_verify import RING_CHUNK_FORM_ABOVE, ring_form
    assert RING_CHUNK_FORM_ABOVE == 1024
    assert ring_form(1, 32, 8) == "recurrent"
    assert ring_form(4, 32, 8) == ring_form(16, 32, 2) == "recurrent"
    assert ring_form(8, 32, 8) == ring_form(32, 32, 2) == ring_form(9, 32, 4) == "chunked"
    assert ring_form(64, 32, 4) == "chunked"


@pytest.mark.parametrize("mode", ["ring-chunked", "ring-chunked-from-inputs", "ring-recurrent", "snapshot"])
def test_verify_steep_decay_stays_finite(mode, use_ring_form):
    """A = exp(A_log) ~ 55 with the default gate: per-step log-decays of -50 and below
    (exp underflows to 0; the state must decay, not turn NaN)."""
    mode, _, form = mode.partition("-")
    use_ring_form(form)
    p, d = make_problem(3, act=torch.float32, conv=False, T=8, K=16, V=16)
    p["A_log"] = torch.full_like(p["A_log"], 4.0)
    p["a"] = p["a"] * 4
    ref_out = call_verify(p, fresh_buffers(d, mode=mode, snap_dtype=F64), conv=False, lower_bound=None, f64=True)
    out = call_verify(p, fresh_buffers(d, mode=mode), conv=False, lower_bound=None, backend="triton")
    assert torch.isfinite(out).all()
    assert_close(out, ref_out, 1e-5, "out")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,conv,norm,lower_bound,act,K,V,T", sweep(CASES, keep=4))
def test_verify_matches_float64_reference(backend, mode, conv, norm, lower_bound, act, K, V, T, use_ring_form):
    mode, _, form = mode.partition("-")
    use_ring_form(form)
    p, d = make_problem(11, act=act, conv=conv, norm=norm, K=K, V=V, T=T)
    state_before = p["state"].clone()
    conv_before = [c.clone() for c in p.get("conv_states", ())]
    ref_bufs, bufs = fresh_buffers(d, mode=mode, snap_dtype=F64), fresh_buffers(d, mode=mode)
    ref_out = call_verify(p, ref_bufs, conv=conv, lower_bound=lower_bound, f64=True)
    out = call_verify(p, bufs, conv=conv, lower_bound=lower_bound, backend=backend)
    tol = 1e-5 if act == torch.float32 else 2e-2
    assert_close(out, ref_out, tol, "out")
    assert torch.equal(out[1], torch.zeros_like(out[1])), "padding row output must be zero"
    assert torch.equal(p["state"], state_before), "the persistent state pool is read-only"
    for c, before in zip(p.get("conv_states", ()), conv_before):
        assert torch.equal(c, before), "the persistent conv pools are read-only"
    live = [0, 2]
    rows = p["scratch_indices"][live].long()
    if mode == "snapshot":
        # bf16 post-conv values: a float32 conv and a float64 one can round to neighbouring bf16s
        assert_close(bufs["snapshots"][rows, :d["T"]], ref_bufs["snapshots"][rows, :d["T"]], 1e-5 if act ==
                     torch.float32 else 1e-2, "snapshots")
        untouched = torch.ones(d["scratch"], dtype=torch.bool)
        untouched[rows] = False
        assert (bufs["snapshots"][untouched] == 7.0).all(), "scratch rows of padding/unused requests untouched"
        assert (bufs["snapshots"][:, d["T"]] == 7.0).all(), "no step past T is written"
    else:
        slots = p["slot_indices"][live].long()
        for got, want, name in zip(bufs["rings"], ref_bufs["rings"], ("k", "v", "g", "beta")):
            assert_close(got[slots][:, :, :d["T"]], want[slots][:, :, :d["T"]], 1e-2, f"ring_{name}")
            others = torch.ones(d["slots"], dtype=torch.bool)
            others[slots] = False
            assert (got[others] == 7.0).all(), f"ring_{name} of other slots untouched"
            assert (got[:, :, d["T"]] == 7.0).all(), f"ring_{name} past step T untouched"
    if conv:
        for got, want in zip(bufs["intermediate_conv"], ref_bufs["intermediate_conv"]):
            assert torch.equal(got[rows, :d["T"]], want[rows, :d["T"]]), "conv windows after each step"
            assert (got[p["scratch_indices"][1].long()] == 7.0).all(), "padding request's scratch row untouched"


def plain_decode(p, d, state, conv_pool, tokens, slots, lower_bound):
    """One token at a time through the plain decode path (conv update + packed decode)."""
    N, H, HV, K, V = d["N"], d["H"], d["HV"], d["K"], d["V"]
    outs = []
    for t in tokens:
        x = torch.cat([p["q"][:, t].flatten(1), p["k"][:, t].flatten(1), p["v"][:, t].flatten(1)], dim=1)
        mixed = torch.empty_like(x)
        reference.causal_conv1d_update(x, conv_pool, torch.cat(p["conv_weights"]), slots, mixed)
        out = torch.empty(N, 1, HV, V, dtype=d["act"])
        kdakit.packed_decode(mixed, p["a"][:, t].flatten(1), p["b"][:, t], p["A_log"], p["dt_bias"], state, slots,
                             out, lower_bound=lower_bound, backend="triton")
        outs.append(out[:, 0])
    return outs


@pytest.mark.parametrize("form", RING_FORMS)
@pytest.mark.parametrize("lower_bound", sweep([None, -3.0]), ids=["default-gate", "safe-gate"])
def test_speculative_loop_equals_plain_decode_and_ring_equals_snapshot_bitwise(lower_bound, form, use_ring_form):
    """Rounds of verify + commit with random accept lengths: ring and snapshot commits agree
    bitwise, and both equal plain one-token decoding of the accepted tokens."""
    use_ring_form(form)
    gen = torch.Generator().manual_seed(5)
    p, d = make_problem(21, N=2, T=3, K=16, V=16, padding=False)
    pools = {m: (p["state"].clone(), tuple(c.clone() for c in p["conv_states"])) for m in ("snapshot", "ring")}
    plain_state = p["state"].clone()
    plain_conv = torch.cat([c.clone() for c in p["conv_states"]], dim=1)
    slots = p["slot_indices"]
    for _ in range(2):
        p2, _ = make_problem(int(torch.randint(1000, (1,), generator=gen)), N=2, T=3, K=16, V=16, padding=False)
        for key in ("q", "k", "v", "a", "b"):
            p[key] = p2[key]
        accept = torch.randint(1, d["T"] + 1, (d["N"],), generator=gen).to(torch.int32)
        outs = {}
        for mode in ("snapshot", "ring"):
            state, conv_states = pools[mode]
            bufs = fresh_buffers(d, mode=mode)
            outs[mode] = kdakit.mtp_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], state,
                                           slots, p["scratch_indices"], conv_weights=p["conv_weights"],
                                           conv_states=conv_states, intermediate_conv=bufs["intermediate_conv"],
                                           snapshots=bufs.get("snapshots"), rings=bufs.get("rings"),
                                           lower_bound=lower_bound, backend="triton")
            if mode == "snapshot":
                kdakit.commit_snapshots(state, bufs["snapshots"], slots, p["scratch_indices"], accept - 1,
                                        conv_states=conv_states, intermediate_conv=bufs["intermediate_conv"],
                                        backend="triton")
            else:
                kdakit.commit_ring(state, *bufs["rings"], slots, accept, backend="triton")
                kdakit.commit_snapshots(state, None, slots, p["scratch_indices"], accept - 1,
                                        conv_states=conv_states, intermediate_conv=bufs["intermediate_conv"],
                                        backend="triton")
        # ring mode's outputs come from the chunk form: the same numbers up to float32 rounding
        # (then bf16), not bit for bit
        assert_close(outs["ring"], outs["snapshot"], 1e-2, "ring vs snapshot verify outputs")
        assert torch.equal(pools["snapshot"][0], pools["ring"][0]), "ring commit must equal snapshot commit bitwise"
        # Plain decoding of each request's accepted tokens (requests differ in length: one at a time).
        for n in range(d["N"]):
            one = slots[n:n + 1]
            sub = {key: val[n:n + 1] for key, val in p.items() if key in ("q", "k", "v", "a", "b")}
            sub.update(conv_weights=p["conv_weights"], A_log=p["A_log"], dt_bias=p["dt_bias"])
            plain = plain_decode(sub, dict(d, N=1), plain_state, plain_conv, range(int(accept[n])), one,
                                 lower_bound)
            for t, o in enumerate(plain):
                assert_close(outs["ring"][n, t], o[0], 2e-2, f"verify output {t} vs plain decode")
        slot_list = slots.long()
        # The plain path's conv is the torch reference: its bf16 rounding of the post-conv values
        # can land one ulp apart from the kernel's, so the states agree at bf16 level, not float32.
        assert_close(pools["ring"][0][slot_list], plain_state[slot_list], 2e-2, "committed state vs plain decode")
        committed_conv = torch.cat(pools["ring"][1], dim=1)
        assert torch.equal(committed_conv[slot_list], plain_conv[slot_list]), "committed conv windows"


@pytest.mark.parametrize("form", RING_FORMS)
@pytest.mark.parametrize("pool_dtype", sweep([torch.bfloat16, torch.float16]), ids=["bf16-pool", "f16-pool"])
def test_ring_verify_on_a_16_bit_state_pool(pool_dtype, form, use_ring_form):
    """A 16-bit state pool (float32 math in registers) through both forms of ring mode,
    against float64 on the same (rounded) pool; the pool stays untouched."""
    use_ring_form(form)
    p, d = make_problem(17, act=torch.float32, conv=False, T=4, K=32, V=16, H=2, HV=4)
    p["state"] = p["state"].to(pool_dtype)
    before = p["state"].clone()
    ref_out = call_verify(p, fresh_buffers(d, mode="ring"), conv=False, lower_bound=-2.0, f64=True)
    out = call_verify(p, fresh_buffers(d, mode="ring"), conv=False, lower_bound=-2.0, backend="triton")
    assert_close(out, ref_out, 1e-5, "out")
    assert torch.equal(p["state"], before)


@pytest.mark.parametrize("tile_bytes,commit_tiles,steps_ahead", sweep([(4096, 1, 2), (256, 1, 2), (256, 3, 2), (256, 1, 1)], keep=2),
                         ids=["one-tile", "4-row-tiles", "4-row-tiles-3-per-commit-program", "commit-1-step-ahead"])
@pytest.mark.parametrize("T", sweep([1, 2, 5], keep=[2]), ids=lambda t: f"T{t}")
@pytest.mark.parametrize("form", RING_FORMS)
def test_snapshot_and_ring_verify_agree_and_ring_commit_is_bitwise(T, tile_bytes, commit_tiles, steps_ahead, form):
    """Snapshot and ring verify (conv prologue kernel, then the recurrence or the chunk form)
    compute the same outputs and windows; a ring commit of any prefix equals the snapshot commit bitwise,
    whatever tile of state rows the recurrence kernels share, however many tiles a commit program folds and
    however far ahead it loads its rings."""
    from kdakit.ops.commit import CommitRingConfig, commit_ring_triton
    from kdakit.ops.mtp_verify import mtp_verify_config, mtp_verify_triton, recurrence_tile
    p, d = make_problem(41, act=torch.bfloat16, conv=True, T=T, K=16, V=16, padding=True)
    block_v, num_warps = recurrence_tile(d["V"], d["K"], tile_bytes)
    verify_config = dataclasses.replace(with_ring_form(mtp_verify_config(d["N"], T, d["HV"], d["V"], d["K"], -3.0), form),
                                        block_v=block_v, num_warps=num_warps)
    commit_config = CommitRingConfig(block_v=block_v, num_warps=num_warps, tiles=commit_tiles, steps_ahead=steps_ahead)
    results = {}
    for mode in ("snapshot", "ring"):
        bufs = fresh_buffers(d, mode=mode)
        out = torch.full(p["v"].shape, 7.0, dtype=p["v"].dtype)
        mtp_verify_triton(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                          p["slot_indices"], p["scratch_indices"], out, conv_weights=p["conv_weights"],
                          conv_states=p["conv_states"], intermediate_conv=bufs["intermediate_conv"], conv_bias=None,
                          snapshots=bufs.get("snapshots"), rings=bufs.get("rings"), scale=16 ** -0.5,
                          lower_bound=-3.0, norm_gate=None, norm_weight=None, norm_eps=1e-6, config=verify_config)
        results[mode] = (out, bufs)
    ref_out = call_verify(p, fresh_buffers(d, mode="snapshot", snap_dtype=F64), conv=True, lower_bound=-3.0,
                          f64=True)
    assert_close(results["snapshot"][0], ref_out, 2e-2, "out")
    ref_windows = fresh_buffers(d, mode="snapshot")["intermediate_conv"]
    call_verify(p, {"intermediate_conv": ref_windows, "snapshots": None}, conv=True, lower_bound=-3.0,
                backend="reference")
    live_rows = p["scratch_indices"][p["slot_indices"] >= 0].long()
    for got, want in zip(results["ring"][1]["intermediate_conv"], ref_windows):
        assert torch.equal(got[live_rows], want[live_rows]), "windows after each step"
        assert torch.equal(got[p["scratch_indices"][1].long()], want[p["scratch_indices"][1].long()]), \
            "the padding request's scratch row stays untouched"
    assert_close(results["ring"][0], results["snapshot"][0], 1e-2, "ring (chunk form) vs snapshot outputs")
    for got, want in zip(results["snapshot"][1]["intermediate_conv"], results["ring"][1]["intermediate_conv"]):
        assert torch.equal(got, want)
    live = p["slot_indices"] >= 0
    slots, rows = p["slot_indices"][live], p["scratch_indices"][live]
    accept = torch.tensor([T, max(1, T - 2)], dtype=torch.int32)
    snap_state, ring_state = p["state"].clone(), p["state"].clone()
    kdakit.commit_snapshots(snap_state, results["snapshot"][1]["snapshots"], slots, rows, accept - 1,
                            backend="triton")
    commit_ring_triton(ring_state, *results["ring"][1]["rings"], slots, accept, track_slots=None, track_steps=None,
                       use_qk_l2norm=True, null_block_id=-1, config=commit_config)
    assert torch.equal(snap_state, ring_state), "ring commit must equal snapshot commit bitwise"


@pytest.mark.parametrize("factored", [True, False], ids=["pair-sums-factored", "pair-sums-pairwise"])
@pytest.mark.parametrize("T,lower_bound", sweep([(4, -5.0), (11, -5.0), (8, -0.5)], keep=2), ids=["T4-lb5", "T11-lb5", "T8-lb0.5"])
def test_ring_chunk_form_pair_sums_both_ways(factored, T, lower_bound):
    """The chunk form's pair sums with the safe gate, factored (e^G_t · e^-G_s) or pair by
    pair, against float64 on a steep decay: the same outputs to float32 accuracy."""
    from kdakit.ops.mtp_verify import mtp_verify_config
    p, d = make_problem(59, act=torch.float32, conv=False, T=T, K=48, V=24, H=1, HV=2)
    config = mtp_verify_config(d["N"], T, d["HV"], d["V"], d["K"], lower_bound)
    assert config.ring.factored, "the rule factors these"
    config = dataclasses.replace(config, ring_form="chunked",
                                 ring=dataclasses.replace(config.ring, factored=factored))
    p["A_log"] = torch.full_like(p["A_log"], 3.0)  # the gate at its bound: G reaches T * lower_bound
    ref_out = call_verify(p, fresh_buffers(d, mode="ring"), conv=False, lower_bound=lower_bound, f64=True)
    out = call_verify_triton(p, fresh_buffers(d, mode="ring"), conv=False, lower_bound=lower_bound, config=config)
    assert_close(out, ref_out, 1e-5, "out")


PAIR_DOTS_CASES = [  # (T, lower_bound, steep gate, dot_spread_max): which pair sums each program takes
    pytest.param(11, -5.0, False, 60.0, id="T11-safegate-factored-dots"),
    pytest.param(12, None, False, 60.0, id="T12-defaultgate-mild-dots"),
    pytest.param(9, None, True, 60.0, id="T9-defaultgate-steep-by-column"),
    pytest.param(12, None, False, 0.0, id="T12-defaultgate-bound0-by-column"),
    pytest.param(5, -2.0, False, 60.0, id="T5-padded-to-16-rows"),
]


@pytest.mark.parametrize("T,lower_bound,steep,dot_spread_max", sweep(PAIR_DOTS_CASES, keep=3))
def test_ring_chunk_form_pair_dots(T, lower_bound, steep, dot_spread_max):
    """``RingVerifyConfig.pair_dots``: the steps kernel's pair sums, M and x as tensor-core
    products (factored at the committed state where the program's decays allow, a column at a
    time where they are steeper than ``dot_spread_max``) against float64 and against the
    column-at-a-time steps on the same inputs; finite under per-step decays of -50."""
    from kdakit.ops.mtp_verify import mtp_verify_config
    p, d = make_problem(61, act=torch.float32, conv=False, T=T, K=48, V=24, H=1, HV=2)
    if steep:
        p["A_log"] = torch.full_like(p["A_log"], 4.0)
        p["a"] = p["a"] * 4
    config = mtp_verify_config(d["N"], T, d["HV"], d["V"], d["K"], lower_bound)
    columns = dataclasses.replace(config, ring_form="chunked", ring=dataclasses.replace(config.ring, pair_dots=False))
    dots = dataclasses.replace(columns, ring=dataclasses.replace(columns.ring, pair_dots=True,
                                                                 dot_spread_max=dot_spread_max))
    ref_out = call_verify(p, fresh_buffers(d, mode="ring"), conv=False, lower_bound=lower_bound, f64=True)
    out_columns = call_verify_triton(p, fresh_buffers(d, mode="ring"), conv=False, lower_bound=lower_bound,
                                     config=columns)
    bufs = fresh_buffers(d, mode="ring")
    out = call_verify_triton(p, bufs, conv=False, lower_bound=lower_bound, config=dots)
    assert torch.isfinite(out).all()
    assert_close(out, ref_out, 1e-5, "pair dots vs float64")
    assert_close(out, out_columns, 1e-5, "pair dots vs the column-at-a-time steps")
    ref_bufs = fresh_buffers(d, mode="ring")
    call_verify_triton(p, ref_bufs, conv=False, lower_bound=lower_bound, config=columns)
    for x, y in zip(bufs["rings"], ref_bufs["rings"]):
        assert torch.equal(x, y), "ring entries: the same bits either way"


def test_factored_pair_sums_rule():
    from kdakit.ops.ring_verify import factored_pair_sums
    assert factored_pair_sums(8, -5.0) and factored_pair_sums(16, -5.0) and factored_pair_sums(4, -1.0)
    assert not factored_pair_sums(17, -5.0), "e^85 is past what the factors may reach"
    assert not factored_pair_sums(4, None), "the default gate's decay is unbounded"


@pytest.mark.parametrize("window_runs", [False, True], ids=["windows-per-tap", "windows-as-runs"])
@pytest.mark.parametrize("T,V,W_conv", sweep([(3, 24, 4), (8, 40, 4), (5, 24, 3)]), ids=["T3", "T8-V40", "T5-W3"])
def test_verify_conv_windows_both_store_paths(window_runs, T, V, W_conv, monkeypatch):
    """The conv prologue stores the windows after each step tap by tap or as whole runs
    (verify_conv.window_runs picks by T): both bitwise equal to the reference's raw inputs,
    with a partial channel block, a padding request's scratch row and step T untouched."""
    import sys
    from kdakit.ops.mtp_verify import mtp_verify_config
    monkeypatch.setattr(sys.modules[__name__], "W", W_conv)  # the conv width make_problem uses
    p, d = make_problem(53, act=torch.bfloat16, conv=True, T=T, K=16, V=V, H=1, HV=2)
    assert p["conv_weights"][0].shape[1] == W_conv
    config = mtp_verify_config(d["N"], T, d["HV"], d["V"], d["K"], -2.0)
    config = dataclasses.replace(config, conv=dataclasses.replace(config.conv, window_runs=window_runs))
    got, want = fresh_buffers(d, mode="snapshot"), fresh_buffers(d, mode="snapshot")
    call_verify_triton(p, got, conv=True, lower_bound=-2.0, config=config)
    call_verify(p, want, conv=True, lower_bound=-2.0, backend="reference")
    for g, w in zip(got["intermediate_conv"], want["intermediate_conv"]):
        assert torch.equal(g, w), "windows after each step (and every untouched position) bitwise"
        assert (g[p["scratch_indices"][1].long()] == 7.0).all(), "the padding request's scratch row untouched"
        assert (g[:, T] == 7.0).all(), "no step past T written"


@pytest.mark.parametrize("commit_tiles", [1, 4], ids=["tile-per-program", "4-tiles-per-program-1-step-ahead"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_ring_track_slot_null_block_and_all_layers(backend, commit_tiles):
    from kdakit.ops.commit import CommitRingConfig, commit_ring_triton
    from kdakit.ops.mtp_verify import mtp_verify_config, recurrence_tile
    p, d = make_problem(31, conv=False, act=torch.float32, padding=False)
    bufs = fresh_buffers(d, mode="ring")
    commit_config = None
    if commit_tiles > 1:  # 6 tiles of 4 rows (V = 24): one full program of 4 and one half-masked
        if backend == "reference":
            pytest.skip("tiles are a Triton launch parameter")
        block_v, num_warps = recurrence_tile(d["V"], d["K"], 256)
        commit_config = CommitRingConfig(block_v=block_v, num_warps=num_warps, tiles=commit_tiles, steps_ahead=1)
        config = dataclasses.replace(mtp_verify_config(d["N"], d["T"], d["HV"], d["V"], d["K"], None),
                                     block_v=block_v, num_warps=num_warps)
        call_verify_triton(p, bufs, conv=False, lower_bound=None, config=config)
    else:
        kdakit.mtp_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                          p["slot_indices"], p["scratch_indices"], rings=bufs["rings"], backend=backend)

    def commit_ring(state, *args, **kw):
        if commit_config is None:
            return kdakit.commit_ring(state, *args, **kw, backend=backend)
        return commit_ring_triton(state, *args, **kw, use_qk_l2norm=True, null_block_id=-1, config=commit_config)
    slots = p["slot_indices"]
    free = [s for s in range(d["slots"]) if s not in slots.tolist()]
    accept = torch.tensor([3, 0, 2], dtype=torch.int32)
    track_slots = torch.tensor([free[0], free[1], free[2]], dtype=torch.int32)
    track_steps = torch.tensor([1, 0, 5], dtype=torch.int32)   # row 1 skipped (accept 0), row 2 out of range
    want = p["state"].double().clone()
    reference.commit_ring(want, *(r.double() if r.is_floating_point() else r for r in bufs["rings"]), slots,
                          accept, track_slots=track_slots, track_steps=track_steps, compute_dtype=F64)
    state = p["state"].clone()
    layered = torch.stack([p["state"].clone(), p["state"].clone()])
    commit_ring(state, *bufs["rings"], slots, accept, track_slots=track_slots, track_steps=track_steps)
    assert_close(state, want, 1e-5, "ring commit")
    assert torch.equal(state[free[1]], p["state"][free[1]]) and torch.equal(state[free[2]], p["state"][free[2]])
    assert torch.equal(state[slots[1]], p["state"][slots[1]]), "accept_len 0 leaves the slot"
    commit_ring(layered, *(torch.stack([r, r]) for r in bufs["rings"]), slots, accept,
                track_slots=track_slots, track_steps=track_steps)
    assert torch.equal(layered[0], state) and torch.equal(layered[1], state), "all-layers launch == per layer"
    # sglang's default null_block_id=0 skips slot 0 as well
    zero_slot = torch.tensor([0], dtype=torch.int32)
    before = state.clone()
    sglang.commit_kda_replayssm_spec(state, bufs["rings"][1], bufs["rings"][0], bufs["rings"][2], bufs["rings"][3],
                                     zero_slot, torch.tensor([2], dtype=torch.int32), d["T"] + 1, d["H"])
    assert torch.equal(state, before)


def dspark_inputs(seed, *, N=2, steps=2, H=1, slots=4, scratch=3, ring=False, onorm=False):
    g = torch.Generator().manual_seed(seed)
    T, C = N * steps, H * 128
    bf = torch.bfloat16
    x = {name: (torch.randn(1, T, H, 128, generator=g)).to(bf) for name in ("x_q", "x_k", "x_v", "g")}
    kw = dict(x, beta=torch.randn(1, T, H, generator=g).to(bf),
              w_q=torch.randn(C, 4, generator=g) * 0.5, w_k=torch.randn(C, 4, generator=g) * 0.5,
              w_v=torch.randn(C, 4, generator=g) * 0.5,
              cs_q=torch.randn(slots, C, 3, generator=g).to(bf), cs_k=torch.randn(slots, C, 3, generator=g).to(bf),
              cs_v=torch.randn(slots, C, 3, generator=g).to(bf),
              A_log=torch.rand(H, generator=g), dt_bias=torch.randn(C, generator=g) * 0.5,
              recurrent_state=torch.randn(slots, H, 128, 128, generator=g) * 0.3,
              intermediate_ssm=torch.zeros(scratch, steps, H, 128, 128),
              intermediate_state_indices=torch.tensor([2, 0], dtype=torch.int32)[:N],
              intermediate_conv_q=torch.zeros(scratch, steps, C, 3, dtype=bf),
              intermediate_conv_k=torch.zeros(scratch, steps, C, 3, dtype=bf),
              intermediate_conv_v=torch.zeros(scratch, steps, C, 3, dtype=bf),
              ssm_state_indices=torch.tensor([3, 1], dtype=torch.int32)[:N],
              cu_seqlens=torch.arange(0, T + 1, steps, dtype=torch.int32), lower_bound=-5.0)
    if ring:
        kw.update(replayssm_rawv=torch.zeros(slots, H, steps, 128, dtype=bf),
                  replayssm_rawk=torch.zeros(slots, H, steps, 128, dtype=bf),
                  replayssm_g=torch.zeros(slots, H, steps, 128), replayssm_beta=torch.zeros(slots, H, steps))
    if onorm:
        kw.update(onorm_gate=torch.randn(1, T, H, 128, generator=g).to(bf), onorm_weight=torch.rand(128) + 0.5,
                  onorm_eps=1e-6)
    return kw


def test_dspark_drop_in_matches_native_reference():
    kw = dspark_inputs(41, onorm=True)
    state_before = kw["recurrent_state"].clone()
    out = sglang.fused_kda_decode_mtp_dspark(**kw)
    assert out.shape == kw["x_v"].shape and out.dtype == torch.bfloat16
    assert torch.equal(kw["recurrent_state"], state_before)
    N, steps, dense = 2, 2, (2, 2, 1, 128)
    ref = torch.empty(dense, dtype=F64)
    snaps = torch.zeros_like(kw["intermediate_ssm"], dtype=F64)
    reference.mtp_verify(kw["x_q"].view(dense), kw["x_k"].view(dense), kw["x_v"].view(dense), kw["g"].view(dense),
                         kw["beta"].view(N, steps, 1), kw["A_log"].double(), kw["dt_bias"].double(),
                         kw["recurrent_state"].double(), kw["ssm_state_indices"], kw["intermediate_state_indices"],
                         ref, conv_weights=(kw["w_q"].double(), kw["w_k"].double(), kw["w_v"].double()),
                         conv_states=(kw["cs_q"], kw["cs_k"], kw["cs_v"]),
                         intermediate_conv=tuple(torch.zeros_like(kw[f"intermediate_conv_{c}"]) for c in "qkv"),
                         snapshots=snaps, lower_bound=-5.0, norm_gate=kw["onorm_gate"].view(dense),
                         norm_weight=kw["onorm_weight"].double(), compute_dtype=F64)
    assert_close(out.view(dense), ref, 2e-2, "dspark out")
    assert_close(kw["intermediate_ssm"][[2, 0]], snaps[[2, 0]], 1e-2, "dspark snapshots")


def _break(kw, key, value):
    kw = dict(kw)
    kw[key] = value
    return kw


BF = torch.bfloat16
DSPARK_ERRORS = [
    ("q-shape", lambda kw: _break(kw, "x_q", kw["x_q"][:, :, :, :64]), "expected q/k shape (1, 4, 1, 128)"),
    ("k-shape", lambda kw: _break(kw, "x_k", kw["x_k"][:, :3]), "expected q/k shape (1, 4, 1, 128)"),
    ("v-shape", lambda kw: _break(kw, "x_v", kw["x_v"][:, :3]), "expected v/g shape (1, 4, 1, 128)"),
    ("g-shape", lambda kw: _break(kw, "g", kw["g"][..., :64]), "expected v/g shape (1, 4, 1, 128)"),
    ("beta-shape", lambda kw: _break(kw, "beta", kw["beta"][:, :3]), "expected beta shape (1, 4, 1)"),
    ("tokens-per-request", lambda kw: _break(kw, "cu_seqlens", torch.tensor([0, 1, 2, 4], dtype=torch.int32)),
     "DSpARK KDA MTP requires a fixed 1 + num_spec dense tokens per request; got T=4, N=3"),
    ("state-layout", lambda kw: _break(kw, "recurrent_state", torch.zeros(4, 1, 64, 128)),
     "expected recurrent state layout [pool, H, V=128, K=128]"),
    ("state-dtype", lambda kw: _break(kw, "recurrent_state", torch.zeros(4, 1, 128, 128, dtype=BF)),
     "cp.async recurrent state requires fp32 contiguous [H, V, K] inner layout and 16-byte-aligned slot offsets"),
    ("partial-rings", lambda kw: _break(kw, "replayssm_rawv", torch.zeros(4, 1, 2, 128, dtype=BF)),
     "ReplaySSM requires all four replayssm_* rings"),
    ("ring-layout", lambda kw: dict(kw, replayssm_rawv=torch.zeros(4, 1, 1, 128, dtype=BF),
                                    replayssm_rawk=torch.zeros(4, 1, 1, 128, dtype=BF),
                                    replayssm_g=torch.zeros(4, 1, 1, 128), replayssm_beta=torch.zeros(4, 1, 1)),
     "expected ReplaySSM ring layouts [slots, H=1, L>=2, 128] / [slots, H, L]"),
    ("ring-dtype", lambda kw: dict(kw, replayssm_rawv=torch.zeros(4, 1, 2, 128),
                                   replayssm_rawk=torch.zeros(4, 1, 2, 128, dtype=BF),
                                   replayssm_g=torch.zeros(4, 1, 2, 128), replayssm_beta=torch.zeros(4, 1, 2)),
     "expected ReplaySSM ring dtypes rawv/rawk=bf16, g/beta=fp32"),
    ("snapshot-layout", lambda kw: _break(kw, "intermediate_ssm", torch.zeros(3, 1, 1, 128, 128)),
     "expected intermediate SSM layout [scratch, >=2, H, V=128, K=128]"),
    ("onorm-partial", lambda kw: _break(kw, "onorm_eps", None),
     "fused output norm requires onorm_gate, onorm_weight, and onorm_eps"),
    ("onorm-gate-shape", lambda kw: _break(kw, "onorm_gate", kw["onorm_gate"][:, :3]),
     "expected output-norm gate shape (1, 4, 1, 128)"),
    ("onorm-weight-shape", lambda kw: _break(kw, "onorm_weight", torch.ones(64)),
     "expected output-norm weight shape (128,)"),
    ("onorm-dtype", lambda kw: _break(kw, "onorm_weight", torch.ones(128, dtype=BF)),
     "expected output-norm gate=bf16 and weight=fp32"),
]


@pytest.mark.parametrize("breaker,message", [pytest.param(b, m, id=i) for i, b, m in DSPARK_ERRORS])
def test_dspark_error_contract_exact_and_nothing_written(breaker, message):
    kw = breaker(dspark_inputs(51, onorm=True))
    watched = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError) as info:
        sglang.fused_kda_decode_mtp_dspark(**kw)
    assert str(info.value) == message
    for key, before in watched.items():
        assert torch.equal(kw[key], before), f"{key} must be untouched after an error"


def test_dspark_errors_come_in_sglang_order():
    kw = dspark_inputs(52, onorm=True)
    kw = _break(_break(kw, "beta", kw["beta"][:, :3]), "x_v", kw["x_v"][:, :3])  # v/g before beta
    with pytest.raises(ValueError, match=r"^expected v/g shape"):
        sglang.fused_kda_decode_mtp_dspark(**kw)
    kw = _break(dspark_inputs(53), "recurrent_state", torch.zeros(4, 1, 64, 128))
    kw = _break(kw, "intermediate_ssm", torch.zeros(3, 1, 1, 128, 128))  # state before snapshot layout
    with pytest.raises(ValueError, match=r"^expected recurrent state layout"):
        sglang.fused_kda_decode_mtp_dspark(**kw)


def test_native_verify_rejects_bad_layouts_before_writing():
    p, d = make_problem(61)
    bufs = fresh_buffers(d, mode="snapshot")
    watched = [bufs["snapshots"].clone(), *(c.clone() for c in bufs["intermediate_conv"])]
    with pytest.raises(ValueError, match="snapshots"):
        kdakit.mtp_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                          p["slot_indices"], p["scratch_indices"], conv_weights=p["conv_weights"],
                          conv_states=p["conv_states"], intermediate_conv=bufs["intermediate_conv"],
                          snapshots=bufs["snapshots"][:, :2])
    with pytest.raises(ValueError, match="`a` must have shape"):
        kdakit.mtp_verify(p["q"], p["k"], p["v"], p["a"][:, :, :1], p["b"], p["A_log"], p["dt_bias"], p["state"],
                          p["slot_indices"], p["scratch_indices"], snapshots=bufs["snapshots"])
    assert torch.equal(bufs["snapshots"], watched[0])
    for got, before in zip(bufs["intermediate_conv"], watched[1:]):
        assert torch.equal(got, before)


@pytest.mark.parametrize("mode", ["snapshot", "ring"])
def test_step_loop_equals_unrolled_steps_bitwise(mode, monkeypatch):
    """``VerifyConfig.unroll_steps=False`` (a loop over the steps, picked for long chains) gives
    the unrolled kernel's bits (the ring mode's recurrent form: the recurrence writes the rings)."""
    from kdakit.ops import mtp_verify as module
    pinned = module.mtp_verify_config
    p, d = make_problem(13, T=5, K=16, V=16, norm=True)
    got = {}
    for unroll in (True, False):
        monkeypatch.setattr(module, "mtp_verify_config", lambda *a, **kw: dataclasses.replace(
            pinned(*a, **kw), unroll_steps=unroll, ring_form="recurrent"))
        bufs = fresh_buffers(d, mode=mode)
        out = call_verify(p, bufs, conv=True, lower_bound=-3.0, backend="triton")
        got[unroll] = [out, *bufs["intermediate_conv"], *(bufs["rings"] if mode == "ring" else [bufs["snapshots"]])]
    for x, y in zip(got[True], got[False]):
        assert torch.equal(x, y)


def test_long_chains_loop_over_their_steps():
    from kdakit.ops.mtp_verify import UNROLL_STEPS_MAX, mtp_verify_config
    assert UNROLL_STEPS_MAX == 8
    assert mtp_verify_config(64, 8, 32, 128, 128, None).unroll_steps
    assert not mtp_verify_config(64, 9, 32, 128, 128, None).unroll_steps


def packed_views(p, d, *, gate_pad=8):
    """The problem's q, k, v as splits of one packed ``[N*T, q|k|v]`` projection (sglang's layout
    after its conv: one token stride for all three), ``a`` a slice of a wider projection and ``b``
    a row-strided view: the same values, no tensor contiguous."""
    N, T, H, HV, K, V = (d[n] for n in ("N", "T", "H", "HV", "K", "V"))
    packed = torch.cat([p["q"].reshape(N * T, -1), p["k"].reshape(N * T, -1), p["v"].reshape(N * T, -1)], dim=1)
    q, k, v = packed.split([H * K, H * K, HV * V], dim=1)
    wide_a = torch.cat([p["a"].reshape(N * T, -1), torch.full((N * T, gate_pad), 7.0, dtype=p["a"].dtype)], dim=1)
    wide_b = torch.cat([p["b"].reshape(N * T, -1), torch.full((N * T, 3), 7.0, dtype=p["b"].dtype)], dim=1)
    views = dict(q=q.reshape(N, T, H, K), k=k.reshape(N, T, H, K), v=v.reshape(N, T, HV, V),
                 a=wide_a[:, :HV * K].reshape(N, T, HV, K), b=wide_b[:, :HV].reshape(N, T, HV))
    assert not any(t.is_contiguous() for t in views.values())
    for name, t in views.items():
        assert torch.equal(t, p[name])
    return views


@pytest.mark.parametrize("mode,conv", [("snapshot", False), ("ring-recurrent", False), ("ring-chunked", False),
                                       ("snapshot", True)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_on_token_strided_views_equals_dense_inputs_bitwise(mode, conv, backend, use_ring_form):
    """q, k, v, a, b as views of packed projections (one stride between tokens): the recurrence
    reads them in place, the conv prologue and the ring chunk form from dense copies; outputs,
    snapshots or rings, and windows are the bits of the same call on contiguous inputs."""
    if mode.startswith("ring"):
        use_ring_form(mode.split("-")[1])
    p, d = make_problem(71, N=3, T=4, conv=conv)
    strided = {**p, **packed_views(p, d)}
    got = {}
    for name, inputs in (("dense", p), ("strided", strided)):
        bufs = fresh_buffers(d, mode="ring" if mode.startswith("ring") else "snapshot")
        out = call_verify(inputs, bufs, conv=conv, lower_bound=-3.0, backend=backend)
        got[name] = [out, *bufs.get("rings", ()), *([bufs["snapshots"]] if "snapshots" in bufs else []),
                     *(bufs["intermediate_conv"] if conv else ())]
    for x, y in zip(got["dense"], got["strided"]):
        assert torch.equal(x, y)


def test_verify_refuses_tokens_not_one_stride_apart():
    """A view whose requests are not T tokens apart (here: every other request of a batch) is
    refused before anything runs; a tree verify still takes contiguous inputs only."""
    p, d = make_problem(72, N=3, T=3, conv=False)
    bufs = fresh_buffers(d, mode="snapshot")
    before = bufs["snapshots"].clone()
    gapped = torch.cat([p["q"], p["q"]], dim=1)[:, :3]          # request stride 2T tokens
    assert gapped.stride(0) != 3 * gapped.stride(1)
    with pytest.raises(ValueError, match="`q` must hold its N\\*T tokens one stride apart"):
        kdakit.mtp_verify(gapped, p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                          p["slot_indices"], p["scratch_indices"], snapshots=bufs["snapshots"])
    heads_apart = torch.cat([p["v"], p["v"]], dim=3)[..., :d["V"]]  # heads not dense
    with pytest.raises(ValueError, match="`v` must hold its N\\*T tokens one stride apart"):
        kdakit.mtp_verify(p["q"], p["k"], heads_apart, p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                          p["slot_indices"], p["scratch_indices"], snapshots=bufs["snapshots"])
    assert torch.equal(bufs["snapshots"], before)
    views = packed_views(p, d)
    parents = torch.tensor([[-1, 0, 1]] * 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="`q` must be contiguous"):
        kdakit.tree_verify(views["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                           p["slot_indices"], p["scratch_indices"], parents, snapshots=bufs["snapshots"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_chain_target_verify_runs_the_chain_kernel_on_its_views(backend, monkeypatch):
    """sglang's chain target verify (``retrieve_parent_token=None``) through the drop-in: the
    chain op on sglang's packed views (no copy of q, k, v, a, b), equal to ``kdakit.mtp_verify``
    on dense inputs bitwise, and to the tree op with chain parents within rounding."""
    from kdakit.compat import sglang_tree
    from kdakit.ops import mtp_verify as mtp_module
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    p, d = make_problem(73, N=3, T=4, conv=False)
    N, T, H, HV, K, V = (d[n] for n in ("N", "T", "H", "HV", "K", "V"))
    views = packed_views(p, d)
    seen = []
    real = mtp_module.mtp_verify
    monkeypatch.setattr(sglang_tree, "mtp_verify", lambda *a, **kw: seen.append(a[:5]) or real(*a, **kw))
    snaps = torch.full((d["scratch"], T, HV, V, K), 7.0)
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    o = sglang_tree.fused_sigmoid_gating_delta_rule_update(
        p["A_log"], views["a"].reshape(N * T, HV * K), p["dt_bias"], 1.0, 20.0, views["q"].reshape(1, N * T, H, K),
        views["k"].reshape(1, N * T, H, K), views["v"].reshape(1, N * T, HV, V), views["b"].reshape(1, N * T, HV),
        p["state"], p["slot_indices"], use_qk_l2norm_in_kernel=True, cu_seqlens=cu, is_kda=True, lower_bound=-3.0,
        disable_state_update=True, intermediate_states_buffer=snaps, intermediate_state_indices=p["scratch_indices"],
        cache_steps=T, retrieve_parent_token=None)
    assert len(seen) == 1 and not any(t.is_contiguous() for t in seen[0])  # the views reached the op as they were
    want_snaps = torch.full_like(snaps, 7.0)
    want = kdakit.mtp_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                             p["slot_indices"], p["scratch_indices"], snapshots=want_snaps, lower_bound=-3.0)
    assert torch.equal(o.view(N, T, HV, V), want) and torch.equal(snaps, want_snaps)
    tree_snaps = torch.full_like(snaps, 7.0)
    tree = kdakit.tree_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                              p["slot_indices"], p["scratch_indices"], torch.arange(-1, T - 1).expand(N, T).contiguous(),
                              snapshots=tree_snaps, lower_bound=-3.0)
    assert_close(o.view(N, T, HV, V).float(), tree.float(), 2e-2)
