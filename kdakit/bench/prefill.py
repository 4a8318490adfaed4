"""`kdakit bench --prefill`: the chunked prefill (extend path) sweep behind one command.

For each case (sequence lengths and heads), gate and backend: kdakit.chunk_prefill on a
V-major float32 pool, in place, and, when fla-core is installed, fla's ``chunk_kda`` as an
engine calls it (gather the initial states from the pool, run, scatter the finals back).
K = V = 128, bf16 activations. Each (heads, gate) is first checked against the float64
recurrence on a small varlen batch. Times are CUDA-graph medians (harness.graph_time_us);
reported in ms, tokens/s and TFLOP/s (nominal chunk-64 WY flops, ``2 (4·64·K + 3·K·V)`` per
token and head, the same count for both). Prints a table, writes JSON and a PNG of tokens/s
per case. GPU only.
"""
from __future__ import annotations

import os
import time

K = V = 128
C_NOMINAL = 64
CASES = {  # name: (sequence lengths, H = HV)
    "1x2k": ([2048], 32), "1x8k": ([8192], 32), "1x32k": ([32768], 32),
    "8x2k": ([2048] * 8, 32), "64x512": ([512] * 64, 32),
    "mixed": ([17, 4000, 250, 1024, 3, 777, 2048, 96, 513, 1200], 32),
    "1x8k-H8": ([8192], 8), "8x2k-H8": ([2048] * 8, 8), "1x32k-H8": ([32768], 8),
}
QUICK = ("1x2k", "8x2k")
GATES = {"softplus": None, "safe": -5.0}


def parse_cases(text: str | None, quick: bool = False) -> list[str]:
    """Case names from a comma-separated list (default: all; ``quick``: QUICK)."""
    if not text:
        return list(QUICK if quick else CASES)
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise ValueError(f"unknown prefill case(s) {unknown}; choose from {', '.join(CASES)}.")
    return names


def flops_per_token_head(K: int = K, V: int = V, C: int = C_NOMINAL) -> int:
    return 2 * (4 * C * K + 3 * K * V)


def make_layer(seqlens, H, HV, K=K, V=V, *, device="cuda", state_dtype=None, act_dtype=None, steep=False, seed=0):
    """Sequences of ``seqlens`` tokens flattened to ``[1, T, ...]``; a pool with spare slots
    (``2 N + 2``), the sequences on a random permutation of them. ``steep``: some channels
    decay by about e^-20 a token (softplus(x) ~ x for the raw gate 6 + 2|x|). The inputs
    builder of kdakit/bench/inputs.py (``varlen_inputs``)."""
    import torch
    from .inputs import varlen_inputs
    return varlen_inputs(seqlens, H, HV, K, V, state_dtype=state_dtype or torch.float32,
                         act_dtype=act_dtype or torch.bfloat16, steep=steep, seed=seed, device=device)


def kdakit_call(layer, lower_bound, backend=None):
    import kdakit
    L = layer
    return lambda: kdakit.chunk_prefill(L["q"], L["k"], L["v"], L["g"], L["beta"], L["state"], L["idx"],
                                        cu_seqlens=L["cu"], A_log=L["A_log"], dt_bias=L["dt_bias"],
                                        lower_bound=lower_bound, beta_is_logit=True, out=L["out"], backend=backend)


def fla_call(layer, lower_bound):
    """fla's chunk_kda on the pool as an engine runs it (None when fla-core is not installed)."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    L = layer
    idx, cu = L["idx"].long(), L["cu"].long()

    def call():
        h0 = L["state"].index_select(0, idx).float()
        _, ht = chunk_kda(q=L["q"], k=L["k"], v=L["v"], g=L["g"], beta=L["beta"], A_log=L["A_log"],
                          dt_bias=L["dt_bias"], initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                          safe_gate=lower_bound is not None, lower_bound=lower_bound, state_v_first=True,
                          cu_seqlens=cu)
        L["state"].index_copy_(0, idx, ht.to(L["state"].dtype))
    return call


def check(H: int, lower_bound) -> float:
    """Relative error (outputs, final states) of kdakit.chunk_prefill against the float64
    recurrence on a small varlen batch of ``H`` heads."""
    import torch
    from .. import reference
    L = make_layer([300, 1, 65, 130], H, H, seed=H)
    pool = L["state"].double()
    ref = torch.zeros(L["out"].shape, dtype=torch.float64, device="cuda")
    reference.chunk_prefill(*(L[n].double() for n in ("q", "k", "v", "g", "beta")), pool, L["idx"], ref,
                            cu_seqlens=L["cu"], A_log=L["A_log"].double(), dt_bias=L["dt_bias"].double(),
                            lower_bound=lower_bound, beta_is_logit=True, compute_dtype=torch.float64)
    kdakit_call(L, lower_bound)()
    live = L["idx"].long()

    def rel(x, y):
        x, y = x.double(), y.double()
        return float((x - y).norm() / y.norm()) if torch.isfinite(x).all() else float("inf")
    return max(rel(L["out"], ref), rel(L["state"][live], pool[live]))


def run(names, gates=tuple(GATES), progress=print) -> dict:
    import torch
    from . import harness
    results = {"env": harness.environment(), "shape": {"K": K, "V": V, "state": "float32",
                                                       "activations": "bfloat16"}, "rows": [], "checks": []}
    results["copy_ceiling_GBps"] = round(harness.copy_ceiling_gbps(), 1)
    checked = {}
    for name in names:
        lens, H = CASES[name]
        T = sum(lens)
        for gate in gates:
            lb = GATES[gate]
            if (H, gate) not in checked:
                err = checked[(H, gate)] = check(H, lb)
                results["checks"].append({"H": H, "gate": gate, "err": float(f"{err:.2e}"), "ok": err < 2e-2})
                progress(f"check H={H} {gate}: rel err {err:.2e}")
            layers = [make_layer(lens, H, H, seed=i) for i in range(2)]
            for backend, make in (("kdakit", kdakit_call), ("fla", fla_call)):
                calls = [make(L, lb) for L in layers]
                if any(c is None for c in calls):
                    continue
                t0 = time.perf_counter()
                us = harness.graph_time_us(calls, replays=10)
                row = {"name": backend, "case": name, "gate": gate, "T": T, "N": len(lens), "H": H,
                       "ms": round(us / 1e3, 4), "tokens_per_s": round(T / (us * 1e-6)),
                       "TFLOP/s": round(flops_per_token_head() * T * H / (us * 1e-6) / 1e12, 2)}
                results["rows"].append(row)
                progress(f"{backend:6s} {name:9s} {gate:8s} {row['ms']:9.3f} ms {row['tokens_per_s']:>10d} tok/s "
                         f"{row['TFLOP/s']:7.2f} TFLOP/s  ({time.perf_counter() - t0:.1f} s)")
            del layers
            torch.cuda.empty_cache()
    results["copy_ceiling_GBps_end"] = round(harness.copy_ceiling_gbps(), 1)
    return results


def plot(results: dict, path: str) -> str | None:
    """Tokens/s per case and gate, one bar per backend; None when matplotlib is missing."""
    from .plotting import pyplot
    plt = pyplot()
    if plt is None:
        return None
    keys = list(dict.fromkeys((r["case"], r["gate"]) for r in results["rows"]))
    backends = list(dict.fromkeys(r["name"] for r in results["rows"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(keys) + 2), 4.5))
    width = 0.8 / max(1, len(backends))
    for b, backend in enumerate(backends):
        tps = {(r["case"], r["gate"]): r["tokens_per_s"] for r in results["rows"] if r["name"] == backend}
        ax.bar([i + b * width for i in range(len(keys))], [tps.get(key, 0) / 1e6 for key in keys], width,
               label=backend)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels([f"{c}\n{g}" for c, g in keys], fontsize=8)
    ax.set_ylabel("M tokens / s")
    ax.set_title(f"KDA chunked prefill, K=V={K}, {results['env'].get('gpu', '')}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args) -> int:
    from . import harness
    names = parse_cases(args.cases, args.quick)
    folder = args.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "kdakit-bench")
    results = run(names, progress=lambda line: print(line, flush=True))
    print()
    harness.print_table(results["rows"], ["name", "case", "gate", "T", "N", "H", "ms", "tokens_per_s", "TFLOP/s"])
    name = args.name if args.name != "kdakit_bench" else "kdakit_bench_prefill"
    path = harness.save(results, name, folder)
    print(f"copy ceiling {results['copy_ceiling_GBps']} GB/s (end {results['copy_ceiling_GBps_end']}); JSON: {path}")
    if not args.no_plot:
        png = plot(results, os.path.join(folder, f"{name}.png"))
        if png:
            print(f"plot: {png}")
    return 0 if all(c["ok"] for c in results["checks"]) else 1
