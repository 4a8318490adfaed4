"""Per-kernel GPU times of kdakit.chunk_prefill and fla's chunk_kda (torch.profiler).

    python benchmarks/profile_chunk_prefill.py [--cases 2k,8x2k] [--fla] [--safe] [--configs 'field=value,...;...']

For each case and launch config: the mean GPU µs of every kernel a call launches, over
``reps`` eager calls after warm-up. Where the time goes decides what to tune.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from bench_chunk_prefill import fla_call, kdakit_call, make_layer  # noqa: E402

from kdakit.bench import harness  # noqa: E402
from kdakit.ops.chunk_prefill import ChunkConfig, chunk_config  # noqa: E402

# ChunkConfig fields changed from the picked config (harness.parse_configs syntax)
DEFAULT_CONFIGS = ("dot_precision=tf32x3;prep_warps=8;split_prep=true;"
                   + ";".join(f"block_v={bv},pipeline_stages={st}" for bv in (16, 32, 64) for st in (1, 2, 3))
                   + ";block_v=32,pipeline_stages=2,state_warps=4")

CASES = {"2k": [2048], "8x2k": [2048] * 8, "8k": [8192], "64x512": [512] * 64}


def kernel_times(call, reps=5):
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    # A kernel launched several times a call (the split prep's three launches) keeps its
    # launches apart: "name #i" for its i-th launch of each call, in launch order.
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    counts = defaultdict(int)
    for ev in events:
        counts[ev.name[:60]] += 1
    seen, per = defaultdict(int), defaultdict(float)
    for ev in events:
        name = ev.name[:60]
        per_call = max(1, counts[name] // reps)
        key = name if per_call == 1 else f"{name} #{seen[name] % per_call}"
        seen[name] += 1
        per[key] += ev.device_time / reps
    return dict(per)


def show(label, per):
    total = sum(per.values())
    print(f"{label:50s} total {total:9.1f} us", flush=True)
    for name, t in sorted(per.items(), key=lambda x: -x[1])[:8]:
        print(f"    {t:9.1f} us  {name}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="2k,8x2k")
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--safe", action="store_true", help="the safe gate (lower_bound -5)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="'' for the picked config alone")
    args = ap.parse_args()
    lb = -5.0 if args.safe else None
    for case in args.cases.split(","):
        L = make_layer(CASES[case], args.H, args.H, 128, 128)
        N = len(CASES[case])
        base = chunk_config(N, args.H, 128, 128, act_dtype=torch.bfloat16, T=sum(CASES[case]))
        variants = {"picked": base}
        for cfg in harness.parse_configs(args.configs, ChunkConfig, base=base):
            variants.setdefault(harness.config_name(cfg, base), cfg)
        for vname, cfg in variants.items():
            try:
                show(f"{case} H={args.H} kdakit {vname} {cfg}", kernel_times(kdakit_call(L, lb, cfg)))
            except Exception as exc:  # noqa: BLE001
                print(f"{case} {vname} failed: {exc!r}"[:300], flush=True)
        if args.fla:
            show(f"{case} H={args.H} fla (gather/scatter)", kernel_times(fla_call(L, lb)))


if __name__ == "__main__":
    main()
