"""The launcher's two paths on the GPU, in one process: host µs per eager packed-decode call
(the default checks included) on the fast path and on the public ``kernel[grid](...)``
fallback, outputs bitwise equal between them, and the graph-replayed GPU time of each (the
same kernels, so the same time).

    python benchmarks/bench_launcher.py [--name launcher_h200]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_packed_decode import kdakit_call  # noqa: E402

from kdakit.bench import harness  # noqa: E402
from kdakit.bench.inputs import packed_decode_inputs  # noqa: E402
from kdakit.ops import launch  # noqa: E402


def on_path(fast: bool, fn):
    saved = launch._FAST_PATH[0]
    launch._FAST_PATH[0] = fast
    try:
        return fn()
    finally:
        launch._FAST_PATH[0] = saved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="launcher_h200")
    args = parser.parse_args()
    results = harness.new_results(fast_path_default=launch.fast_path_enabled())
    ceiling = results["copy_ceiling_GBps"]
    # Bitwise: the same inputs through both paths.
    for N in (1, 33):
        outs = {}
        for fast in (True, False):
            layer = packed_decode_inputs(N, 32, 32, 128, 128, state_dtype=torch.float32, seed=5)
            on_path(fast, kdakit_call(layer))
            on_path(fast, kdakit_call(layer))
            torch.cuda.synchronize()
            outs[fast] = (layer["out"].clone(), layer["state"].clone())
        ok = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
        results["checks"].append({"case": f"fast-vs-public-bitwise-N{N}", "ok": ok})
    # Host cost per eager call at N = 1, alternated so that drift hits both paths alike.
    layer = packed_decode_inputs(1, 32, 32, 128, 128, state_dtype=torch.float32)
    call = kdakit_call(layer)
    host = {"fast": [], "public": []}
    for _ in range(3):
        host["fast"].append(on_path(True, lambda: harness.eager_host_us(call, iters=2000)))
        host["public"].append(on_path(False, lambda: harness.eager_host_us(call, iters=2000)))
    results["eager_us_N1"] = {k: round(min(v), 1) for k, v in host.items()}
    results["eager_us_N1_all"] = {k: [round(x, 1) for x in v] for k, v in host.items()}
    # GPU time from graphs: the launcher only issues the launch, so both paths time alike.
    for N in (8, 128):
        state_bytes = 32 * 128 * 128 * 4
        L = harness.layers_for(2 * N * state_bytes)
        layers = [packed_decode_inputs(N, 32, 32, 128, 128, state_dtype=torch.float32, seed=s) for s in range(L)]
        for fast in (True, False):
            t = on_path(fast, lambda layers=layers: harness.graph_time_us([kdakit_call(layer) for layer in layers]))
            results["rows"].append(harness.row("fast" if fast else "public", t, 2 * N * state_bytes, ceiling, N=N))
        del layers
        torch.cuda.empty_cache()
    harness.close_results(results)
    path = harness.save(results, args.name, harness.results_folder(__file__))
    print(f"copy ceiling {ceiling} GB/s; saved {path}")
    print("eager us/call N=1 (min of 3 x 2000):", results["eager_us_N1"], results["eager_us_N1_all"])
    harness.print_table(results["checks"], ["case", "ok"])
    harness.print_table(results["rows"], ["name", "N", "us", "GB/s", "pct_of_copy"])
    bad = [c["case"] for c in results["checks"] if not c["ok"]]
    print("CHECKS FAILED:" if bad else "all checks ok", bad)


if __name__ == "__main__":
    main()
