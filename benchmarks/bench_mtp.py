"""Speculative verify and commit on the GPU: checks at real sizes, then timings.

    python benchmarks/bench_mtp.py [--quick] [--batches 1,8,64,256] [--name mtp_h200]
    sweeps: --configs ['block_v=8,num_warps=1;block_v=16,num_warps=1'] |
            --ring-configs ['factored=false;state_block_v=32,state_warps=2'] |
            --conv-configs ['block_c=64,num_warps=2;block_c=128,num_warps=4'] |
            --commit-configs ['tiles=1,steps_ahead=1;tiles=2,steps_ahead=2']

Sweep configs in harness.parse_configs syntax: the config dataclass's fields (VerifyConfig,
RingVerifyConfig, VerifyConvConfig, CommitRingConfig), ``field=value`` joined by ``,``,
configs by ``;``; fields not named keep the config the op picks at each size. An option
alone runs its built-in list (SWEEP, RING_SWEEP, CONV_SWEEP, COMMIT_SWEEP below); rows and
checks are tagged ``[<config>]``.

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
from kdakit.bench.inputs import mtp_verify_inputs  # one inputs builder per op
from kdakit.ops.commit import CommitRingConfig, commit_ring_config, commit_ring_triton
from kdakit.ops.mtp_verify import VerifyConfig, mtp_verify_config, mtp_verify_triton
from kdakit.ops.ring_verify import RingVerifyConfig
from kdakit.ops.verify_conv import VerifyConvConfig

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
    """One layer at the bench's sizes (inputs.mtp_verify_inputs)."""
    return mtp_verify_inputs(N, T, H, HV, K, V, W=W, conv=conv, mode=mode, norm=norm, ring_len=ring_len, slots=slots,
                             seed=seed, device="cuda")


def verify_with(group=None, *, ring=None, conv=None, form=None):
    """A SWEEP_CONFIGS["verify"] picker: the op's config at the call's shapes with ``group``'s
    VerifyConfig fields, ``ring``'s RingVerifyConfig fields on its chunk-form config, ``conv``'s
    VerifyConvConfig fields on its conv prologue's (harness.parse_configs texts); ``form``
    forces the ring form ("chunked" or "recurrent") whatever the batch."""
    def pick(*shapes):
        config = mtp_verify_config(*shapes)
        if group:
            config = harness.parse_configs(group, VerifyConfig, base=config)[0]
        if ring:
            config = replace(config, ring=harness.parse_configs(ring, RingVerifyConfig, base=config.ring)[0])
        if conv:
            config = replace(config, conv=harness.parse_configs(conv, VerifyConvConfig, base=config.conv)[0])
        return replace(config, ring_form=form) if form else config
    return pick


def commit_with(group=None, verify_group=None):
    """A SWEEP_CONFIGS["commit"] picker: the ring commit's config with ``group``'s
    CommitRingConfig fields; ``verify_group``: on the verify's tile under that VerifyConfig text
    (a ring commit equals a snapshot commit bitwise on the verify's tile)."""
    def pick(v_dim, k_dim, ring_len=1):
        config = commit_ring_config(v_dim, k_dim, ring_len)
        if verify_group:
            tile = harness.parse_configs(verify_group, VerifyConfig, base=mtp_verify_config(1, 2, HV, v_dim, k_dim,
                                                                                             LOWER_BOUND))[0]
            config = replace(config, block_v=tile.block_v, num_warps=tile.num_warps)
        return harness.parse_configs(group, CommitRingConfig, base=config)[0] if group else config
    return pick


# Built-in sweeps (harness.parse_configs syntax: fields not named keep the picked config's), the
# lists of the last runs of each (benchmarks/results/mtp_*_h200.json); each option alone runs its list.
# --configs: the verify's recurrence tile (VerifyConfig), the ring commit on the same tile
# (4 KB and 8 KB of float32 state rows at K = 128).
SWEEP = "block_v=8,num_warps=1;block_v=16,num_warps=1"
# --ring-configs: the chunk form's RingVerifyConfig (mtp_ring_factored_pairs, mtp_ring_small_tiles_sweep).
RING_SWEEP = ("factored=false;" + ";".join(f"state_block_v={bv},state_warps={w},k_chunk={kc},num_stages={st}"
                                         for bv, w, kc, st in ((16, 1, 128, 1), (32, 2, 128, 1), (64, 4, 128, 1),
                                                               (16, 1, 32, 4), (32, 2, 32, 4), (16, 1, 64, 2))))
# --conv-configs: the conv prologue's VerifyConvConfig (mtp_conv_coalesced_ab).
CONV_SWEEP = "block_c=64,num_warps=2;block_c=128,num_warps=4;block_c=128,num_warps=4,window_runs=false"
# --commit-configs: the ring commit's CommitRingConfig (mtp_commit_steps_ahead).
COMMIT_SWEEP = ";".join(f"tiles={t},steps_ahead={a}" for t, a in ((1, 1), (1, 2), (2, 1), (2, 2)))


def sweep_groups(text, config_type):
    """``text``'s configs one by one (harness.config_groups), each parsed now against the
    config the op picks at the bench's sizes (N = 8, 4 steps, safe gate)."""
    bases = {VerifyConfig: lambda: mtp_verify_config(8, 4, HV, V, K, LOWER_BOUND),
             RingVerifyConfig: lambda: mtp_verify_config(8, 4, HV, V, K, LOWER_BOUND).ring,
             VerifyConvConfig: lambda: mtp_verify_config(8, 4, HV, V, K, LOWER_BOUND).conv,
             CommitRingConfig: lambda: commit_ring_config(V, K)}
    return harness.config_groups(text, config_type, base=bases[config_type]())


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
                              null_block_id=-1, config=pick(*state.shape[-2:], ring_len=rings[0].shape[-2]))


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


def ring_sweep(results, groups, batches):
    """Ring verify (no conv, then with it) at every batch, forced whatever the batch: the
    recurrent form, the chunk form as the op configures it ("chunked"), then the chunk form
    with each RingVerifyConfig text of ``groups`` (kdakit/ops/ring_verify.py); each checked
    against float64 before it is timed."""
    variants = [("recurrent", verify_with(form="recurrent")), ("chunked", verify_with(form="chunked"))] + [
        (group, verify_with(ring=group, form="chunked")) for group in groups]
    for variant, pick in variants:
        SWEEP_CONFIGS["verify"] = pick
        for N, T, conv, norm in ((1, 2, True, False), (8, 4, True, True), (64, 8, False, False), (33, 4, True, False)):
            L = make_layer(N, T, conv=conv, mode="ring", norm=norm, seed=N * 10 + T)
            verify_call(L)()
            e_out = rel(L["out"], ref_verify(L, "ring")[0])
            results["checks"].append({"case": f"ring[{variant}]-N{N}-T{T}-conv{int(conv)}-norm{int(norm)}",
                                      "out_err": e_out, "ok": e_out < 2e-2})
        for num_spec in (1, 3, 7):
            for N in batches:
                for conv in (False, True):
                    time_verify(results, f"verify-ring{'-conv' if conv else ''}[{variant}]", N, 1 + num_spec,
                                mode="ring", conv=conv)
                    torch.cuda.empty_cache()


def commit_sweep(results, groups, batches):
    """The ring commit per CommitRingConfig text of ``groups`` (kdakit/ops/commit.py: tiles,
    steps_ahead...) on the same verified layers, after the bitwise checks of each."""
    for group in groups:
        SWEEP_CONFIGS["commit"] = commit_with(group)
        commit_bitwise_checks(results, tag=f"-commit[{group}]")
    for num_spec in (1, 3, 7):
        T = 1 + num_spec
        for N in batches:
            moved = 2 * N * STATE_BYTES
            nl = harness.layers_for(moved)
            layers = [make_layer(N, T, conv=False, mode="ring", seed=i, slots=N * (T + 1) + 2) for i in range(nl)]
            accept = ring_accept_lens(layers, T)
            for group in groups:
                SWEEP_CONFIGS["commit"] = commit_with(group)
                time_commit_ring(results, f"commit-ring[{group}]", layers, accept, num_spec=num_spec, N=N)
            del layers
            torch.cuda.empty_cache()


def conv_sweep(results, groups, batches):
    """Verify with the short conv (ring and snapshot) for each VerifyConvConfig text of
    ``groups`` (kdakit/ops/verify_conv.py: block_c, num_warps, window_runs), checked first."""
    for group in groups:
        SWEEP_CONFIGS["verify"] = verify_with(conv=group)
        correctness(results, tag=f"-conv[{group}]")
        for num_spec in (1, 3, 7):
            for N in batches:
                for mode in ("ring", "snapshot"):
                    time_verify(results, f"verify-{mode}-conv[{group}]", N, 1 + num_spec, mode=mode, conv=True)
                    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--commit-only", action="store_true", help="time the commits (and their verifies) only")
    parser.add_argument("--batches", type=lambda x: tuple(int(n) for n in x.split(",")), default=None,
                        help="comma-separated N values (default 1,8,64,256; --quick 8,64)")
    syntax = "'field=value,...;field=value' (fields not named keep the picked config's; the option alone: "
    parser.add_argument("--configs", nargs="?", const=SWEEP, default=None,
                        help="sweep: VerifyConfig variants of the verify (block_v, num_warps: its recurrence tile; "
                             "ring_form), the ring commit on the same tile; rows tagged with each. " + syntax
                             + "SWEEP)")
    parser.add_argument("--ring-configs", nargs="?", const=RING_SWEEP, default=None,
                        help="time only the ring verify: the recurrent form, the chunk form, and the chunk form "
                             "with each RingVerifyConfig. " + syntax + "RING_SWEEP)")
    parser.add_argument("--conv-configs", nargs="?", const=CONV_SWEEP, default=None,
                        help="time only the verifies with the conv, per VerifyConvConfig. " + syntax + "CONV_SWEEP)")
    parser.add_argument("--commit-configs", nargs="?", const=COMMIT_SWEEP, default=None,
                        help="time only the ring commit, per CommitRingConfig. " + syntax + "COMMIT_SWEEP)")
    parser.add_argument("--name", default="mtp_h200")
    args = parser.parse_args()
    # every config parsed before anything runs (a wrong field fails here)
    verify_groups = sweep_groups(args.configs, VerifyConfig)
    ring_groups = sweep_groups(args.ring_configs, RingVerifyConfig)
    conv_groups = sweep_groups(args.conv_configs, VerifyConvConfig)
    commit_groups = sweep_groups(args.commit_configs, CommitRingConfig)
    results = harness.new_results()
    if commit_groups:
        commit_sweep(results, commit_groups, args.batches or (64, 256))
    elif conv_groups:
        conv_sweep(results, conv_groups, args.batches or (1, 64))
    elif args.ring_configs is not None:
        ring_sweep(results, ring_groups, args.batches or (1, 8, 64, 256))
    elif verify_groups:
        for i, group in enumerate(verify_groups):
            # the verify and the ring commit on the same tile (a ring commit equals a snapshot commit bitwise)
            SWEEP_CONFIGS["verify"] = verify_with(group)
            SWEEP_CONFIGS["commit"] = commit_with(verify_group=group)
            correctness(results, tag=f"[{group}]")
            timings(results, args.quick, args.commit_only, args.batches, tag=f"[{group}]", skip_fla=i > 0)
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
