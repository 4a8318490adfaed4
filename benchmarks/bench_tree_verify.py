"""Tree verify on the GPU: checks at real sizes against float64, then timings.

    python benchmarks/bench_tree_verify.py [--quick] [--batches 8,64,256] [--nodes 4,8,16]
                                           [--configs ...] [--ring-configs ...] [--commit-configs ...]
                                           [--name tree_verify_h200]

Tree verify (kdakit/ops/tree_verify.py) against the chain verify (mtp_verify, snapshot mode)
at the same node count, H = HV = 32, K = V = 128, bf16 activations, float32 states, safe
gate: top-2 trees (two candidates a level, the first expanded), random trees (width <= 3),
and a chain-shaped tree (the kernel's register path only, the same work as the chain
verify). Also the ring mode of trees (past a few requests the chunk form of ring_verify.py,
ancestor-masked) and its path commit (commit_tree_ring), and the
snapshot commit of an accepted node. Every timed call is a CUDA graph over several
independent layers (kdakit.bench.harness), HBM-resident; the device copy ceiling is
measured in the same run. The checks run first and the timings only if all pass.
Floors: snapshot verify moves (1 + T) states per request (one read, T snapshot writes; a
reloaded snapshot is this program's own recent write), ring verify about one.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import kdakit
from kdakit import reference
from kdakit.bench import harness
from kdakit.bench.inputs import top2_parents
from kdakit.ops.mtp_verify import VerifyConfig, ring_form
from kdakit.ops.ring_verify import RingVerifyConfig
from kdakit.ops.tree_commit import TreeCommitConfig

H = HV = 32
K = V = 128
W = 4
LOWER_BOUND = -5.0
STATE_BYTES = HV * V * K * 4


def random_parents(T, gen, width=3):
    parents, children = [-1], [0]
    for _ in range(1, T):
        open_nodes = [i for i in range(len(parents)) if children[i] < width]
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        parents.append(p)
        children.append(0)
        children[p] += 1
    return parents


def tree_parents(shape, N, T, seed):
    gen = torch.Generator().manual_seed(seed)
    if shape == "chain":
        rows = [[-1] + list(range(T - 1))] * N
    elif shape == "top2":
        rows = [top2_parents(T)] * N
    else:
        rows = [random_parents(T, gen) for _ in range(N)]
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def make_layer(N, T, *, conv, mode, shape, seed=0, norm=False, slots=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    slots = slots or 2 * N + 2

    def rnd(*shape_, s=1.0):
        return (torch.randn(*shape_, device=dev, generator=g) * s).to(bf)
    L = {"q": rnd(N, T, H, K), "k": rnd(N, T, H, K), "v": rnd(N, T, HV, V), "a": rnd(N, T, HV, K),
         "b": rnd(N, T, HV), "A_log": torch.rand(HV, device=dev, generator=g) * 2 - 1,
         "dt_bias": torch.randn(HV * K, device=dev, generator=g) * 0.5,
         "state": torch.randn(slots, HV, V, K, device=dev, generator=g) * 0.3,
         "slots": torch.randperm(slots, device=dev, generator=g)[:N].to(torch.int32),
         "scratch_idx": torch.randperm(N, device=dev, generator=g).to(torch.int32),
         "parents": tree_parents(shape, N, T, seed)}
    channels = (H * K, H * K, HV * V)
    if conv:
        L["conv_weights"] = tuple(torch.randn(c, W, device=dev, generator=g) * 0.5 for c in channels)
        L["conv_states"] = tuple(rnd(slots, c, W - 1) for c in channels)
        L["intermediate_conv"] = tuple(torch.empty(N, T, c, W - 1, device=dev, dtype=bf) for c in channels)
    if mode == "snapshot":
        L["snapshots"] = torch.empty(N, T, HV, V, K, device=dev)
    else:
        L["rings"] = (torch.empty(slots, H, T, K, device=dev, dtype=bf), torch.empty(slots, HV, T, V, device=dev,
                                                                                     dtype=bf),
                      torch.empty(slots, HV, T, K, device=dev), torch.empty(slots, HV, T, device=dev))
    if norm:
        L["norm_gate"] = rnd(N, T, HV, V)
        L["norm_weight"] = torch.rand(V, device=dev, generator=g) + 0.5
    L["out"] = torch.empty(N, T, HV, V, device=dev, dtype=bf)
    return L


def tree_call(L):
    return lambda: kdakit.tree_verify(
        L["q"], L["k"], L["v"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"], L["slots"], L["scratch_idx"],
        L["parents"], L["out"], conv_weights=L.get("conv_weights"), conv_states=L.get("conv_states"),
        intermediate_conv=L.get("intermediate_conv"), snapshots=L.get("snapshots"), rings=L.get("rings"),
        lower_bound=LOWER_BOUND, norm_gate=L.get("norm_gate"), norm_weight=L.get("norm_weight"))


def chain_call(L):
    return lambda: kdakit.mtp_verify(
        L["q"], L["k"], L["v"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"], L["slots"], L["scratch_idx"],
        conv_weights=L.get("conv_weights"), conv_states=L.get("conv_states"),
        intermediate_conv=L.get("intermediate_conv"), snapshots=L.get("snapshots"), rings=L.get("rings"),
        lower_bound=LOWER_BOUND, norm_gate=L.get("norm_gate"), norm_weight=L.get("norm_weight"), out=L["out"])


def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm()) if torch.isfinite(x).all() else float("inf")


def ref_tree(L):
    out = torch.empty(L["out"].shape, dtype=torch.float64, device="cuda")
    snaps = torch.zeros(L["snapshots"].shape, dtype=torch.float64, device="cuda")
    inter = tuple(torch.zeros_like(t) for t in L["intermediate_conv"]) if "conv_weights" in L else None
    reference.tree_verify(L["q"], L["k"], L["v"], L["a"], L["b"], L["A_log"].double(), L["dt_bias"].double(),
                          L["state"].double(), L["slots"], L["scratch_idx"], L["parents"], out,
                          conv_weights=tuple(w.double() for w in L["conv_weights"]) if "conv_weights" in L else None,
                          conv_states=L.get("conv_states"), intermediate_conv=inter, snapshots=snaps,
                          lower_bound=LOWER_BOUND, norm_gate=L.get("norm_gate"),
                          norm_weight=L["norm_weight"].double() if "norm_weight" in L else None,
                          compute_dtype=torch.float64)
    return out, snaps, inter


def path_tensors(parents, accepted):
    """Root-to-node paths [N, T] (node ids, -1 after the end) and their lengths."""
    N, T = parents.shape
    par = parents.tolist()
    paths = torch.full((N, T), -1, dtype=torch.int32)
    lens = torch.zeros(N, dtype=torch.int32)
    for n, a in enumerate(accepted.tolist()):
        path = [a]
        while path[-1] > 0 and par[n][path[-1]] >= 0:
            path.append(par[n][path[-1]])
        path.reverse()
        paths[n, :len(path)] = torch.tensor(path)
        lens[n] = len(path)
    return paths.cuda(), lens.cuda()


def verified_pair(N, T, conv, shape, seed):
    """The same trees verified in snapshot and in ring mode, a random accepted node a request,
    and its root-to-node paths."""
    snap = make_layer(N, T, conv=conv, mode="snapshot", shape=shape, seed=seed)
    ring = make_layer(N, T, conv=conv, mode="ring", shape=shape, seed=seed)
    tree_call(snap)()
    tree_call(ring)()
    accepted = torch.randint(0, T, (N,), device="cuda", dtype=torch.int32)
    paths, lens = path_tensors(snap["parents"], accepted)
    return snap, ring, accepted, paths, lens


def correctness(results):
    """Against float64; chain-shaped tree == chain verify bitwise; ring mode == snapshot mode
    (bitwise from the recurrence, up to rounding from the chunk form); a ring path commit ==
    the accepted node's snapshot bitwise."""
    for N, T, conv, norm, shape in ((1, 4, True, False, "top2"), (8, 8, True, True, "top2"),
                                    (33, 6, True, False, "random"), (64, 16, False, False, "random"),
                                    (16, 16, True, True, "top2")):
        L = make_layer(N, T, conv=conv, mode="snapshot", shape=shape, norm=norm, seed=N * 10 + T)
        if N > 2:
            L["slots"][N // 2] = -1
        state_before = L["state"].clone()
        tree_call(L)()
        ref_out, ref_snaps, ref_inter = ref_tree(L)
        live = (L["slots"] >= 0).nonzero().flatten()
        rows = L["scratch_idx"][live].long()
        e_out = rel(L["out"][live], ref_out[live])
        e_snap = rel(L["snapshots"][rows], ref_snaps[rows])
        windows = all(torch.equal(a[rows], b[rows]) for a, b in zip(L["intermediate_conv"], ref_inter)) if conv \
            else True
        ok = e_out < 2e-2 and e_snap < 1e-2 and torch.equal(L["state"], state_before) and windows
        results["checks"].append({"case": f"tree-snapshot-{shape}-N{N}-T{T}-conv{int(conv)}-norm{int(norm)}",
                                  "out_err": e_out, "pool_err": e_snap, "windows_equal": windows, "ok": ok})
    for N, T, conv, norm in ((8, 4, True, True), (64, 8, False, False), (16, 16, True, False)):
        tree = make_layer(N, T, conv=conv, mode="snapshot", shape="chain", norm=norm, seed=3)
        chain = make_layer(N, T, conv=conv, mode="snapshot", shape="chain", norm=norm, seed=3)
        tree_call(tree)()
        chain_call(chain)()
        same = torch.equal(tree["out"], chain["out"]) and torch.equal(tree["snapshots"], chain["snapshots"])
        results["checks"].append({"case": f"chain-tree-bitwise-mtp-verify-N{N}-T{T}-conv{int(conv)}-norm{int(norm)}",
                                  "ok": same})
    for N, T, conv, shape in ((8, 8, True, "top2"), (64, 16, False, "random"), (16, 6, True, "random")):
        snap, ring, accepted, paths, lens = verified_pair(N, T, conv, shape, seed=5)
        s1, s2 = snap["state"].clone(), ring["state"].clone()
        kdakit.commit_snapshots(s1, snap["snapshots"], snap["slots"], snap["scratch_idx"], accepted)
        kdakit.commit_tree_ring(s2, *ring["rings"], ring["slots"], paths, lens)
        # beyond a few requests ring mode's outputs come from the chunk form (mtp_verify.ring_form):
        # the snapshot's up to rounding; bit for bit from the recurrence
        chunked = ring_form(N, HV, T) == "chunked"
        same_out = torch.equal(snap["out"], ring["out"])
        e_out = rel(ring["out"], snap["out"])
        same_state = torch.equal(s1, s2)
        results["checks"].append({"case": f"tree-ring-bitwise-snapshot-{shape}-N{N}-T{T}-conv{int(conv)}",
                                  "ok": (e_out < 1e-2 if chunked else same_out) and same_state,
                                  "form": "chunked" if chunked else "recurrent", "outputs_equal": same_out,
                                  "out_err": e_out, "commit_equal": same_state,
                                  "pool_err": float((s1 - s2).abs().max())})


@contextlib.contextmanager
def verify_config(group):
    """The tree's and the chain's verify with ``group``'s VerifyConfig fields (harness.parse_configs
    syntax) over the config each picker chooses, while the block runs (graph capture included)."""
    from kdakit.ops import mtp_verify as chain_module, tree_verify as tree_module
    pinned = (chain_module.mtp_verify_config, tree_module.tree_verify_config)
    def with_group(picker):  # an empty group: the picked config itself
        return lambda *a, **kw: (harness.parse_configs(group, VerifyConfig, base=picker(*a, **kw)) or
                                 [picker(*a, **kw)])[0]
    chain_module.mtp_verify_config, tree_module.tree_verify_config = (with_group(p) for p in pinned)
    try:
        yield
    finally:
        chain_module.mtp_verify_config, tree_module.tree_verify_config = pinned


@contextlib.contextmanager
def ring_config(group):
    """The tree verify's ring mode in the chunk form whatever the batch, with ``group``'s
    RingVerifyConfig fields over the picked ones, while the block runs (graph capture included)."""
    from dataclasses import replace
    from kdakit.ops import tree_verify as tree_module
    pinned = tree_module.tree_verify_config

    def pick(*a, **kw):
        config = pinned(*a, **kw)
        ring = (harness.parse_configs(group, RingVerifyConfig, base=config.ring) or [config.ring])[0]
        return replace(config, ring_form="chunked", ring=ring)
    tree_module.tree_verify_config = pick
    try:
        yield
    finally:
        tree_module.tree_verify_config = pinned


def check_ring_configs(results, groups):
    """Every swept ring config: outputs the snapshot mode's up to rounding, ring entries the
    picked config's bit for bit, the path commit the accepted node's snapshot bit for bit."""
    for N, T, conv, shape in ((8, 8, True, "top2"), (8, 8, False, "random"), (64, 16, False, "random"),
                              (3, 5, True, "random")):
        snap, picked, accepted, paths, lens = verified_pair(N, T, conv, shape, seed=9)
        want = snap["state"].clone()
        kdakit.commit_snapshots(want, snap["snapshots"], snap["slots"], snap["scratch_idx"], accepted)
        for group in groups:
            ring = make_layer(N, T, conv=conv, mode="ring", shape=shape, seed=9)
            with ring_config(group):
                tree_call(ring)()
            got = ring["state"].clone()
            kdakit.commit_tree_ring(got, *ring["rings"], ring["slots"], paths, lens)
            e_out = rel(ring["out"], snap["out"])
            live = ring["slots"][ring["slots"] >= 0].long()  # the entries of the requests' slots
            same_rings = all(torch.equal(x[live], y[live]) for x, y in zip(ring["rings"], picked["rings"]))
            results["checks"].append({"case": f"tree-ring-{shape}-N{N}-T{T}-conv{int(conv)}-[{group}]",
                                      "out_err": e_out, "rings_equal": same_rings,
                                      "commit_equal": torch.equal(got, want),
                                      "ok": e_out < 1e-2 and same_rings and torch.equal(got, want)})


@contextlib.contextmanager
def commit_config(group):
    """commit_tree_ring with ``group``'s TreeCommitConfig fields over the picked config while the block runs."""
    from kdakit.ops import tree_commit
    pinned = tree_commit.tree_commit_config
    tree_commit.tree_commit_config = lambda *a: (harness.parse_configs(group, TreeCommitConfig, base=pinned(*a)) or
                                                [pinned(*a)])[0]
    try:
        yield
    finally:
        tree_commit.tree_commit_config = pinned


def check_commit_configs(results, groups):
    """Every swept path-commit config against the snapshot of the accepted node, bitwise."""
    for N, T, shape in ((8, 8, "top2"), (64, 16, "random"), (16, 6, "top2")):
        snap, ring, accepted, paths, lens = verified_pair(N, T, False, shape, seed=7)
        want = snap["state"].clone()
        kdakit.commit_snapshots(want, snap["snapshots"], snap["slots"], snap["scratch_idx"], accepted)
        for group in groups:
            got = ring["state"].clone()
            with commit_config(group):
                kdakit.commit_tree_ring(got, *ring["rings"], ring["slots"], paths, lens)
            results["checks"].append({"case": f"commit-tree-ring-{shape}-N{N}-T{T}-[{group}]-bitwise-snapshot",
                                      "ok": torch.equal(got, want), "pool_err": float((got - want).abs().max())})


def check_configs(results, groups, N=8, T=16):
    """Every swept config against the picked one, bitwise: outputs and snapshots of a top-2
    tree, a random tree and the chain (a loop, an unrolled loop, a prefetch: the same bits)."""
    for shape, call in (("top2", tree_call), ("random", tree_call), ("chain", chain_call)):
        got = {}
        for group in ["", *groups]:
            L = make_layer(N, T, conv=False, mode="snapshot", shape=shape, seed=5)
            with verify_config(group):
                call(L)()
            got[group] = (L["out"], L["snapshots"])
        for group in groups:
            same = all(torch.equal(x, y) for x, y in zip(got[""], got[group]))
            results["checks"].append({"case": f"{shape}-N{N}-T{T}-[{group}]-bitwise-picked", "ok": same})


def add_row(results, name, t, moved, **extra):
    r = harness.row(name, t, moved, results["copy_ceiling_GBps"], **extra)
    results["rows"].append(r)
    print(f"{name:28s} N={r['N']:<4} T={r['T']:<3} {r['us']:9.2f} us {r['pct_of_copy']:6.1f}% of copy", flush=True)


def time_calls(results, name, layers, call, moved, **base):
    t = harness.graph_time_us([call(L) for L in layers])
    add_row(results, name, t, moved, layers=len(layers), **base)


def timings(results, batches, nodes, conv_too=True, groups=(), commit_groups=(), ring_groups=()):
    for T in nodes:
        for N in batches:
            base = {"N": N, "T": T}
            moved = N * (1 + T) * STATE_BYTES
            nl = harness.layers_for(moved)
            for conv in ((False, True) if conv_too else (False,)):
                suffix = "-conv" if conv else ""
                for shape in ("top2", "random", "chain"):
                    layers = [make_layer(N, T, conv=conv, mode="snapshot", shape=shape, seed=i) for i in range(nl)]
                    time_calls(results, f"tree-snapshot-{shape}{suffix}", layers, tree_call, moved, **base)
                    if shape == "chain":  # the chain verify on the same work
                        time_calls(results, f"chain-snapshot{suffix}", layers, chain_call, moved, **base)
                    for group in (groups if not conv else ()):  # the swept configs, same layers
                        with verify_config(group):
                            time_calls(results, f"tree-snapshot-{shape}[{group}]", layers, tree_call, moved, **base)
                            if shape == "chain":
                                time_calls(results, f"chain-snapshot[{group}]", layers, chain_call, moved, **base)
                    if shape == "top2" and not conv:
                        for L in layers:
                            tree_call(L)()
                        acc = [torch.randint(0, T, (N,), device="cuda", dtype=torch.int32) for _ in layers]
                        t = harness.graph_time_us([
                            (lambda L=L, a=a: kdakit.commit_snapshots(L["state"], L["snapshots"], L["slots"],
                                                                      L["scratch_idx"], a))
                            for L, a in zip(layers, acc)])
                        add_row(results, "commit-snapshot-node", t, 2 * N * STATE_BYTES, layers=nl, **base)
                    del layers
                    torch.cuda.empty_cache()
            ring_moved = N * STATE_BYTES
            nl = harness.layers_for(ring_moved)
            for shape in ("top2", "random"):
                layers = [make_layer(N, T, conv=False, mode="ring", shape=shape, seed=i) for i in range(nl)]
                time_calls(results, f"tree-ring-{shape}", layers, tree_call, ring_moved, **base)
                for group in ring_groups:  # the swept configs, same layers
                    with ring_config(group):
                        time_calls(results, f"tree-ring-{shape}[{group}]", layers, tree_call, ring_moved, **base)
                for L in layers:
                    tree_call(L)()
                commits = []
                for L in layers:
                    paths, lens = path_tensors(L["parents"], torch.randint(0, T, (N,), device="cuda"))
                    commits.append(lambda L=L, p=paths, n=lens: kdakit.commit_tree_ring(
                        L["state"], *L["rings"], L["slots"], p, n))
                t = harness.graph_time_us(commits)
                add_row(results, f"commit-tree-ring-{shape}", t, 2 * N * STATE_BYTES, layers=nl, **base)
                for group in commit_groups:  # the swept configs, same paths
                    with commit_config(group):
                        t = harness.graph_time_us(commits)
                    add_row(results, f"commit-tree-ring-{shape}[{group}]", t, 2 * N * STATE_BYTES, layers=nl, **base)
                del layers, commits
                torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N in {8, 64}, T in {4, 8}, no conv variants")
    ap.add_argument("--batches", default=None, help="comma-separated N (default 8,64,256)")
    ap.add_argument("--nodes", default=None, help="comma-separated T (default 4,8,16)")
    ap.add_argument("--skip-checks", action="store_true", help="timings only (the checks have passed on this build)")
    ap.add_argument("--configs", default=None,
                    help="VerifyConfig variants of the snapshot verifies (tree and chain) to time besides the picked "
                         "one, harness.parse_configs syntax, e.g. 'unroll_steps=false;prefetch_parent=true'")
    ap.add_argument("--ring-configs", default=None,
                    help="RingVerifyConfig variants of the ring verify (the chunk form whatever the batch) to time "
                         "besides the picked form, e.g. 'pair_dots=true,steps_warps=4;state_block_v=32,state_warps=2'")
    ap.add_argument("--commit-configs", default=None,
                    help="TreeCommitConfig variants of the path commit to time besides the picked one, e.g. "
                         "'block_v=8;block_v=32' (one warp: more warps are not the snapshot's bits)")
    ap.add_argument("--name", default="tree_verify_h200")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_tree_verify: needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(x) for x in args.batches.split(",")] if args.batches else ([8, 64] if args.quick else [8, 64, 256])
    nodes = [int(x) for x in args.nodes.split(",")] if args.nodes else ([4, 8] if args.quick else [4, 8, 16])
    groups = harness.config_groups(args.configs, VerifyConfig, base=VerifyConfig(block_v=8))
    commit_groups = harness.config_groups(args.commit_configs, TreeCommitConfig, base=TreeCommitConfig(block_v=8))
    ring_groups = harness.config_groups(args.ring_configs, RingVerifyConfig, base=RingVerifyConfig())
    results = harness.new_results(H=H, HV=HV, K=K, V=V, lower_bound=LOWER_BOUND)
    if not args.skip_checks:
        correctness(results)
        check_configs(results, groups)
        check_commit_configs(results, commit_groups)
        check_ring_configs(results, ring_groups)
    failed = [c["case"] for c in results["checks"] if not c["ok"]]
    for c in results["checks"]:
        print(("ok   " if c["ok"] else "FAIL ") + c["case"], {k: v for k, v in c.items() if k not in ("case", "ok")})
    if not failed:
        timings(results, batches, nodes, conv_too=not args.quick, groups=groups, commit_groups=commit_groups,
                ring_groups=ring_groups)
    harness.close_results(results)
    path = harness.save(results, args.name, harness.results_folder(__file__))
    harness.print_table(results["rows"], ["name", "N", "T", "us", "GB/s", "pct_of_copy", "layers"])
    print(f"saved {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
