"""Tree verify (snapshot mode): the Triton kernels and the reference against the float64
reference; a chain-shaped tree equals the chain verify bitwise; padding rows, poisoned
buffers, invalid parents and the error contract; commit of an accepted node; and rounds of
tree speculation whose committed states, windows and outputs equal plain one-token decoding
of the accepted paths."""
import dataclasses

import pytest
import torch

import kdakit
from kdakit import reference

from helpers import assert_close, sweep

BACKENDS = ["reference", "triton"]
F64 = torch.float64
W = 4
POISON = 7.0


def random_tree(T, gen, *, width=3, depth=4):
    """Parents [T] of a random tree: node 0 the root, each node at most `width` children,
    at most `depth` levels below the root; parents[0] = -1."""
    parents, depths, children = [-1], [0], [0]
    for _ in range(1, T):
        open_nodes = [i for i in range(len(parents)) if depths[i] < depth and children[i] < width]
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        parents.append(p)
        depths.append(depths[p] + 1)
        children.append(0)
        children[p] += 1
    return parents


def path_to(parents, node):
    path = [node]
    while parents[path[-1]] >= 0 and path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def make_problem(seed, *, N=3, T=5, H=1, HV=2, K=16, V=24, slots=6, scratch=5, act=torch.float32, conv=True,
                 norm=False, parents=None):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(act)
    p = dict(q=rnd(N, T, H, K), k=rnd(N, T, H, K), v=rnd(N, T, HV, V), a=rnd(N, T, HV, K), b=rnd(N, T, HV),
             A_log=torch.rand(HV, generator=g), dt_bias=torch.randn(HV * K, generator=g) * 0.5,
             state=torch.randn(slots, HV, V, K, generator=g) * 0.5)
    p["slot_indices"] = torch.randperm(slots, generator=g)[:N].to(torch.int32)
    p["scratch_indices"] = torch.randperm(scratch, generator=g)[:N].to(torch.int32)
    if parents is None:
        parents = [random_tree(T, g) for _ in range(N)]
    p["parents"] = torch.tensor(parents, dtype=torch.int32)
    channels = (H * K, H * K, HV * V)
    if conv:
        p["conv_weights"] = tuple(torch.randn(c, W, generator=g) * 0.5 for c in channels)
        p["conv_states"] = tuple(rnd(slots, c, W - 1) for c in channels)
    if norm:
        p["norm_gate"] = rnd(N, T, HV, V)
        p["norm_weight"] = torch.rand(V, generator=g) + 0.5
    dims = dict(N=N, T=T, H=H, HV=HV, K=K, V=V, slots=slots, scratch=scratch, act=act, channels=channels)
    return p, dims


def fresh_buffers(d, *, snap_dtype=torch.float32):
    """Scratch buffers one node longer than needed, poisoned, so stray writes show."""
    T = d["T"]
    return {"snapshots": torch.full((d["scratch"], T + 1, d["HV"], d["V"], d["K"]), POISON, dtype=snap_dtype),
            "intermediate_conv": tuple(torch.full((d["scratch"], T + 1, c, W - 1), POISON, dtype=d["act"])
                                       for c in d["channels"])}


def call_tree(p, bufs, *, conv, lower_bound, backend=None, f64=False, **extra):
    kw = dict(snapshots=bufs["snapshots"], lower_bound=lower_bound, norm_gate=p.get("norm_gate"),
              norm_weight=p.get("norm_weight"))
    if conv:
        kw.update(conv_weights=p["conv_weights"], conv_states=p["conv_states"],
                  intermediate_conv=bufs["intermediate_conv"])
    args = [p[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "slot_indices", "scratch_indices",
                           "parents")]
    if f64:
        if conv:
            kw["conv_weights"] = tuple(w.double() for w in p["conv_weights"])
        if kw["norm_weight"] is not None:
            kw["norm_weight"] = kw["norm_weight"].double()
        args[5:8] = [x.double() for x in args[5:8]]
        out = torch.empty(p["v"].shape, dtype=F64)
        return reference.tree_verify(*args, out, compute_dtype=F64, **kw)
    out = torch.full(p["v"].shape, POISON, dtype=p["v"].dtype)
    return kdakit.tree_verify(*args, out, backend=backend, **kw, **extra)


CASES = [  # (conv, norm, lower_bound, act, HV, K, V, T)
    pytest.param(True, False, -5.0, torch.float32, 2, 16, 24, 5, id="conv-safegate-f32-HV2-K16-V24"),
    pytest.param(True, True, None, torch.bfloat16, 1, 16, 16, 6, id="conv-norm-defaultgate-bf16-HV1"),
    pytest.param(False, True, -2.0, torch.float32, 2, 24, 16, 4, id="noconv-norm-f32-K24-V16"),
    pytest.param(False, False, None, torch.float32, 1, 16, 32, 6, id="noconv-f32-K16-V32"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("conv,norm,lower_bound,act,HV,K,V,T", sweep(CASES, keep=2))
def test_tree_verify_matches_float64_reference(backend, conv, norm, lower_bound, act, HV, K, V, T):
    p, d = make_problem(11, act=act, conv=conv, norm=norm, HV=HV, K=K, V=V, T=T)
    p["slot_indices"][1] = -1  # a padding row
    state_before = p["state"].clone()
    conv_before = [c.clone() for c in p.get("conv_states", ())]
    ref_bufs, bufs = fresh_buffers(d, snap_dtype=F64), fresh_buffers(d)
    ref_out = call_tree(p, ref_bufs, conv=conv, lower_bound=lower_bound, f64=True)
    out = call_tree(p, bufs, conv=conv, lower_bound=lower_bound, backend=backend)
    tol = 1e-5 if act == torch.float32 else 2e-2
    assert_close(out, ref_out, tol, "out")
    assert torch.equal(out[1], torch.zeros_like(out[1])), "padding row output must be zero"
    assert torch.equal(p["state"], state_before), "the persistent state pool is read-only"
    for c, before in zip(p.get("conv_states", ()), conv_before):
        assert torch.equal(c, before), "the persistent conv pools are read-only"
    rows = p["scratch_indices"][[0, 2]].long()
    assert_close(bufs["snapshots"][rows, :T], ref_bufs["snapshots"][rows, :T], tol, "snapshots")
    untouched = torch.ones(d["scratch"], dtype=torch.bool)
    untouched[rows] = False
    assert (bufs["snapshots"][untouched] == POISON).all(), "scratch rows of padding/unused requests untouched"
    assert (bufs["snapshots"][:, T] == POISON).all(), "no node past T is written"
    if conv:
        for got, want in zip(bufs["intermediate_conv"], ref_bufs["intermediate_conv"]):
            assert torch.equal(got[rows, :T], want[rows, :T]), "conv windows after each node"
            assert (got[untouched] == POISON).all() and (got[:, T] == POISON).all()


@pytest.mark.parametrize("conv,norm", [(True, True), (False, False)], ids=["conv-norm", "noconv"])
def test_chain_shaped_tree_equals_chain_verify_bitwise(conv, norm):
    """parents = [-1, 0, 1, ..., T-2]: outputs, snapshots and windows bit for bit those of
    mtp_verify's snapshot mode (the same tile, loader and device functions)."""
    T = 5
    p, d = make_problem(23, act=torch.bfloat16, conv=conv, norm=norm, T=T, K=16, V=16,
                        parents=[[-1] + list(range(T - 1))] * 3)
    p["slot_indices"][2] = -1
    tree_bufs, chain_bufs = fresh_buffers(d), fresh_buffers(d)
    tree_out = call_tree(p, tree_bufs, conv=conv, lower_bound=-3.0, backend="triton")
    kw = dict(conv_weights=p["conv_weights"], conv_states=p["conv_states"],
              intermediate_conv=chain_bufs["intermediate_conv"]) if conv else {}
    chain_out = kdakit.mtp_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"],
                                  p["slot_indices"], p["scratch_indices"], snapshots=chain_bufs["snapshots"],
                                  lower_bound=-3.0, norm_gate=p.get("norm_gate"), norm_weight=p.get("norm_weight"),
                                  backend="triton", **kw)
    assert torch.equal(tree_out, chain_out)
    assert torch.equal(tree_bufs["snapshots"], chain_bufs["snapshots"])
    if conv:
        for got, want in zip(tree_bufs["intermediate_conv"], chain_bufs["intermediate_conv"]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_indices_outside_their_buffers_are_padding_rows(backend):
    """A slot >= the pool's slots, a scratch row >= the scratch rows (or < 0): zero output,
    no write anywhere, nothing else changes; the live request is unaffected."""
    p, d = make_problem(31, N=4, T=4, slots=4, scratch=4)
    p["slot_indices"] = torch.tensor([0, 4, 2, 3], dtype=torch.int32)
    p["scratch_indices"] = torch.tensor([1, 0, 9, -2], dtype=torch.int32)
    bufs = fresh_buffers(d)
    out = call_tree(p, bufs, conv=True, lower_bound=None, backend=backend)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    assert torch.isfinite(out[0]).all() and out[0].abs().sum() > 0
    assert (bufs["snapshots"][[0, 2, 3]] == POISON).all() and (bufs["snapshots"][1, d["T"]] == POISON).all()
    for ic in bufs["intermediate_conv"]:
        assert (ic[[0, 2, 3]] == POISON).all()
    alone = {key: (val[:1] if key in ("q", "k", "v", "a", "b", "slot_indices", "scratch_indices", "parents")
                   else val) for key, val in p.items()}
    alone_bufs = fresh_buffers(d)
    assert torch.equal(call_tree(alone, alone_bufs, conv=True, lower_bound=None, backend=backend)[0], out[0])
    assert torch.equal(alone_bufs["snapshots"], bufs["snapshots"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_parents_start_from_the_committed_state(backend):
    """p >= t or p < -1 is treated as p = -1 by default (bitwise the same call with -1 there);
    full-check mode raises a ValueError naming `parents`; node 0's entry is ignored."""
    T = 5
    bad = [[3, 0, 5, 1, -7], [0, 0, 1, 3, 2], [-1, 0, 2, 9, 1]]
    fixed = [[-1, 0, -1, 1, -1], [-1, 0, 1, -1, 2], [-1, 0, -1, -1, 1]]
    p, d = make_problem(37, T=T, parents=bad)
    bufs_bad, bufs_fixed = fresh_buffers(d), fresh_buffers(d)
    out_bad = call_tree(p, bufs_bad, conv=True, lower_bound=-1.0, backend=backend)
    p_fixed = dict(p, parents=torch.tensor(fixed, dtype=torch.int64))
    out_fixed = call_tree(p_fixed, bufs_fixed, conv=True, lower_bound=-1.0, backend=backend)
    assert torch.equal(out_bad, out_fixed)
    assert torch.equal(bufs_bad["snapshots"], bufs_fixed["snapshots"])
    for x, y in zip(bufs_bad["intermediate_conv"], bufs_fixed["intermediate_conv"]):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="`parents` holds an invalid parent 5 for node 2 of request 0"):
        call_tree(p, fresh_buffers(d), conv=True, lower_bound=-1.0, backend=backend, full_checks=True)
    call_tree(p_fixed, fresh_buffers(d), conv=True, lower_bound=-1.0, backend=backend, full_checks=True)


def test_error_contract():
    p, d = make_problem(41, T=3)
    bufs = fresh_buffers(d)
    with pytest.raises(ValueError, match=r"`parents` must be a contiguous \[N, T\]"):
        call_tree(dict(p, parents=p["parents"][:, :2]), bufs, conv=True, lower_bound=None)
    with pytest.raises(ValueError, match=r"`parents` must be a contiguous \[N, T\]"):
        call_tree(dict(p, parents=p["parents"].t().contiguous().t()), bufs, conv=True, lower_bound=None)
    with pytest.raises(ValueError, match="`parents` must be an int32 or int64 tensor"):
        call_tree(dict(p, parents=p["parents"].float()), bufs, conv=True, lower_bound=None)
    with pytest.raises(ValueError, match="a tree verify needs `snapshots`"):
        call_tree(p, dict(bufs, snapshots=None), conv=True, lower_bound=None)
    with pytest.raises(ValueError, match="`snapshots` must be"):
        call_tree(p, dict(bufs, snapshots=bufs["snapshots"][:, :2]), conv=True, lower_bound=None)
    assert (bufs["snapshots"] == POISON).all(), "nothing written before a failed check"


@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_snapshots_of_an_accepted_node(backend):
    """commit_snapshots serves trees unchanged: the accepted node id is the step; the slot gets
    that node's snapshot and windows bit for bit, -1 commits nothing."""
    p, d = make_problem(43, T=5)
    bufs = fresh_buffers(d)
    call_tree(p, bufs, conv=True, lower_bound=None, backend="triton")
    accepted = torch.tensor([3, -1, 4], dtype=torch.int32)
    state, pools = p["state"].clone(), tuple(c.clone() for c in p["conv_states"])
    kdakit.commit_snapshots(state, bufs["snapshots"], p["slot_indices"], p["scratch_indices"], accepted,
                            conv_states=pools, intermediate_conv=bufs["intermediate_conv"], backend=backend)
    for n in range(3):
        slot, row, a = int(p["slot_indices"][n]), int(p["scratch_indices"][n]), int(accepted[n])
        want = bufs["snapshots"][row, a] if a >= 0 else p["state"][slot]
        assert torch.equal(state[slot], want)
        for pool, ic, before in zip(pools, bufs["intermediate_conv"], p["conv_states"]):
            assert torch.equal(pool[slot], ic[row, a] if a >= 0 else before[slot])
    others = [s for s in range(d["slots"]) if s not in p["slot_indices"].tolist()]
    assert torch.equal(state[others], p["state"][others])


def plain_decode(p, n, nodes, state, conv_pool, slot, lower_bound):
    """Request n's nodes one token at a time through the plain decode path (reference
    conv update + packed decode); returns the outputs [len(nodes), HV, V]."""
    outs = []
    one = torch.tensor([slot], dtype=torch.int32)
    for t in nodes:
        x = torch.cat([p["q"][n, t].flatten(), p["k"][n, t].flatten(), p["v"][n, t].flatten()])[None]
        mixed = torch.empty_like(x)
        reference.causal_conv1d_update(x, conv_pool, torch.cat(p["conv_weights"]), one, mixed)
        out = torch.empty(1, 1, *p["v"].shape[2:], dtype=x.dtype)
        kdakit.packed_decode(mixed, p["a"][n, t].flatten()[None], p["b"][n, t][None], p["A_log"], p["dt_bias"], state,
                             one, out, lower_bound=lower_bound, backend="reference")
        outs.append(out[0, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_speculation_loop_equals_plain_decode(backend):
    """Rounds of tree verify (random trees: width <= 3, depth <= 4) and commit_snapshots of a
    randomly accepted node: the committed states, windows and the outputs along each accepted
    path equal plain one-token decoding of that path."""
    gen = torch.Generator().manual_seed(5)
    T, lower_bound = 6, -4.0
    p, d = make_problem(51, N=3, T=T, K=16, V=16)
    p["slot_indices"][1] = -1  # a padding row rides along
    state, conv_states = p["state"].clone(), tuple(c.clone() for c in p["conv_states"])
    plain_state, plain_conv = p["state"].clone(), torch.cat([c.clone() for c in p["conv_states"]], dim=1)
    for _ in range(3):
        p2, _ = make_problem(int(torch.randint(1000, (1,), generator=gen)), N=3, T=T, K=16, V=16)
        for key in ("q", "k", "v", "a", "b"):
            p[key] = p2[key]
        trees = [random_tree(T, gen) for _ in range(d["N"])]
        p["parents"] = torch.tensor(trees, dtype=torch.int32)
        bufs = fresh_buffers(d)
        out = kdakit.tree_verify(p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], state,
                                 p["slot_indices"], p["scratch_indices"], p["parents"], conv_weights=p["conv_weights"],
                                 conv_states=conv_states, intermediate_conv=bufs["intermediate_conv"],
                                 snapshots=bufs["snapshots"], lower_bound=lower_bound, backend=backend)
        accepted = torch.randint(T, (d["N"],), generator=gen).to(torch.int32)
        kdakit.commit_snapshots(state, bufs["snapshots"], p["slot_indices"], p["scratch_indices"], accepted,
                                conv_states=conv_states, intermediate_conv=bufs["intermediate_conv"], backend=backend)
        for n in range(d["N"]):
            slot = int(p["slot_indices"][n])
            if slot < 0:
                assert torch.equal(out[n], torch.zeros_like(out[n]))
                continue
            path = path_to(trees[n], int(accepted[n]))
            plain = plain_decode(p, n, path, plain_state, plain_conv, slot, lower_bound)
            assert_close(out[n, path], plain, 1e-5, f"outputs along the accepted path {path}")
        live = p["slot_indices"][p["slot_indices"] >= 0].long()
        assert_close(state[live], plain_state[live], 1e-5, "committed states vs plain decode")
        assert torch.equal(torch.cat(conv_states, dim=1)[live], plain_conv[live]), "committed conv windows"
    others = [s for s in range(d["slots"]) if s not in p["slot_indices"].tolist()]
    assert torch.equal(state[others], p["state"][others]), "slots of no request untouched"


def test_custom_op_schema_fake_and_traced_branch():
    """torch.ops.kdakit.tree_verify: declared mutations and the no-op fake (opcheck), and the
    public entry's traced branch (a subclass tensor routes through the custom op) equals eager."""
    from kdakit.ops.mtp_verify import mtp_verify_tensors
    p, d = make_problem(61, T=4, norm=True)
    bufs = fresh_buffers(d)
    out = torch.empty(p["v"].shape, dtype=p["v"].dtype)
    flat = mtp_verify_tensors(p["conv_weights"], p["conv_states"], bufs["intermediate_conv"], None, bufs["snapshots"],
                              None)
    args = (p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["state"], p["slot_indices"],
            p["scratch_indices"], p["parents"], out, *flat, 16 ** -0.5, -2.0, p["norm_gate"], p["norm_weight"], 1e-6,
            "reference")
    torch.library.opcheck(torch.ops.kdakit.tree_verify.default, args, test_utils=("test_schema", "test_faketensor"))
    eager = call_tree(p, fresh_buffers(d), conv=True, lower_bound=-2.0, backend="reference")
    traced_bufs = fresh_buffers(d)
    sub = dict(p)

    class Marked(torch.Tensor):
        pass
    sub["q"] = p["q"].as_subclass(Marked)
    traced = call_tree(sub, traced_bufs, conv=True, lower_bound=-2.0, backend="reference")
    assert torch.equal(traced.as_subclass(torch.Tensor), eager)


def ring_buffers(d, L=None):
    L = L or d["T"] + 1
    return (torch.full((d["slots"], d["H"], L, d["K"]), POISON, dtype=d["act"]),
            torch.full((d["slots"], d["HV"], L, d["V"]), POISON, dtype=d["act"]),
            torch.full((d["slots"], d["HV"], L, d["K"]), POISON),
            torch.full((d["slots"], d["HV"], L), POISON))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("conv,HV,act", [(True, 2, torch.bfloat16), (False, 1, torch.float32)],
                         ids=["conv-HV2-bf16", "noconv-HV1-f32"])
def test_ring_mode_equals_snapshot_mode_and_ring_commit_is_bitwise(backend, conv, HV, act):
    """Ring-mode tree verify: the same outputs and windows as snapshot mode (bitwise on the
    Triton path: a node off the previous one refolds its parent's path from the inputs), the
    ring entries at the node positions, nothing else written; commit_tree_ring of every
    root-to-node path equals that node's snapshot bit for bit."""
    T = 6
    p, d = make_problem(71, T=T, HV=HV, act=act, conv=conv, K=16, V=16)
    p["slot_indices"][1] = -1
    snap_bufs, ring_bufs = fresh_buffers(d), fresh_buffers(d)
    rings = ring_buffers(d)
    snap_out = call_tree(p, snap_bufs, conv=conv, lower_bound=-2.0, backend=backend)
    ring_out = call_tree(p, dict(ring_bufs, snapshots=None), conv=conv, lower_bound=-2.0, backend=backend,
                         rings=rings)
    if backend == "triton":
        assert torch.equal(ring_out, snap_out)
    else:
        assert_close(ring_out, snap_out, 1e-6, "ring vs snapshot outputs")
    if conv:
        for x, y in zip(ring_bufs["intermediate_conv"], snap_bufs["intermediate_conv"]):
            assert torch.equal(x, y)
    assert (ring_bufs["snapshots"] == POISON).all(), "ring mode writes no snapshot"
    live = p["slot_indices"] >= 0
    others = torch.ones(d["slots"], dtype=torch.bool)
    others[p["slot_indices"][live].long()] = False
    for r in rings:
        assert (r[others] == POISON).all() and (r[:, :, T] == POISON).all(), "only the live slots' T positions"
    # every node's path, folded from the rings, equals the node's snapshot
    trees = p["parents"].tolist()
    for node in range(T):
        paths = torch.full((d["N"], T), -1, dtype=torch.int32)
        lens = torch.zeros(d["N"], dtype=torch.int32)
        for n in range(d["N"]):
            path = path_to(trees[n], node)
            paths[n, :len(path)] = torch.tensor(path)
            lens[n] = len(path)
        state = p["state"].clone()
        kdakit.commit_tree_ring(state, *rings, p["slot_indices"], paths, lens, backend=backend)
        for n in torch.nonzero(live).flatten().tolist():
            slot, row = int(p["slot_indices"][n]), int(p["scratch_indices"][n])
            want = snap_bufs["snapshots"][row, node]
            if backend == "triton":
                assert torch.equal(state[slot], want), f"request {n} node {node}"
            else:
                assert_close(state[slot], want, 1e-6, f"request {n} node {node}")
        assert torch.equal(state[others], p["state"][others])


@pytest.mark.parametrize("lower_bound,steep,dot_spread_max", sweep([
    pytest.param(-5.0, False, 60.0, id="safegate-factored-dots"),
    pytest.param(None, False, 60.0, id="defaultgate-mild-dots"),
    pytest.param(None, True, 60.0, id="defaultgate-steep-by-column"),
], keep=2))
def test_ring_chunk_form_pair_dots_on_trees(lower_bound, steep, dot_spread_max, monkeypatch):
    """``RingVerifyConfig.pair_dots`` on 12-node trees (16-row tiles; the path sums of the
    log-decays as one product of the path matrix): outputs against float64 and against the
    column-at-a-time steps, ring entries bit for bit, padding rows zero and an invalid parent
    the committed state, both ways."""
    from kdakit.ops import tree_verify as tree_verify_module
    pinned = tree_verify_module.tree_verify_config
    T = 12
    p, d = make_problem(89, N=4, T=T, HV=2, act=torch.float32, conv=False, K=16, V=24, slots=7, scratch=6)
    p["slot_indices"][1] = -1
    for name in ("q", "k", "v", "a", "b"):  # a free row's tokens may be anything
        p[name][1] = float("nan")
    p["parents"][2, T - 1] = T + 3
    if steep:
        p["A_log"] = torch.full_like(p["A_log"], 4.0)
        p["a"] = p["a"] * 4
    ref_out = call_tree(p, fresh_buffers(d, snap_dtype=F64), conv=False, lower_bound=lower_bound, f64=True)
    results = {}
    for dots in (False, True):
        def config(*args, **kw):
            c = pinned(*args, **kw)
            return dataclasses.replace(c, ring_form="chunked", ring=dataclasses.replace(
                c.ring, pair_dots=dots, steps_warps=4 if dots else c.ring.steps_warps, dot_spread_max=dot_spread_max))
        monkeypatch.setattr(tree_verify_module, "tree_verify_config", config)
        bufs, rings = fresh_buffers(d), ring_buffers(d)
        out = call_tree(p, dict(bufs, snapshots=None), conv=False, lower_bound=lower_bound, backend="triton",
                        rings=rings)
        results[dots] = out, rings
    (out, rings), (col_out, col_rings) = results[True], results[False]
    live = p["slot_indices"] >= 0
    assert torch.isfinite(out).all()
    assert_close(out[live], ref_out[live], 1e-5, "pair dots vs float64")
    assert_close(out, col_out, 1e-5, "pair dots vs the column-at-a-time steps")
    assert torch.equal(out[~live], torch.zeros_like(out[~live])), "padding rows' outputs are zero"
    for x, y in zip(rings, col_rings):
        assert torch.equal(x, y), "ring entries: the same bits either way"


TREE_CHUNK_CASES = [  # (conv, norm, lower_bound, act, HV, T, factored): the chunk form's pair sums both ways
    pytest.param(True, False, -2.0, torch.bfloat16, 2, 6, True, id="conv-safegate-factored-bf16-HV2-T6"),
    pytest.param(False, True, None, torch.float32, 1, 8, False, id="noconv-norm-defaultgate-f32-T8"),
    pytest.param(True, True, -5.0, torch.float32, 2, 5, False, id="conv-norm-safegate-pairwise-f32-T5"),
]


@pytest.mark.parametrize("from_inputs", [False, True], ids=["state-after-steps", "state-from-inputs"])
@pytest.mark.parametrize("conv,norm,lower_bound,act,HV,T,factored", sweep(TREE_CHUNK_CASES, keep=2))
def test_ring_chunk_form_matches_reference_and_ring_commit_is_bitwise(conv, norm, lower_bound, act, HV, T, factored,
                                                                       from_inputs, monkeypatch):
    """Ring mode's chunk form (``mtp_verify.ring_form``: beyond a few requests; forced here):
    outputs against the float64 reference and the recurrence; ring entries, windows and error
    counts bit for bit the recurrence's; commit_tree_ring of every node's path equals the
    snapshot-mode snapshot bit for bit; padding rows (a free slot, a slot and a scratch row
    past their buffers) zero and unwritten; an invalid parent is the committed state. Both
    orders of the state kernel (``RingVerifyConfig.state_from_inputs``)."""
    from kdakit.ops import ring_verify, tree_verify as tree_verify_module
    pinned = tree_verify_module.tree_verify_config

    def pick(form):
        """The pinned config with ring mode's form forced, the pair sums factored only where asked and the rule allows."""
        def config(*args, **kw):
            config = pinned(*args, **kw)
            return dataclasses.replace(config, ring_form=form,
                                       ring=dataclasses.replace(config.ring, factored=factored and config.ring.factored,
                                                                state_from_inputs=from_inputs))
        return config
    assert (factored and ring_verify.factored_pair_sums(T, lower_bound)) == factored
    p, d = make_problem(83, N=5, T=T, HV=HV, act=act, conv=conv, norm=norm, K=16, V=24, slots=7, scratch=6)
    p["slot_indices"][1] = -1
    for name in ("q", "k", "v", "a", "b"):        # a free row's tokens may be anything
        p[name][1] = float("nan")
    p["slot_indices"][3] = 7                      # past the pool
    if conv:
        p["scratch_indices"][4] = 6               # past the scratch rows
    p["parents"][2, T - 1] = T + 3                # invalid: the committed state
    ref_out = call_tree(p, fresh_buffers(d, snap_dtype=F64), conv=conv, lower_bound=lower_bound, f64=True)
    kdakit.take_errors()
    snap_bufs = fresh_buffers(d)
    call_tree(p, snap_bufs, conv=conv, lower_bound=lower_bound, backend="triton")
    snap_errors = kdakit.take_errors()
    results = {}
    for form in ("recurrent", "chunked"):
        monkeypatch.setattr(tree_verify_module, "tree_verify_config", pick(form))
        bufs, rings = fresh_buffers(d), ring_buffers(d)
        out = call_tree(p, dict(bufs, snapshots=None), conv=conv, lower_bound=lower_bound, backend="triton",
                        rings=rings)
        results[form] = out, bufs, rings, kdakit.take_errors()
    out, bufs, rings, errs = results["chunked"]
    rec_out, rec_bufs, rec_rings, rec_errs = results["recurrent"]
    tol = 1e-5 if act == torch.float32 else 2e-2
    live = (p["slot_indices"] >= 0) & (p["slot_indices"] < d["slots"]) & (p["scratch_indices"] < d["scratch"])
    assert_close(out[live], ref_out[live], tol, "chunk form vs float64 reference")
    assert_close(out, rec_out, 1e-5 if act == torch.float32 else 1e-2, "chunk form vs recurrence")
    assert torch.equal(out[~live], torch.zeros_like(out[~live])), "padding rows' outputs are zero"
    assert errs == rec_errs == snap_errors and errs.get("tree_verify", 0) >= 2, errs
    for x, y in zip(rings, rec_rings):
        assert torch.equal(x, y), "ring entries: the recurrence's bits"
    if conv:
        for x, y in zip(bufs["intermediate_conv"], rec_bufs["intermediate_conv"]):
            assert torch.equal(x, y)
    assert (bufs["snapshots"] == POISON).all(), "ring mode writes no snapshot"
    effective = [[q if 0 <= q < t else -1 for t, q in enumerate(row)] for row in p["parents"].tolist()]
    for node in range(T):
        paths = torch.full((d["N"], T), -1, dtype=torch.int32)
        lens = torch.zeros(d["N"], dtype=torch.int32)
        for n in range(d["N"]):
            path = path_to(effective[n], node)
            paths[n, :len(path)] = torch.tensor(path)
            lens[n] = len(path)
        state = p["state"].clone()
        kdakit.commit_tree_ring(state, *rings, torch.where(live, p["slot_indices"], -1), paths, lens,
                                backend="triton")
        for n in torch.nonzero(live).flatten().tolist():
            slot, row = int(p["slot_indices"][n]), int(p["scratch_indices"][n])
            assert torch.equal(state[slot], snap_bufs["snapshots"][row, node]), f"request {n} node {node}"


def test_ring_commit_skips_rows_outside_their_buffers():
    p, d = make_problem(73, T=4, conv=False)
    rings = ring_buffers(d)
    call_tree(p, {"snapshots": None}, conv=False, lower_bound=None, backend="triton", rings=rings)
    state = p["state"].clone()
    slots = torch.tensor([p["slot_indices"][0], d["slots"] + 3, p["slot_indices"][2]], dtype=torch.int32)
    paths = torch.tensor([[0, 9, 1, 1], [0, 1, 2, 3], [0, 1, -1, -1]], dtype=torch.int32)  # node 9: outside the rings
    kdakit.commit_tree_ring(state, *rings, slots, paths, torch.tensor([2, 4, 0], dtype=torch.int32),
                            backend="triton")
    assert torch.equal(state, p["state"])
    with pytest.raises(ValueError, match="`paths` holds node ids"):
        kdakit.commit_tree_ring(state, *rings, p["slot_indices"], paths, torch.tensor([2, 4, 0], dtype=torch.int32),
                                full_checks=True)


def test_compile_fullgraph_matches_eager():
    """Under torch.compile(fullgraph=True) the public entry traces to torch.ops.kdakit.tree_verify
    (shape checks at trace time) and writes what eager writes."""
    from torch._dynamo.testing import CompileCounterWithBackend
    p, d = make_problem(81, T=4, norm=True)
    eager_bufs, compiled_bufs = fresh_buffers(d), fresh_buffers(d)
    eager = call_tree(p, eager_bufs, conv=True, lower_bound=-2.0, backend="reference")
    counter = CompileCounterWithBackend("aot_eager")

    def fn(p, bufs):
        out = call_tree(p, bufs, conv=True, lower_bound=-2.0, backend="reference")
        return out, out.float().sum()
    got, checksum = torch.compile(fn, fullgraph=True, backend=counter)(p, compiled_bufs)
    assert counter.frame_count == 1
    called = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.kdakit.tree_verify.default in called or torch.ops.kdakit.tree_verify in called, called
    assert torch.equal(got, eager) and checksum == eager.float().sum()
    assert torch.equal(compiled_bufs["snapshots"], eager_bufs["snapshots"])
    for x, y in zip(compiled_bufs["intermediate_conv"], eager_bufs["intermediate_conv"]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_16_bit_pool_and_snapshots(pool_dtype):
    """A 16-bit state pool and 16-bit snapshots (float32 math in registers; a reloaded parent
    is its rounded snapshot): close to float64 on the same pool, the pool untouched."""
    p, d = make_problem(91, T=5, conv=False, K=32, V=16, H=2, HV=4)
    p["state"] = p["state"].to(pool_dtype)
    before = p["state"].clone()
    ref = call_tree(p, fresh_buffers(d, snap_dtype=F64), conv=False, lower_bound=-2.0, f64=True)
    bufs = fresh_buffers(d, snap_dtype=pool_dtype)
    out = call_tree(p, bufs, conv=False, lower_bound=-2.0, backend="triton")
    assert_close(out, ref, 2e-2, "out")
    assert torch.equal(p["state"], before)
    assert bufs["snapshots"].dtype == pool_dtype and torch.isfinite(bufs["snapshots"][p["scratch_indices"].long(),
                                                                                      :d["T"]]).all()


@pytest.mark.parametrize("lower_bound", [None, -3.0], ids=["default-gate", "safe-gate"])
@pytest.mark.parametrize("mode", ["snapshot", "ring"])
def test_node_loop_equals_unrolled_nodes_bitwise(mode, lower_bound, monkeypatch):
    """``VerifyConfig.unroll_steps=False`` (a loop over the nodes, picked for long trees), with
    and without ``prefetch_parent``, gives the unrolled kernel's bits: outputs, snapshots or
    ring entries, windows; a padding row, a second root and invalid parents among them."""
    from kdakit.ops import tree_verify as module
    T = 7
    p, d = make_problem(41, T=T, HV=2, act=torch.bfloat16, conv=True, norm=True, K=16, V=16)
    p["slot_indices"][1] = -1
    p["parents"][0] = torch.tensor([-1, 0, 0, 1, -1, 3, 2], dtype=torch.int32)  # a second root, reloads
    p["parents"][2] = torch.tensor([-1, 0, 5, 1, -3, 4, 2], dtype=torch.int32)  # 5 >= 2 and -3: invalid
    pinned = module.tree_verify_config
    got = []
    for variant in (dict(unroll_steps=True), dict(unroll_steps=False),
                    dict(unroll_steps=False, prefetch_parent=True)):
        monkeypatch.setattr(module, "tree_verify_config",
                            lambda *a, **kw: dataclasses.replace(pinned(*a, **kw), **variant))
        bufs = fresh_buffers(d)
        extra = {}
        if mode == "ring":
            bufs["snapshots"], extra["rings"] = None, ring_buffers(d)
        out = call_tree(p, bufs, conv=True, lower_bound=lower_bound, backend="triton", **extra)
        got.append([out, *bufs["intermediate_conv"], *(extra["rings"] if mode == "ring" else [bufs["snapshots"]])])
    for variant in got[1:]:
        for x, y in zip(got[0], variant):
            assert torch.equal(x, y)


def test_long_trees_loop_over_their_nodes_with_the_parent_prefetch():
    from kdakit.ops.tree_verify import TREE_UNROLL_NODES_MAX, tree_verify_config
    assert TREE_UNROLL_NODES_MAX == 4
    short, long = tree_verify_config(64, 4, 32, 128, 128, None), tree_verify_config(64, 8, 32, 128, 128, None)
    assert short.unroll_steps and not short.prefetch_parent
    assert not long.unroll_steps and long.prefetch_parent


@pytest.mark.parametrize("block_v", [4, 32], ids=["rows4", "rows32-past-V"])
def test_path_commit_configs_give_the_pinned_bits(block_v, monkeypatch):
    """A path commit with fewer state rows a program than V, or more (masked), folds the same
    values (on the GPU the benchmark checks each config's bits against the snapshot); the
    padding row's and the unclaimed slots' states untouched."""
    from kdakit.ops import tree_commit as module
    from kdakit.ops.tree_commit import _example
    fn, args, kw = _example(3)
    before = args[0].clone()
    pinned_state = args[0].clone()
    fn(pinned_state, *args[1:], backend="triton", **kw)
    pinned, picked = module.tree_commit_config, []

    def variant(*a):
        picked.append(dataclasses.replace(pinned(*a), block_v=block_v))
        return picked[-1]
    monkeypatch.setattr(module, "tree_commit_config", variant)
    state = args[0].clone()
    fn(state, *args[1:], backend="triton", **kw)
    assert [c.block_v for c in picked] == [block_v], "the launch took the variant"
    assert torch.equal(state, pinned_state)
    touched = {int(s) for s in args[5] if int(s) >= 0}
    for s in range(state.shape[0]):
        if s not in touched:
            assert torch.equal(state[s], before[s])
    assert not torch.equal(state[sorted(touched)], before[sorted(touched)])


def test_commit_pickers_take_two_recurrence_tiles_of_rows_on_one_warp():
    """The path commit folds 16 rows a warp at K = V = 128, the chain's ring commit too from
    8-step rings (8 rows below): one warp each, so the bits stay the verify's."""
    from kdakit.ops.commit import commit_ring_config
    from kdakit.ops.tree_commit import tree_commit_config
    assert (tree_commit_config(128, 128).block_v, tree_commit_config(128, 128).num_warps) == (16, 1)
    assert (commit_ring_config(128, 128, 8).block_v, commit_ring_config(128, 128, 8).num_warps) == (16, 1)
    assert commit_ring_config(128, 128, 4).block_v == 8
    assert tree_commit_config(128, 256).block_v == 8


def test_state_kernel_runs_beside_the_steps_past_8_nodes():
    """The ring chunk form's state kernel forms its products from the inputs (beside the
    steps kernel) for trees of 9 to 16 nodes only; chains keep the order they were measured in."""
    from kdakit.ops.mtp_verify import mtp_verify_config
    from kdakit.ops.tree_verify import tree_verify_config
    assert tree_verify_config(8, 16, 32, 128, 128, -5.0).ring.state_from_inputs
    assert tree_verify_config(64, 9, 32, 128, 128, None).ring.state_from_inputs
    assert not tree_verify_config(8, 8, 32, 128, 128, -5.0).ring.state_from_inputs
    assert not tree_verify_config(8, 17, 32, 128, 128, -5.0).ring.state_from_inputs, "not timed past 16 nodes"
    assert not mtp_verify_config(8, 16, 32, 128, 128, -5.0).ring.state_from_inputs


@pytest.mark.parametrize("T,lower_bound", [(20, None), (33, -1.0)], ids=["T20-defaultgate", "T33-safegate"])
def test_state_from_inputs_on_wide_node_tiles(T, lower_bound, monkeypatch):
    """The state kernel's products from the inputs on 32- and 64-node tiles (forced: the
    picker takes them only from 9 to 16 nodes): outputs against float64, the rings bitwise the
    order after the wait, a free slot's outputs zero."""
    from kdakit.ops import tree_verify as tree_verify_module
    pinned = tree_verify_module.tree_verify_config
    p, d = make_problem(91, N=2, T=T, HV=1, K=16, V=16, conv=False, slots=4, scratch=3)
    p["slot_indices"][1] = -1
    ref_out = call_tree(p, fresh_buffers(d, snap_dtype=F64), conv=False, lower_bound=lower_bound, f64=True)
    results = {}
    for from_inputs in (False, True):
        def forced(*a, f=from_inputs, **kw):
            config = pinned(*a, **kw)
            return dataclasses.replace(config, ring_form="chunked",
                                       ring=dataclasses.replace(config.ring, state_from_inputs=f))
        monkeypatch.setattr(tree_verify_module, "tree_verify_config", forced)
        rings = ring_buffers(d)
        out = call_tree(p, dict(fresh_buffers(d), snapshots=None), conv=False, lower_bound=lower_bound,
                        backend="triton", rings=rings)
        results[from_inputs] = out, rings
    out, rings = results[True]
    assert_close(out[0], ref_out[0], 1e-5, "from the inputs vs float64")
    assert_close(out, results[False][0], 1e-5, "the two orders")
    assert torch.equal(out[1], torch.zeros_like(out[1])), "a free slot's outputs"
    for x, y in zip(rings, results[False][1]):
        assert torch.equal(x, y)
