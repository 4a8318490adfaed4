"""Speculative verify and commit on the GPU: checks at real sizes, then timings.

    python benchmarks/bench_mtp.py [--quick] [--batches 1,8,64,256] [--name mtp_h200]
    sweeps: --tile-bytes 4096,8192 | --ring-sweep ... | --conv-sweep 64x2,128x4:wr1 |
            --commit-tiles 1:1,1:2,2:2

Verify in snapshot and ring mode (inputs already convolved, and with the short conv
fused), the snapshot and ring commits, and fla's speculative serving path
(`fused_recurrent_kda_fwd` with 2-D `ssm_state_indices` and `num_accepted_tokens`,
a state written to a pool slot after every token) on the same work, HBM-resident.
Floors: snapshot verify moves (1 + T) states per request, ring verify about one,
a fold commit one read and one write of each committed state.
"""
from __future__ import annotations

import argparse

from dataclasses import replace

import torch

import kdakit
from kdakit import reference
from kdakit.bench import harness
from kdakit.ops.commit import commit_ring_config, commit_ring_triton
from kdakit.ops.mtp_verify import mtp_verify_config, mtp_verify_triton, recurrence_tile

H = HV = 32
K = V = 128
W = 4
LOWER_BOUND = -5.0
STATE_BYTES = HV * V * K * 4

# A sweep's launch configs, passed explicitly (``config=``) to the Triton launchers: None,
# the public entry and the op's own pick; else a function of the shapes returning the config.
SWEEP_CONFIGS = {"verify": None,   # (N, T, HV, V, K, lower_bound) -> mtp_verify.VerifyConfig
                 "commit": None}   # (V, K) -> commit.CommitRingConfig


def make_layer(N, T, *, conv, mode, seed=0, norm=False, ring_len=None, slots=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    slots = slots or 2 * N + 2
    ring_len = ring_len or T

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * s).to(bf)
    L = {"q": rnd(N, T, H, K), "k": rnd(N, T, H, K), "v": rnd(N, T, HV, V), "a": rnd(N, T, HV, K),
         "b": rnd(N, T, HV), "A_log": torch.rand(HV, device=dev, generator=g) * 2 - 1,
         "dt_bias": torch.randn(HV * K, device=dev, generator=g) * 0.5,
         "state": torch.randn(slots, HV, V, K, device=dev, generator=g) * 0.3,
         "slots": torch.randperm(slots, device=dev, generator=g)[:N].to(torch.int32),
         "scratch_idx": torch.randperm(N, device=dev, generator=g).to(torch.int32)}
    channels = (H * K, H * K, HV * V)
    if conv:
        L["conv_weights"] = tuple(torch.randn(c, W, device=dev, generator=g) * 0.5 for c in channels)
        L["conv_states"] = tuple(rnd(slots, c, W - 1) for c in channels)
        L["intermediate_conv"] = tuple(torch.empty(N, T, c, W - 1, device=dev, dtype=bf) for c in channels)
    if mode == "snapshot":
        L["snapshots"] = torch.empty(N, T, HV, V, K, device=dev)
    else:
        L["rings"] = (torch.empty(slots, H, ring_len, K, device=dev, dtype=bf),
                      torch.empty(slots, HV, ring_len, V, device=dev, dtype=bf),
                      torch.empty(slots, HV, ring_len, K, device=dev), torch.empty(slots, HV, ring_len, device=dev))
    if norm:
        L["norm_gate"] = rnd(N, T, HV, V)
        L["norm_weight"] = torch.rand(V, device=dev, generator=g) + 0.5
    L["out"] = torch.empty(N, T, HV, V, device=dev, dtype=bf)
    return L


def verify_call(L):
    pick = SWEEP_CONFIGS["verify"]
    if pick is None:
        return lambda: kdakit.mtp_verify(
            L["q"], L["k"], L["v"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"], L["slots"],
            L["scratch_idx"], conv_weights=L.get("conv_weights"), conv_states=L.get("conv_states"),
            intermediate_conv=L.get("intermediate_conv"), snapshots=L.get("snapshots"), rings=L.get("rings"),
            lower_bound=LOWER_BOUND, norm_gate=L.get("norm_gate"), norm_weight=L.get("norm_weight"), out=L["out"])
    (N, T, _, k_dim), (hv, v_dim) = L["q"].shape, L["v"].shape[2:]
    config = pick(N, T, hv, v_dim, k_dim, LOWER_BOUND)
    return lambda: mtp_verify_triton(
        L["q"], L["k"], L["v"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"], L["slots"], L["scratch_idx"],
        L["out"], conv_weights=L.get("conv_weights"), conv_states=L.get("conv_states"),
        intermediate_conv=L.get("intermediate_conv"), conv_bias=None, snapshots=L.get("snapshots"),
        rings=L.get("rings"), scale=k_dim ** -0.5, lower_bound=LOWER_BOUND, norm_gate=L.get("norm_gate"),
        norm_weight=L.get("norm_weight"), norm_eps=1e-6, config=config)


def commit_ring(state, rings, slots, accept):
    """``kdakit.commit_ring``, or the Triton launch with the sweep's config."""
    pick = SWEEP_CONFIGS["commit"]
    if pick is None:
        return kdakit.commit_ring(state, *rings, slots, accept)
    return commit_ring_triton(state, *rings, slots, accept, track_slots=None, track_steps=None, use_qk_l2norm=True,
                              null_block_id=-1, config=pick(*state.shape[-2:]))


def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm()) if torch.isfinite(x).all() else float("inf")


def ref_verify(L, mode):
    out = torch.empty(L["out"].shape, dtype=torch.float64, device="cuda")
    snaps = torch.zeros(L["snapshots"].shape, dtype=torch.float64, device="cuda") if mode == "snapshot" else None
    inter = tuple(torch.zeros_like(t) for t in L["intermediate_conv"]) if "conv_weights" in L else None
    rings = tuple(torch.zeros_like(r, dtype=torch.float64) for r in L["rings"]) if mode == "ring" else None
    reference.mtp_verify(L["q"], L["k"], L["v"], L["a"], L["b"], L["A_log"].double(), L["dt_bias"].double(),
                         L["state"].double(), L["slots"], L["scratch_idx"], out,
                         conv_weights=tuple(w.double() for w in L["conv_weights"]) if "conv_weights" in L else None,
                         conv_states=L.get("conv_states"), intermediate_conv=inter, snapshots=snaps, rings=rings,
                         lower_bound=LOWER_BOUND, norm_gate=L.get("norm_gate"),
                         norm_weight=L["norm_weight"].double() if "norm_weight" in L else None,
                         compute_dtype=torch.float64)
    return out, snaps, rings


def correctness(results, tag=""):
    for N, T, conv, norm in ((1, 2, True, False), (8, 4, True, True), (64, 8, False, False), (33, 4, True, False)):
        for mode in ("snapshot", "ring"):
            L = make_layer(N, T, conv=conv, mode=mode, norm=norm, seed=N * 10 + T)
            L["slots"][N // 2] = -1 if N > 2 else L["slots"][N // 2]
            state_before = L["state"].clone()
            verify_call(L)()
            ref_out, ref_snaps, ref_rings = ref_verify(L, mode)
            live = (L["slots"] >= 0).nonzero().flatten()
            e_out = rel(L["out"][live], ref_out[live])
            if mode == "snapshot":
                rows = L["scratch_idx"][live].long()
                e_pool = rel(L["snapshots"][rows], ref_snaps[rows])
            else:
                s = L["slots"][live].long()
                e_pool = max(rel(r[s], rr[s]) for r, rr in zip(L["rings"], ref_rings))
            untouched = torch.equal(L["state"], state_before)
            ok = e_out < 2e-2 and e_pool < 1e-2 and untouched
            results["checks"].append({"case": f"verify-{mode}-N{N}-T{T}-conv{int(conv)}-norm{int(norm)}{tag}",
                                      "out_err": e_out, "pool_err": e_pool, "ok": ok})
    commit_bitwise_checks(results, tag)


def commit_bitwise_checks(results, tag=""):
    """Ring commit == snapshot commit, bitwise, on the GPU (norm on and off, rings longer than T)."""
    for norm, ring_len, T, conv in ((False, None, 4, True), (True, None, 4, True), (False, 8, 4, True),
                                    (True, 16, 4, True), (False, None, 8, False), (True, 8, 2, False)):
        N = 16
        snap_layer = make_layer(N, T, conv=conv, mode="snapshot", seed=7, norm=norm)
        ring_layer = dict(make_layer(N, T, conv=conv, mode="ring", seed=7, norm=norm, ring_len=ring_len))
        verify_call(snap_layer)()
        verify_call(ring_layer)()
        accept = torch.randint(1, T + 1, (N,), device="cuda", dtype=torch.int32)
        s1, s2 = snap_layer["state"].clone(), ring_layer["state"].clone()
        kdakit.commit_snapshots(s1, snap_layer["snapshots"], snap_layer["slots"], snap_layer["scratch_idx"],
                                accept - 1)
        commit_ring(s2, ring_layer["rings"], ring_layer["slots"], accept)
        same = torch.equal(s1, s2)
        # ring mode may compute its outputs in the chunk form: equal to the snapshot's up to rounding
        e_out = rel(ring_layer["out"], snap_layer["out"])
        results["checks"].append({"case": f"ring-commit-bitwise-snapshot-commit-T{T}-conv{int(conv)}-norm{int(norm)}"
                                          f"-L{ring_len or T}{tag}",
                                  "ok": same and e_out < 1e-2, "out_err": e_out,
                                  "pool_err": float((s1 - s2).abs().max())})


def fla_spec_call(L, T):
    """fla's serving path on the same (already convolved) tokens: one read, T pool writes."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    N = L["q"].shape[0]
    q, k, v = (L[x].view(1, N * T, *L[x].shape[2:]) for x in ("q", "k", "v"))
    gate, beta = L["a"].view(1, N * T, HV, K), L["b"].view(1, N * T, HV)
    cu = torch.arange(0, N * T + 1, T, device="cuda", dtype=torch.int32)
    # fla reads the initial state from idx[n, 0] (one accepted token) and writes the state after
    # token t to idx[n, t]: the request's slot, then T - 1 spare slots (snapshot traffic)
    used = set(L["slots"].tolist())
    spare = torch.tensor([s for s in range(L["state"].shape[0]) if s not in used][:N * (T - 1)], device="cuda")
    idx = torch.cat([L["slots"][:, None].long(), spare.view(N, T - 1)], dim=1).to(torch.int32).contiguous()
    L["fla_idx"] = idx
    accepted = torch.ones(N, device="cuda", dtype=torch.int32)
    out = torch.empty(1, N * T, HV, V, device="cuda", dtype=torch.bfloat16)
    L["fla_out"] = out
    return lambda: fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=gate, beta=beta, A_log=L["A_log"], dt_bias=L["dt_bias"], initial_state=L["state"],
        scale=K ** -0.5, output_final_state=True, inplace_final_state=True, state_v_first=True, cu_seqlens=cu,
        ssm_state_indices=idx, num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=out)


def time_fla_chain(results, layers, T, moved, base):
    try:
        ref_out = ref_verify(layers[0], "snapshot")[0]
        calls = [fla_spec_call(L, T) for L in layers]
        calls[0]()
        err = rel(layers[0]["fla_out"].view(ref_out.shape), ref_out)
        t = harness.graph_time_us(calls)
        results["rows"].append(harness.row("fla-spec-chain", t, moved, results["copy_ceiling_GBps"], **base,
                                           layers=len(layers), err=round(err, 6)))
    except Exception as exc:
        results["rows"].append({"name": "fla-spec-chain", **base, "error": repr(exc)[:200]})


def time_verify(results, name, N, T, *, mode, conv):
    """One verify config timed over enough layers' pools to stream from HBM (a row named
    ``name``); returns the layers (for the commits) and the bytes of the verify's floor."""
    moved = N * STATE_BYTES * ((1 + T) if mode == "snapshot" else 1)
    nl = harness.layers_for(moved)
    layers = [make_layer(N, T, conv=conv, mode=mode, seed=i, slots=N * (T + 1) + 2) for i in range(nl)]
    t = harness.graph_time_us([verify_call(L) for L in layers])
    results["rows"].append(harness.row(name, t, moved, results["copy_ceiling_GBps"], num_spec=T - 1, N=N, layers=nl))
    return layers, moved


def ring_accept_lens(layers, T):
    """Run each ring-mode layer's verify (it fills the rings) and draw accept lengths 1 .. T."""
    for L in layers:
        verify_call(L)()
    N = layers[0]["slots"].shape[0]
    return [torch.randint(1, T + 1, (N,), device="cuda", dtype=torch.int32) for _ in layers]


def time_commit_ring(results, name, layers, accept, *, num_spec, N):
    """The ring commit of every layer in one graph; its floor reads and writes each state once."""
    t = harness.graph_time_us([
        (lambda L=L, acc=acc: commit_ring(L["state"], L["rings"], L["slots"], acc))
        for L, acc in zip(layers, accept)])
    results["rows"].append(harness.row(name, t, 2 * N * STATE_BYTES, results["copy_ceiling_GBps"],
                                       num_spec=num_spec, N=N, layers=len(layers)))


def timings(results, quick, commit_only=False, batches=None, tag="", skip_fla=False):
    ceiling = results["copy_ceiling_GBps"]
    batches = batches or ((8, 64) if quick else (1, 8, 64, 256))
    for num_spec in (1, 3, 7):
        T = 1 + num_spec
        for N in batches:
            base = {"num_spec": num_spec, "N": N}
            modes = (("snapshot", False), ("ring", False)) + (() if commit_only else (("snapshot", True),
                                                                                    ("ring", True)))
            for mode, conv in modes:
                layers, moved = time_verify(results, f"verify-{mode}{'-conv' if conv else ''}{tag}", N, T, mode=mode,
                                            conv=conv)
                nl = len(layers)
                if mode == "ring" and not conv:
                    time_commit_ring(results, f"commit-ring{tag}", layers, ring_accept_lens(layers, T), **base)
                if mode == "snapshot" and not conv:
                    for L in layers:
                        verify_call(L)()
                    steps = [torch.randint(0, T, (N,), device="cuda", dtype=torch.int32) for _ in layers]
                    t = harness.graph_time_us([
                        (lambda L=L, s=s: kdakit.commit_snapshots(L["state"], L["snapshots"], L["slots"],
                                                                  L["scratch_idx"], s))
                        for L, s in zip(layers, steps)])
                    results["rows"].append(harness.row(f"commit-snapshot{tag}", t, 2 * N * STATE_BYTES, ceiling, **base,
                                                       layers=nl))
                    if not skip_fla:  # timed once per sweep
                        time_fla_chain(results, layers, T, moved, base)
                del layers
                torch.cuda.empty_cache()


def ring_sweep(results, variants, batches):
    """Ring verify (no conv, then with it) at every batch for each variant, forced whatever
    the batch: "recurrent", "chunked" (kdakit/ops/ring_verify.py as configured),
    "chunked-pairwise" (its pair sums never factored), or the chunk
    form's "<precision>:<block_v>x<warps>:<k_chunk>:<stages>[:<steps kernel warps>]"; each
    checked against float64 before it is timed."""
    def ring_config(variant):
        """The variant's ring config from the shipped one (the pinned config of each call)."""
        if variant in ("recurrent", "chunked"):
            return lambda ring: ring
        if variant == "chunked-pairwise":  # the shipped chunk form, pair sums never factored
            return lambda ring: replace(ring, factored=False)
        precision, tile, k_chunk, stages, *steps_warps = variant.split(":")
        block_v, warps = (int(x) for x in tile.split("x"))
        return lambda ring: replace(ring, dot_precision=precision, state_block_v=block_v, state_warps=warps,
                                    k_chunk=int(k_chunk), num_stages=int(stages),
                                    steps_warps=int(steps_warps[0]) if steps_warps else ring.steps_warps)
    for variant in variants:
        form, ring = "recurrent" if variant == "recurrent" else "chunked", ring_config(variant)
        SWEEP_CONFIGS["verify"] = lambda *shapes, form=form, ring=ring: (
            lambda c: replace(c, ring_form=form, ring=ring(c.ring)))(mtp_verify_config(*shapes))
        for N, T, conv, norm in ((1, 2, True, False), (8, 4, True, True), (64, 8, False, False), (33, 4, True, False)):
            L = make_layer(N, T, conv=conv, mode="ring", norm=norm, seed=N * 10 + T)
            verify_call(L)()
            e_out = rel(L["out"], ref_verify(L, "ring")[0])
            results["checks"].append({"case": f"ring-{variant}-N{N}-T{T}-conv{int(conv)}-norm{int(norm)}",
                                      "out_err": e_out, "ok": e_out < 2e-2})
        for num_spec in (1, 3, 7):
            for N in batches:
                for conv in (False, True):
                    time_verify(results, f"verify-ring{'-conv' if conv else ''}-{variant}", N, 1 + num_spec,
                                mode="ring", conv=conv)
                    torch.cuda.empty_cache()


def commit_sweep(results, variants, batches):
    """The ring commit per variant "<tiles per program>[:<steps ahead>]" (kdakit/ops/commit.py
    CommitRingConfig.tiles, .steps_ahead) on the same verified layers, after the bitwise checks of each."""
    def use(variant):
        tiles, *ahead = (int(x) for x in variant.split(":"))
        SWEEP_CONFIGS["commit"] = lambda V, K, tiles=tiles, ahead=ahead: (
            lambda c: replace(c, tiles=tiles, steps_ahead=ahead[0] if ahead else c.steps_ahead))(
                commit_ring_config(V, K))
    for variant in variants:
        use(variant)
        commit_bitwise_checks(results, tag=f"-tiles{variant}")
    for num_spec in (1, 3, 7):
        T = 1 + num_spec
        for N in batches:
            moved = 2 * N * STATE_BYTES
            nl = harness.layers_for(moved)
            layers = [make_layer(N, T, conv=False, mode="ring", seed=i, slots=N * (T + 1) + 2) for i in range(nl)]
            accept = ring_accept_lens(layers, T)
            for variant in variants:
                use(variant)
                time_commit_ring(results, f"commit-ring-tiles{variant}", layers, accept, num_spec=num_spec, N=N)
            del layers
            torch.cuda.empty_cache()


def conv_sweep(results, variants, batches):
    """Verify with the short conv (ring and snapshot) for each conv prologue config
    "<channels per program>x<warps>[:wr0|:wr1]" (kdakit/ops/verify_conv.py), checked first."""
    for variant in variants:
        tile, *flags = variant.split(":")
        block_c, warps = (int(x) for x in tile.split("x"))
        # "wr0" / "wr1": windows stored per tap / as whole runs at every T (default: the rule)
        runs = {"wr0": False, "wr1": True}.get(flags[0]) if flags else None
        SWEEP_CONFIGS["verify"] = lambda *shapes, block_c=block_c, warps=warps, runs=runs: (
            lambda c: replace(c, conv=replace(c.conv, block_c=block_c, num_warps=warps,
                                              window_runs=c.conv.window_runs if runs is None else runs)))(
                mtp_verify_config(*shapes))
        correctness(results, tag=f"-conv{variant}")
        for num_spec in (1, 3, 7):
            for N in batches:
                for mode in ("ring", "snapshot"):
                    time_verify(results, f"verify-{mode}-conv-{variant}", N, 1 + num_spec, mode=mode, conv=True)
                    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--commit-only", action="store_true", help="time the commits (and their verifies) only")
    parser.add_argument("--batches", type=lambda x: tuple(int(n) for n in x.split(",")), default=None,
                        help="comma-separated N values (default 1,8,64,256; --quick 8,64)")
    parser.add_argument("--tile-bytes", type=lambda x: tuple(int(n) for n in x.split(",")), default=None,
                        help="sweep: bytes of state rows per program of the verify and ring commit "
                             "(kdakit.ops.mtp_verify.recurrence_tile); rows are tagged with it")
    parser.add_argument("--ring-sweep", type=lambda x: x.split(","), default=None,
                        help="time only the ring verify, per variant: recurrent, chunked, or "
                             "<tf32x3|tf32|ieee>:<BVxwarps>:<k_chunk>:<stages>[:<steps warps>]")
    parser.add_argument("--conv-sweep", type=lambda x: x.split(","), default=None,
                        help="time only the verifies with the conv, per conv prologue config <channels>x<warps>")
    parser.add_argument("--commit-tiles", type=lambda x: x.split(","), default=None,
                        help="time only the ring commit, per variant <tiles a program folds>[:<steps ahead>]")
    parser.add_argument("--name", default="mtp_h200")
    args = parser.parse_args()
    results = harness.new_results()
    if args.commit_tiles:
        commit_sweep(results, args.commit_tiles, args.batches or (64, 256))
    elif args.conv_sweep:
        conv_sweep(results, args.conv_sweep, args.batches or (1, 64))
    elif args.ring_sweep:
        ring_sweep(results, args.ring_sweep, args.batches or (1, 8, 64, 256))
    elif args.tile_bytes:
        for i, tile_bytes in enumerate(args.tile_bytes):
            # the verify and the ring commit on the same tile (a ring commit equals a snapshot commit bitwise)
            SWEEP_CONFIGS["verify"] = lambda N, T, hv, v, k, lb, tile_bytes=tile_bytes: replace(
                mtp_verify_config(N, T, hv, v, k, lb), **dict(zip(("block_v", "num_warps"),
                                                                  recurrence_tile(v, k, tile_bytes))))
            SWEEP_CONFIGS["commit"] = lambda v, k, tile_bytes=tile_bytes: replace(
                commit_ring_config(v, k), **dict(zip(("block_v", "num_warps"), recurrence_tile(v, k, tile_bytes))))
            correctness(results, tag=f"-tile{tile_bytes}")
            timings(results, args.quick, args.commit_only, args.batches, tag=f"-tile{tile_bytes}", skip_fla=i > 0)
    else:
        correctness(results)
        timings(results, args.quick, args.commit_only, args.batches)
    harness.close_results(results)
    path = harness.save(results, args.name, harness.results_folder(__file__))
    print(f"copy ceiling {results['copy_ceiling_GBps']} GB/s; saved {path}")
    harness.print_table(results["checks"], ["case", "ok", "out_err", "pool_err"])
    harness.print_table(results["rows"], ["name", "num_spec", "N", "us", "GB/s", "pct_of_copy", "layers", "err",
                                          "error"])
    bad = [c["case"] for c in results["checks"] if not c["ok"]]
    print("CHECKS FAILED:" if bad else "all checks ok", bad)


if __name__ == "__main__":
    main()
