"""`kdakit bench`: the decode sweep of benchmarks/bench_packed_decode.py behind one command.

For each op (``packed_decode``, ``fused_decode``) and batch size, at Kimi sizes (H = HV = 32,
K = V = 128, float32 state pool, bf16 activations): one layer checked against the float64
reference, then timed HBM-resident (harness.graph_time_us: a CUDA graph over enough layers'
pools that the state streams from HBM). Prints a table, writes JSON and a PNG plot of GB/s
against batch size with the device-to-device copy ceiling (matplotlib: ``pip install
'kdakit[bench]'``). GPU only: without one it says so and exits 2.

``--peers``: kdakit beside the kernels the user's engine ships (kdakit/bench/peers.py: sglang's,
fla-core's), every row checked before it is timed; ``--peers --cpu-interpret`` runs its rows at
tiny sizes through Triton's interpreter on a machine without a GPU.

``--prefill``: the chunked-prefill sweep instead (kdakit/bench/prefill.py: ms, tokens/s and
TFLOP/s against fla's ``chunk_kda`` when fla-core is installed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .plotting import pyplot  # kdakit.bench.pyplot, as before

OPS = ("packed_decode", "fused_decode")
H = HV = 32
K = V = 128
W = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)}")
    p.add_argument("--batches", default="1,8,32,128,512", help="comma-separated batch sizes")
    p.add_argument("--quick", action="store_true", help="batches 8,128 only")
    p.add_argument("--out", default=None, help="folder for the JSON and PNG (default: $OUT, else ./kdakit-bench)")
    p.add_argument("--name", default="kdakit_bench", help="file name stem of the JSON and PNG")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--prefill", action="store_true", help="the chunked-prefill sweep (kdakit.chunk_prefill vs fla)")
    p.add_argument("--peers", action="store_true", help="kdakit against the engine kernels installed here "
                   "(sglang, fla-core): checks, then a table of times; --quick for a subset")
    from . import peers
    peers.add_arguments(p)
    p.add_argument("--cases", default=None, help="with --prefill: comma-separated cases (default: all; --quick: "
                   "1x2k,8x2k) from 1x2k, 1x8k, 1x32k, 8x2k, 64x512, mixed, 1x8k-H8, 8x2k-H8, 1x32k-H8")


def _make_layer(op: str, N: int, seed: int):
    """One layer's inputs at Kimi sizes (kdakit/bench/inputs.py: the builders the benchmark
    scripts and `kdakit check` use too); the fused step's conv pool as ``[slots, C, W-1]``."""
    from .inputs import fused_decode_inputs, packed_decode_inputs
    if op == "packed_decode":
        return packed_decode_inputs(N, H, HV, K, V, seed=seed)
    return fused_decode_inputs(N, H, HV, K, V, W=W, transposed_conv=False, seed=seed)


def _call(op: str, layer: dict, backend=None):
    import kdakit
    L = layer
    if op == "packed_decode":
        return lambda: kdakit.packed_decode(L["mixed"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"],
                                            L["idx"], L["out"], backend=backend)
    return lambda: kdakit.fused_decode(L["qkv"], L["conv_weight"], L["conv_state"], L["a"], L["b"], L["A_log"],
                                       L["dt_bias"], L["state"], L["idx"], norm_gate=L["norm_gate"],
                                       norm_weight=L["norm_weight"], out=L["out"], backend=backend)


def _moved_bytes(op: str, N: int) -> int:
    """Bytes that must cross HBM per call: the state read and written (plus, fused, the conv
    windows read and written). The floor the table reports is this over the copy ceiling."""
    state = 2 * N * HV * V * K * 4
    return state if op == "packed_decode" else state + 2 * N * (2 * H * K + HV * V) * (W - 1) * 2


def _check(op: str, layer: dict) -> float:
    """Relative error of one call (output and updated state) against the float64 reference;
    the layer's pools are restored afterwards."""
    import torch
    from .. import reference
    L = layer
    ref_state = L["state"].double()
    ref_out = torch.empty(L["out"].shape, dtype=torch.float64, device="cuda")
    if op == "packed_decode":
        reference.packed_decode(L["mixed"], L["a"], L["b"], L["A_log"], L["dt_bias"], ref_state, L["idx"], ref_out,
                                compute_dtype=torch.float64)
    else:
        reference.fused_decode(L["qkv"], L["conv_weight"], L["conv_state"].clone(), L["a"], L["b"], L["A_log"],
                               L["dt_bias"], ref_state, L["idx"], ref_out, norm_gate=L["norm_gate"],
                               norm_weight=L["norm_weight"], compute_dtype=torch.float64)
    before = {k: L[k].clone() for k in ("state", "conv_state") if k in L}
    _call(op, L)()
    live = L["idx"].long()

    def rel(x, y):
        x, y = x.double(), y.double()
        return float((x - y).norm() / y.norm()) if torch.isfinite(x).all() else float("inf")
    err = max(rel(L["out"], ref_out), rel(L["state"][live], ref_state[live]))
    for k, v in before.items():
        L[k].copy_(v)
    return err


def run(ops, batches, progress=print) -> dict:
    import torch
    from . import harness
    results = {"env": harness.environment(), "shape": {"H": H, "HV": HV, "K": K, "V": V, "state": "float32",
                                                       "activations": "bfloat16"}, "rows": []}
    ceiling = results["copy_ceiling_GBps"] = round(harness.copy_ceiling_gbps(), 1)
    progress(f"device-to-device copy ceiling: {ceiling} GB/s")
    total, done = len(ops) * len(batches), 0
    for op in ops:
        for N in batches:
            t0 = time.perf_counter()
            moved = _moved_bytes(op, N)
            num_layers = harness.layers_for(moved)
            layers = [_make_layer(op, N, seed=i) for i in range(num_layers)]
            err = _check(op, layers[0])
            t = harness.graph_time_us([_call(op, layer) for layer in layers])
            row = harness.row(op, t, moved, ceiling, N=N, layers=num_layers,
                              floor_us=round(moved / (ceiling * 1e3), 2), err=float(f"{err:.2e}"),
                              ok=err < 2e-2)
            results["rows"].append(row)
            done += 1
            progress(f"[{done:>2d}/{total}] {op:14s} N={N:<5d} {row['us']:>9.2f} us {row['GB/s']:>8.1f} GB/s "
                     f"({row['pct_of_copy']:.0f}% of copy)  err {err:.1e}  ({time.perf_counter() - t0:.1f} s)")
            del layers
            torch.cuda.empty_cache()
    results["copy_ceiling_GBps_end"] = round(harness.copy_ceiling_gbps(), 1)
    return results


def plot(results: dict, path: str) -> str | None:
    """GB/s against batch size per op, with the copy ceiling; None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r["name"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["name"] == op]
        ax.plot([r["N"] for r in rows], [r["GB/s"] for r in rows], marker="o", label=op)
    ax.axhline(results["copy_ceiling_GBps"], color="k", linestyle="--",
               label=f"copy ceiling {results['copy_ceiling_GBps']:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("GB/s (state bytes moved / time)")
    ax.set_title(f"KDA decode, H=HV={HV}, K=V={K}, fp32 state, {results['env']['gpu']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args, check=None) -> int:
    """``check``: ``kdakit.check.run``, for ``--peers`` (passed in from the command line above)."""
    import torch
    if getattr(args, "peers", False):
        from . import peers
        return peers.main(args, check=check)
    if not torch.cuda.is_available():
        print("kdakit bench: no CUDA GPU here; the benchmark times the Triton kernels on a GPU. "
              "Run `kdakit demo` or `kdakit check` on this machine instead.", file=sys.stderr)
        return 2
    if getattr(args, "prefill", False):
        from . import prefill
        try:
            prefill.parse_cases(args.cases, args.quick)
        except ValueError as error:
            print(f"kdakit bench: {error}", file=sys.stderr)
            return 2
        return prefill.main(args)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        print(f"kdakit bench: unknown op(s) {unknown}; choose from {', '.join(OPS)}.", file=sys.stderr)
        return 2
    batches = [8, 128] if args.quick else [int(b) for b in args.batches.split(",")]
    folder = args.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "kdakit-bench")
    results = run(ops, batches, progress=lambda line: print(line, flush=True))
    from . import harness
    print()
    harness.print_table(results["rows"], ["name", "N", "us", "floor_us", "GB/s", "pct_of_copy", "layers", "err",
                                          "ok"])
    path = harness.save(results, args.name, folder)
    print(f"copy ceiling {results['copy_ceiling_GBps']} GB/s (end {results['copy_ceiling_GBps_end']}); "
          f"JSON: {path}")
    if not args.no_plot:
        png = plot(results, os.path.join(folder, f"{args.name}.png"))
        if png:
            print(f"plot: {png}")
    return 0 if all(r["ok"] for r in results["rows"]) else 1
