"""Where the chunked prefill overtakes the token-by-token forward: the crossover KDALayer.prefill pins.

    python benchmarks/bench_prefill_crossover.py [--lengths 8,16,...] [--batches 1,8,64] [--name ...]

For each batch of N sequences of L tokens each (H = HV = 32, K = V = 128, bf16 activations,
float32 V-major pool, the default gate): kdakit.recurrent_forward and kdakit.chunk_prefill on
the same inputs and pool (each its picked launch config), CUDA-graph medians through
harness.graph_time_us. Before timing, both calls' outputs and final states are compared with
each other (they compute the same recurrence; the chunked one with bf16 factors and products as
picked for bf16 inputs). Reports µs for
each, their ratio, and for each N the smallest L from which the chunked call is faster at every
larger L measured; the JSON goes to benchmarks/results/ (or $OUT).
"""
from __future__ import annotations

import argparse
import sys

import torch

import kdakit
from kdakit.bench import harness
from kdakit.bench.prefill import make_layer


def call(forward, layer):
    L = layer
    return lambda: forward(L["q"], L["k"], L["v"], L["g"], L["beta"], L["state"], L["idx"], cu_seqlens=L["cu"],
                           A_log=L["A_log"], dt_bias=L["dt_bias"], beta_is_logit=True, out=L["out"])


def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def agreement(layer):
    """(output, state) relative differences between the two forwards on one layer."""
    before = layer["state"].clone()
    got = []
    for forward in (kdakit.recurrent_forward, kdakit.chunk_prefill):
        layer["state"].copy_(before)
        layer["out"].fill_(float("nan"))
        call(forward, layer)()
        torch.cuda.synchronize()
        got.append((layer["out"].clone(), layer["state"][layer["idx"].long()].clone()))
    layer["state"].copy_(before)
    return rel(got[1][0], got[0][0]), rel(got[1][1], got[0][1])


def crossover(rows, N):
    """The smallest L from which chunk_prefill is faster at every larger L measured (None: never)."""
    mine = sorted((r for r in rows if r["N"] == N and "ratio" in r), key=lambda r: r["L"])
    best = None
    for r in reversed(mine):
        if r["ratio"] >= 1.0:
            break
        best = r["L"]
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8,16,24,32,48,64,96,128,256,512")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--name", default="prefill_crossover_h200")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    results = harness.new_results()
    ok = True
    for N in (int(n) for n in args.batches.split(",")):
        for L in (int(n) for n in args.lengths.split(",")):
            layers = [make_layer([L] * N, args.H, args.H, seed=i) for i in range(2)]
            d_out, d_state = agreement(layers[0])
            good = d_out < 2e-2 and d_state < 2e-2
            ok = ok and good
            results["checks"].append({"N": N, "L": L, "out_diff": d_out, "state_diff": d_state, "ok": good})
            t_rec = harness.graph_time_us([call(kdakit.recurrent_forward, x) for x in layers])
            t_chunk = harness.graph_time_us([call(kdakit.chunk_prefill, x) for x in layers])
            row = {"N": N, "L": L, "tokens": N * L, "recurrent_us": round(t_rec, 2), "chunk_us": round(t_chunk, 2),
                   "ratio": round(t_chunk / t_rec, 3)}
            results["rows"].append(row)
            print(row, flush=True)
            del layers
    results["crossover_L"] = {str(N): crossover(results["rows"], N) for N in (int(n) for n in args.batches.split(","))}
    results["checks_ok"] = ok
    harness.close_results(results)
    path = harness.save(results, args.name, harness.results_folder(__file__))
    harness.print_table(results["rows"], ["N", "L", "tokens", "recurrent_us", "chunk_us", "ratio"])
    print("crossover L (chunk faster from):", results["crossover_L"], "checks ok:", ok, "->", path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
