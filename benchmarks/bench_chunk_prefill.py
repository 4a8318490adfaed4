"""Chunked varlen prefill on the GPU: correctness at real sizes, then timings against fla.

    python benchmarks/bench_chunk_prefill.py [--quick] [--sweep] [--cases NAME,...]

Checks first (each case before it is timed): kdakit.chunk_prefill against fla-core's
chunk_kda on the same inputs (bf16 activations, float32 pool), and, on the smaller
cases, both against the float64 token-by-token reference; a float32-input case where
both are measured against float64 (the accuracy comparison); the steep default gate
(log-decay down to about -20 per token in some channels); the pool slots not in the
batch bitwise untouched; a padding slot and an out-of-range slot.

Then times, HBM-resident through harness.graph_time_us (CUDA graphs; median replay per
layer; layers each with their own inputs and pool) in one process on the same inputs:
- ``kdakit``: kdakit.chunk_prefill on the V-major pool, in place;
- ``fla``: fla's chunk_kda as engines call it: gather the sequences' initial states from
  the pool (``state_v_first=True``, so no transpose), run, scatter the final states back
  with ``index_copy_``. If fla cannot be captured in a graph, it is timed eagerly with
  CUDA events over the same layers (``"timing": "eager"`` in its row).
Cases: one sequence of 2k, 8k, 32k tokens; varlen 8 x 2k, 64 x 512, mixed lengths;
H = HV = 32 and H = HV = 8; K = V = 128; default gate and safe gate (lower_bound -5).
Reports ms, tokens/s and TFLOP/s (nominal: the chunk-64 WY flops per token and head,
``2 (4 C K + 3 K V)`` with C = 64, the same count for both), and the copy ceiling of the
same run. JSON to benchmarks/results/ (or $OUT) via harness.save.

``--quick``: 2k and 8 x 2k at H = 32, both gates; only the checks at H = 32. ``--sweep``: also kdakit's alternative
launch configs (SWEEP below); ``--configs 'field=value,...;...'``: the given ones instead.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from kdakit import reference
from kdakit.bench import harness
from kdakit.bench.prefill import CASES, flops_per_token_head, make_layer, parse_cases  # one input builder
from kdakit.ops.chunk_prefill import ChunkConfig, chunk_config, chunk_prefill, chunk_prefill_triton

DEV = "cuda"


def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-30)) if torch.isfinite(x).all() else float("inf")


def ref_forward(layer, lower_bound):
    """float64 token-by-token reference on copies: (out, pool after)."""
    pool = layer["state"].double()
    out = torch.zeros(layer["out"].shape, dtype=torch.float64, device=DEV)
    reference.chunk_prefill(*(layer[n].double() for n in ("q", "k", "v", "g", "beta")), pool, layer["idx"], out,
                            cu_seqlens=layer["cu"], A_log=layer["A_log"].double(),
                            dt_bias=layer["dt_bias"].double(), lower_bound=lower_bound, beta_is_logit=True,
                            compute_dtype=torch.float64)
    return out, pool


def kdakit_call(layer, lower_bound, config=None):
    if config is None:
        return lambda: chunk_prefill(layer["q"], layer["k"], layer["v"], layer["g"], layer["beta"], layer["state"],
                                     layer["idx"], cu_seqlens=layer["cu"], A_log=layer["A_log"],
                                     dt_bias=layer["dt_bias"], lower_bound=lower_bound, beta_is_logit=True,
                                     out=layer["out"])
    K = layer["q"].shape[-1]
    return lambda: chunk_prefill_triton(layer["q"], layer["k"], layer["v"], layer["g"], layer["beta"],
                                        layer["state"], layer["idx"], layer["out"], cu_seqlens=layer["cu"],
                                        scale=K ** -0.5, use_qk_l2norm=True, A_log=layer["A_log"],
                                        dt_bias=layer["dt_bias"], lower_bound=lower_bound, beta_mode=1,
                                        has_initial_state=None, chunk_states=None, chunk_state_indices=None,
                                        config=config)


def fla_call(layer, lower_bound, use_graph=True):
    """fla's chunk_kda as an engine runs it on a V-major pool: gather, run, scatter back.
    ``use_graph``: fla's own CUDA-graph mode (its chunk list built on the device), so that
    the call captures; fla-plain (False) plans on the host."""
    from fla.ops.kda import chunk_kda
    idx = layer["idx"].long()
    cu = layer["cu"].long()
    layer["fla_out"] = None

    def call():
        h0 = layer["state"].index_select(0, idx).float()  # fla takes float32 initial states
        o, ht = chunk_kda(q=layer["q"], k=layer["k"], v=layer["v"], g=layer["g"], beta=layer["beta"],
                          A_log=layer["A_log"], dt_bias=layer["dt_bias"], initial_state=h0,
                          output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                          use_beta_sigmoid_in_kernel=True, safe_gate=lower_bound is not None,
                          lower_bound=lower_bound, state_v_first=True, cu_seqlens=cu,
                          **({"use_graph": True} if use_graph else {}))
        layer["state"].index_copy_(0, idx, ht.to(layer["state"].dtype))
        layer["fla_out"] = o
    return call


def timed(calls):
    """(µs, how): a CUDA-graph median when the calls capture, else eager events."""
    try:
        return harness.graph_time_us(calls, replays=10), "graph"
    except Exception as exc:  # noqa: BLE001  (fla's host-side planning may not capture)
        torch.cuda.synchronize()
        return harness.eager_time_us(calls), f"eager ({type(exc).__name__})"


# ----------------------------------------------------------------------------
# (name, seqlens, H, HV, act dtype, state dtype, lower_bound, steep, with float64 reference). Each row
# records the picked form (``picked``): the last four reach the chain forms picked for one long
# sequence with few heads (outputs after the chain; pieces) and 64- / 32-row tiles with bf16 products.
CHECK_CASES = [
    ("2k-f32in", [2048], 8, 8, torch.float32, torch.float32, None, False, True),
    ("mixed-f32in-safe", [1, 63, 64, 65, 700, 130], 8, 16, torch.float32, torch.float32, -5.0, False, True),
    ("2k-bf16", [2048], 32, 32, torch.bfloat16, torch.float32, None, False, True),
    ("mixed-bf16-safe", [1, 37, 100, 513, 64, 1000], 32, 32, torch.bfloat16, torch.float32, -5.0, False, True),
    ("steep-f32in-2k", [2048, 300], 4, 4, torch.float32, torch.float32, None, True, True),
    ("bf16-pool", [700, 33], 8, 8, torch.bfloat16, torch.bfloat16, None, False, True),
    ("8k-bf16", [8192], 32, 32, torch.bfloat16, torch.float32, None, False, False),
    ("4k-H8-after-chain", [4100], 8, 8, torch.bfloat16, torch.float32, None, False, True),
    ("8k-H8-pieces-safe", [8192], 8, 8, torch.bfloat16, torch.float32, -5.0, False, True),
    ("4x-bf16-64-rows", [300, 1, 700, 200], 32, 32, torch.bfloat16, torch.float32, None, False, True),
    ("2k-bf16-safe", [2048], 32, 32, torch.bfloat16, torch.float32, -5.0, False, True),
]


def picked_form(cfg) -> str:
    return (f"{cfg.block_v}-row tiles, {cfg.chain_dot_dtype} chain products, outputs {cfg.outputs}, "
            f"{cfg.chain_pieces} piece(s)")


def correctness(results, quick=False, configs=None, only=None):
    """``configs`` (the --configs text): ChunkConfig variants also run on every case with a float64 reference, their
    errors recorded beside the picked config's (``kdakit[variant]_out_err``; not part of ``ok``). ``only``: the
    names of the check cases to run (default: all)."""
    checks = results["checks"]
    cases = [c for c in CHECK_CASES if only is None or c[0] in only]
    if quick:  # the heads of the timed cases only (fla tunes itself again for other head counts)
        cases = [c for c in cases if c[0] in ("2k-bf16", "mixed-bf16-safe")]
    for name, lens, H, HV, ad, sd, lb, steep, with_ref in cases:
        layer = make_layer(lens, H, HV, 128, 128, state_dtype=sd, act_dtype=ad, steep=steep, seed=len(lens) + H)
        if len(lens) > 2:
            layer["idx"][1] = -1                      # a padding row
            layer["idx"][2] = layer["state"].shape[0] + 5  # out of range: padding too
        before = layer["state"].clone()
        picked = chunk_config(len(lens), HV, 128, 128, act_dtype=ad, T=sum(lens))
        row = {"case": name, "picked": picked_form(picked)}
        if with_ref:
            ref_out, ref_pool = ref_forward(layer, lb)
        for _ in range(2):  # the second call runs the cached launch path
            layer["state"].copy_(before)
            layer["out"].fill_(float("nan"))
            kdakit_call(layer, lb)()
        torch.cuda.synchronize()
        idx = layer["idx"].long()
        live = idx[(idx >= 0) & (idx < layer["state"].shape[0])]
        unused = torch.ones(layer["state"].shape[0], dtype=torch.bool, device=DEV)
        unused[live] = False
        row["untouched"] = torch.equal(layer["state"][unused], before[unused])
        ours_out, ours_pool = layer["out"].clone(), layer["state"].clone()
        if with_ref:
            row["kdakit_out_err"] = rel(ours_out, ref_out)
            row["kdakit_state_err"] = rel(ours_pool[live], ref_pool[live])
            for cfg in dict.fromkeys(harness.parse_configs(configs, ChunkConfig, base=picked)):
                if cfg == picked:
                    continue
                layer["state"].copy_(before)
                layer["out"].fill_(float("nan"))
                kdakit_call(layer, lb, cfg)()
                name = harness.config_name(cfg, picked)
                row[f"kdakit[{name}]_out_err"] = rel(layer["out"], ref_out)
                row[f"kdakit[{name}]_state_err"] = rel(layer["state"][live], ref_pool[live])
            layer["state"].copy_(ours_pool)
        try:
            layer["state"].copy_(before)
            if len(lens) > 2:  # fla has no padding rows: run it on the live sequences' slots only
                layer["idx"][1], layer["idx"][2] = int(unused.nonzero()[0]), int(unused.nonzero()[1])
            try:
                fla_call(layer, lb)()
            except Exception as exc:  # noqa: BLE001  (fla's graph mode refused: its plain call)
                row["fla_graph_mode_error"] = repr(exc)[:200]
                layer["state"].copy_(before)
                fla_call(layer, lb, use_graph=False)()
            torch.cuda.synchronize()
            fo = layer["fla_out"]
            keep = torch.ones(fo.shape[1], dtype=torch.bool, device=DEV)
            if len(lens) > 2:
                cu = layer["cu"].tolist()
                keep[cu[1]:cu[3]] = False
            row["kdakit_vs_fla_out"] = rel(ours_out[:, keep], fo[:, keep])
            if with_ref:
                row["fla_out_err"] = rel(fo[:, keep], ref_out[:, keep])
                row["fla_state_err"] = rel(layer["state"][live], ref_pool[live])
        except Exception as exc:  # noqa: BLE001
            row["fla_error"] = repr(exc)[:300]
        f32 = ad == torch.float32 and sd == torch.float32
        tol_out = 5e-3 if f32 else 2e-2  # float32 inputs: one-pass TF32 products (fla's error is ~1.2e-3 there)
        errs = [row.get("kdakit_out_err", 0.0), row.get("kdakit_state_err", 0.0)]
        row["ok"] = bool(row["untouched"] and all(e < tol_out for e in errs)
                         and row.get("kdakit_vs_fla_out", 0.0) < 3e-2)
        checks.append(row)
        print(row, flush=True)
    return all(c["ok"] for c in checks)


# --sweep: ChunkConfig fields changed from the picked config (harness.parse_configs syntax)
SWEEP = ("block_v=16,state_warps=4;block_v=32,state_warps=4;block_v=64,state_warps=8;"
         "block_v=16,pipeline_stages=1;block_v=32,pipeline_stages=2;"
         "chunk=32,block_v=32;chunk=32,block_v=64;split_prep=true;split_prep=true,prep_warps=8;"
         "prep_warps=8;slice_k=64;slice_k=16;dot_precision=tf32x3;")
SWEEP_FEW_CHAINS = "chain_pieces=4;chain_pieces=8;chain_pieces=16;"  # few (sequence, head) chains to cut
SWEEP_SAFE = "factor_safe_gate=false;"


def timings(results, names, sweep, configs=None):
    for name in names:
        lens, H = CASES[name]
        HV = H
        K = V = 128
        T = sum(lens)
        for lb in (None, -5.0):
            layers = [make_layer(lens, H, HV, K, V, seed=i) for i in range(2)]
            base = {"case": name, "T": T, "N": len(lens), "H": H, "HV": HV, "gate": "safe" if lb else "softplus"}
            variants = [("kdakit", lambda layer: kdakit_call(layer, lb))]
            picked = chunk_config(len(lens), HV, K, V, act_dtype=torch.bfloat16, T=T)
            text = configs if configs else (SWEEP + (SWEEP_FEW_CHAINS if len(lens) * HV <= 64 else "")
                                            + (SWEEP_SAFE if lb is not None else "")) if sweep else None
            for cfg in dict.fromkeys(harness.parse_configs(text, ChunkConfig, base=picked)):  # no repeats
                if cfg == picked:
                    continue
                variants.append((f"kdakit[{harness.config_name(cfg, picked)}]",
                                 lambda layer, cfg=cfg: kdakit_call(layer, lb, cfg)))
            variants.append(("fla", lambda layer: fla_call(layer, lb)))
            variants.append(("fla-plain", lambda layer: fla_call(layer, lb, use_graph=False)))
            fla_ok = False
            for vname, make in variants:
                if vname == "fla-plain" and fla_ok:
                    continue  # fla's graph mode ran: its plain call only when that failed
                try:
                    us, how = timed([make(layer) for layer in layers])
                except Exception as exc:  # noqa: BLE001
                    results["rows"].append({"name": vname, **base, "error": repr(exc)[:300]})
                    print(vname, base, repr(exc)[:300], flush=True)
                    continue
                fla_ok = fla_ok or vname == "fla"
                ms = us / 1e3
                tflops = flops_per_token_head(K, V) * T * HV / (us * 1e-6) / 1e12
                r = {"name": vname, **base, "ms": round(ms, 4), "tokens_per_s": round(T / (us * 1e-6)),
                     "TFLOP/s": round(tflops, 2), "timing": how}
                if vname == "kdakit":
                    r["config"] = str(chunk_config(len(lens), HV, K, V, act_dtype=torch.bfloat16, T=T))
                results["rows"].append(r)
                print(r, flush=True)
            del layers
            torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--cases", help="comma-separated case names: " + ",".join(CASES))
    parser.add_argument("--name", default="chunk_prefill_h200")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--check-cases", help="comma-separated check case names (default: all): "
                        + ",".join(c[0] for c in CHECK_CASES))
    parser.add_argument("--configs", help="ChunkConfig variants to time besides the picked one, as "
                        "'field=value,...;field=value' (fields not named keep the picked config's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    names = parse_cases(args.cases, args.quick)  # an unknown case name stops the run before the checks
    t0 = time.time()
    results = harness.new_results()
    only = None
    if args.check_cases:
        only = [c.strip() for c in args.check_cases.split(",") if c.strip()]
        unknown = [c for c in only if c not in {case[0] for case in CHECK_CASES}]
        if unknown:
            raise ValueError(f"unknown check case(s) {unknown}")
    ok = True if args.skip_checks else correctness(results, quick=args.quick, configs=args.configs, only=only)
    results["checks_ok"] = ok
    timings(results, names, args.sweep, args.configs)
    harness.close_results(results)
    results["wall_s"] = round(time.time() - t0, 1)
    path = harness.save(results, args.name + ("_quick" if args.quick else ""), harness.results_folder(__file__))
    harness.print_table(results["rows"], ["name", "case", "gate", "T", "N", "HV", "ms", "tokens_per_s", "TFLOP/s",
                                          "timing"])
    print("checks ok:", ok, "->", path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
