"""Packed decode on the GPU: correctness at real sizes, CUDA-graph capture, then timings.

    python benchmarks/bench_packed_decode.py [--sweep] [--quick] [--configs 'block_v=8,v_tiles=2;...'] [--batches 1,32]

Checks every variant against the float64 reference before timing it; times
kdakit (pinned config, and with --sweep the PackedDecodeConfig variants of SWEEP, or
those of ``--configs`` in harness.parse_configs syntax: fields not named keep the config
the op picks at each size; rows ``kdakit[<config>]``), fla-core's serving path
(`fused_recurrent_kda_fwd` with `ssm_state_indices`, in place, `state_v_first`),
HBM-resident through harness.graph_time_us; writes JSON (harness.save).
"""
from __future__ import annotations

import argparse

import torch

import kdakit
from kdakit import reference
from kdakit.bench import harness
from kdakit.bench.inputs import packed_decode_inputs  # one inputs builder per op
from kdakit.ops.packed_decode import PackedDecodeConfig, packed_decode_config, packed_decode_triton


def ref_decode(layer, lower_bound=None, use_qk_l2norm=True):
    st = layer["state"].double()
    out = torch.empty(layer["out"].shape, dtype=torch.float64, device="cuda")
    reference.packed_decode(layer["mixed"].double(), layer["a"].double(), layer["b"].double(),
                            layer["A_log"].double(), layer["dt_bias"].double(), st, layer["idx"], out,
                            lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm, compute_dtype=torch.float64)
    return out, st


def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm()) if torch.isfinite(x).all() else float("inf")


def kdakit_call(layer, lower_bound=None, config=None):
    if config is None:
        return lambda: kdakit.packed_decode(layer["mixed"], layer["a"], layer["b"], layer["A_log"],
                                            layer["dt_bias"], layer["state"], layer["idx"], layer["out"],
                                            lower_bound=lower_bound)
    K = layer["state"].shape[-1]
    return lambda: packed_decode_triton(layer["mixed"], layer["a"], layer["b"], layer["A_log"], layer["dt_bias"],
                                        layer["state"], layer["idx"], layer["out"], scale=K ** -0.5,
                                        use_qk_l2norm=True, lower_bound=lower_bound, config=config)


def fla_call(layer, H):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    N = layer["mixed"].shape[0]
    _, HV, V, K = layer["state"].shape
    q, k, v = reference.split_packed_qkv(layer["mixed"], H, K, HV, V)
    q, k, v = (t.contiguous().view(N, 1, *t.shape[1:]) for t in (q, k, v))
    gate = layer["a"].view(N, 1, HV, K)
    beta = layer["b"].view(N, 1, HV)
    out = torch.empty(N, 1, HV, V, device="cuda", dtype=layer["out"].dtype)
    layer["fla_out"] = out

    def call():
        fused_recurrent_kda_fwd(q=q, k=k, v=v, g=gate, beta=beta, A_log=layer["A_log"], dt_bias=layer["dt_bias"],
                                initial_state=layer["state"], scale=K ** -0.5, output_final_state=True,
                                inplace_final_state=True, state_v_first=True, ssm_state_indices=layer["idx"],
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, out=out)
    return call


# ----------------------------------------------------------------------------
def correctness(results):
    """Real sizes against float64; unused slots and padding rows checked."""
    cases = [  # (N, H, HV, K, V, state dtype, lower_bound, padding)
        (1, 32, 32, 128, 128, torch.float32, None, 0),
        (64, 32, 32, 128, 128, torch.float32, -5.0, 5),
        (1024, 12, 12, 128, 128, torch.float32, None, 17),
        (256, 32, 32, 128, 128, torch.bfloat16, None, 3),
        (256, 32, 32, 128, 128, torch.float16, -1.0, 0),
        (48, 4, 16, 128, 128, torch.float32, None, 2),
        (48, 8, 8, 64, 256, torch.float32, None, 2),
        (48, 8, 8, 256, 96, torch.float32, -2.0, 2),
    ]
    for N, H, HV, K, V, sd, lb, pad in cases:
        layer = packed_decode_inputs(N, H, HV, K, V, state_dtype=sd, seed=N + HV)
        if pad:
            layer["idx"][torch.randperm(N, device="cuda")[:pad]] = -1
        before = layer["state"].clone()
        ref_out, ref_state = ref_decode(layer, lb)
        layer["out"].fill_(float("nan"))
        kdakit_call(layer, lb)()  # first call of a shape compiles; run again from the same state
        layer["state"].copy_(before)  # so the cached launch path is the one checked
        layer["out"].fill_(float("nan"))
        kdakit_call(layer, lb)()
        live = layer["idx"][layer["idx"] >= 0].long()
        unused = torch.ones(layer["state"].shape[0], dtype=torch.bool, device="cuda")
        unused[live] = False
        ok_untouched = torch.equal(layer["state"][unused], before[unused])
        pad_zero = bool((layer["out"][layer["idx"] < 0] == 0).all())
        e_out, e_state = rel(layer["out"], ref_out), rel(layer["state"][live], ref_state[live])
        tol = 1e-5 if sd == torch.float32 else 1e-2
        ok = e_out < 2e-2 and e_state < tol and ok_untouched and pad_zero  # out is bf16
        results["checks"].append({"case": f"N{N}-H{H}-HV{HV}-K{K}-V{V}-{str(sd)[6:]}-lb{lb}-pad{pad}",
                                  "out_err": e_out, "state_err": e_state, "untouched": ok_untouched,
                                  "padding_zero": pad_zero, "ok": ok})
    # A pool of more than 2**31 elements: offsets must be 64-bit.
    HV, K, V = 32, 128, 128
    slots = (2 ** 31) // (HV * V * K) + 16
    layer = packed_decode_inputs(4, 32, HV, K, V, state_dtype=torch.float32, spare_slots=0)
    layer["state"] = torch.randn(slots, HV, V, K, device="cuda")
    layer["idx"] = torch.tensor([slots - 1, 3, slots - 9, slots - 2], device="cuda", dtype=torch.int32)
    ref_out, ref_state = ref_decode(layer)
    kdakit_call(layer)()
    live = layer["idx"].long()
    e = max(rel(layer["out"], ref_out), rel(layer["state"][live], ref_state[live]) * 1e3)
    results["checks"].append({"case": f"pool-{slots}-slots-over-2^31-elements", "err": e, "ok": e < 2e-2})
    del layer, ref_state
    torch.cuda.empty_cache()
    # CUDA graph: capture once, replay with new inputs, compare with eager.
    layer = packed_decode_inputs(16, 32, 32, 128, 128, state_dtype=torch.float32)
    call = kdakit_call(layer)
    harness.graph_time_us([call], replays=1)  # warm + capture path exercised
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    fresh = packed_decode_inputs(16, 32, 32, 128, 128, state_dtype=torch.float32, seed=99)
    for key in ("mixed", "a", "b", "A_log", "dt_bias", "state", "idx"):
        layer[key].copy_(fresh[key])
    graph.replay()
    kdakit_call(fresh)()
    ok = torch.equal(layer["out"], fresh["out"]) and torch.equal(layer["state"], fresh["state"])
    results["checks"].append({"case": "cuda-graph-replay-new-inputs-bitwise-eager", "ok": ok})


# --sweep: PackedDecodeConfig fields changed from the picked config (harness.parse_configs
# syntax); the next tile's load is in flight while one computes whatever num_stages (static
# loop); no cache hint (evict_first is slower: docs/tuning.md).
SWEEP = ("block_v=4,v_tiles=1;block_v=4,v_tiles=2;block_v=8,v_tiles=1;block_v=8,v_tiles=2;block_v=8,v_tiles=4;"
         "block_v=16,v_tiles=1;block_v=16,v_tiles=2;"
         # bf16 pools (82% of the copy floor at N = 512 against sglang's 92%, issue 51): more state
         # bytes per program for the same q/k/gate prologue (not yet timed)
         "block_v=16,v_tiles=4;block_v=32,v_tiles=1;block_v=32,v_tiles=2;block_v=32,v_tiles=1,num_warps=2;"
         "block_v=64,v_tiles=1,num_warps=2;block_v=64,v_tiles=1,num_warps=4")


def sweep_groups(configs=None, sweep=False):
    """The variants to time (harness.config_groups: each checked against the dataclass now)."""
    return harness.config_groups(configs or (SWEEP if sweep else None), PackedDecodeConfig,
                                 base=packed_decode_config(8, 32, 128, 128, 4))


def timings(results, groups, quick: bool, only_fp32=False, batches=None):
    """``groups``: PackedDecodeConfig variants (sweep_groups), each applied to the config the op
    picks at every size, timed on the HV = 32 pools; ``only_fp32``: the float32 HV = 32 pool alone."""
    ceiling = results["copy_ceiling_GBps"]
    batches = batches or ([1, 8, 32, 128, 512] if not quick else [8, 128])
    pools = ((32, (torch.float32,)),) if only_fp32 else ((32, (torch.float32, torch.bfloat16)), (12, (torch.float32,)))
    for HV, dtypes in pools:
        H, K, V = HV, 128, 128
        for sd in dtypes:
            state_bytes = HV * V * K * sd.itemsize
            for N in batches:
                if sd != torch.float32 and N < 32:
                    continue
                num_layers = harness.layers_for(N * state_bytes)
                layers = [packed_decode_inputs(N, H, HV, K, V, state_dtype=sd, seed=i) for i in range(num_layers)]
                moved = 2 * N * state_bytes
                floor_us = moved / (ceiling * 1e3)
                base = {"HV": HV, "N": N, "state": str(sd)[6:], "layers": num_layers, "floor_us": round(floor_us, 2)}
                # check one layer of each implementation before timing it
                ref_out, ref_state = ref_decode(layers[0])
                snap = layers[0]["state"].clone()
                picked = packed_decode_config(N, HV, V, K, sd.itemsize)
                variants = [("kdakit", None)] + [(f"kdakit[{group}]", harness.parse_configs(
                    group, PackedDecodeConfig, base=picked)[0]) for group in groups if HV == 32]
                for name, cfg in variants:
                    layers[0]["state"].copy_(snap)
                    kdakit_call(layers[0], config=cfg)()
                    live = layers[0]["idx"].long()
                    err = max(rel(layers[0]["out"], ref_out), rel(layers[0]["state"][live], ref_state[live]))
                    t = harness.graph_time_us([kdakit_call(layer, config=cfg) for layer in layers])
                    results["rows"].append(harness.row(name, t, moved, ceiling, **base, err=round(err, 7)))
                if sd == torch.float32:
                    try:
                        layers[0]["state"].copy_(snap)
                        fla_call(layers[0], H)()
                        live = layers[0]["idx"].long()
                        err = max(rel(layers[0]["fla_out"], ref_out), rel(layers[0]["state"][live], ref_state[live]))
                        t = harness.graph_time_us([fla_call(layer, H) for layer in layers])
                        results["rows"].append(harness.row("fla", t, moved, ceiling, **base, err=round(err, 7)))
                    except Exception as exc:  # the peer is optional on the device
                        results["rows"].append({"name": "fla", **base, "error": repr(exc)[:200]})
                del layers
                torch.cuda.empty_cache()
    # eager host cost of one call at N = 1 (validation included)
    layer = packed_decode_inputs(1, 32, 32, 128, 128, state_dtype=torch.float32)
    results["eager_us_N1"] = {"kdakit": round(harness.eager_host_us(kdakit_call(layer)), 1)}
    results["eager_us_N1"].update(eager_breakdown(layer))
    try:
        results["eager_us_N1"]["fla"] = round(harness.eager_host_us(fla_call(layer, 32)), 1)
    except Exception as exc:
        results["eager_us_N1"]["fla"] = repr(exc)[:200]


def eager_breakdown(layer):
    """Host µs of each piece of one eager call: contract checks, backend choice, Triton launch."""
    from kdakit import backends
    from kdakit.ops import packed_decode as mod
    args = (layer["mixed"], layer["a"], layer["b"], layer["A_log"], layer["dt_bias"], layer["state"], layer["out"],
            layer["idx"])
    parts = {
        "checks": lambda: mod.check_packed_decode(*args),
        "select": lambda: backends.select("packed_decode", layer["mixed"].device),
        "triton_impl": lambda: mod.packed_decode_triton(layer["mixed"], layer["a"], layer["b"], layer["A_log"],
                                                        layer["dt_bias"], layer["state"], layer["idx"], layer["out"],
                                                        scale=0.08, use_qk_l2norm=True, lower_bound=None),
    }
    times = {name: round(harness.eager_host_us(fn, iters=2000), 2) for name, fn in parts.items()}
    import cProfile
    import pstats
    call = kdakit_call(layer)
    profile = cProfile.Profile()
    profile.runcall(lambda: [call() for _ in range(2000)])
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time the PackedDecodeConfig variants of SWEEP too")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="packed_decode_h200")
    parser.add_argument("--configs", help="PackedDecodeConfig variants to time instead of SWEEP, as "
                        "'field=value,...;field=value' (fields not named keep the picked config's; "
                        "the float32 HV = 32 pool only)")
    parser.add_argument("--batches", help="N,N,...")
    args = parser.parse_args()
    groups = sweep_groups(args.configs, args.sweep)  # a wrong field fails here, before the checks
    batches = [int(n) for n in args.batches.split(",")] if args.batches else None
    results = harness.new_results()
    correctness(results)
    bad = [c for c in results["checks"] if not c["ok"]]
    timings(results, groups, args.quick, bool(args.configs), batches)
    harness.close_results(results)
    path = harness.save(results, args.name, harness.results_folder(__file__))
    print(f"copy ceiling {results['copy_ceiling_GBps']} GB/s (end {results['copy_ceiling_GBps_end']}); saved {path}")
    print("eager us/call N=1:", results["eager_us_N1"])
    harness.print_table(results["checks"], ["case", "ok", "out_err", "state_err", "err"])
    harness.print_table(results["rows"], ["name", "HV", "N", "state", "us", "floor_us", "GB/s", "pct_of_copy", "err"])
    print("CHECKS FAILED:" if bad else "all checks ok", [c["case"] for c in bad])


if __name__ == "__main__":
    main()
