"""Varlen short conv (the extend path) on the GPU: correctness, then bandwidth against the copy ceiling.

    python benchmarks/bench_conv1d_varlen.py [--quick] [--sweep] [--configs 'field=value,...;...'] [--name NAME]

Checks first, at real sizes: the float64 reference (varlen batches with short and padding
sequences, x as rows and as the transposed [C, T] view, transposed pools), a chain of one-token
causal_conv1d_update calls (bitwise), and a CUDA-graph replay against eager (bitwise). Then
times kdakit.causal_conv1d_varlen at T = 8192 tokens (one sequence; 8 x 1024; mixed lengths;
512 x 16, where every tile holds sequence starts) on C = 12288 channels (Kimi's q|k|v at
H = HV = 32, K = V = 128), bf16, W = 4, x as rows and as the transposed view, the pool
[slots, W-1, C] passed transposed; HBM-resident through harness.graph_time_us; bytes = x read
once + out written once + the windows read and written; % of the device-to-device copy.

``--configs``: Conv1dVarlenConfig variants timed besides the picked one, in harness.parse_configs
syntax (fields not named keep the picked config's, per x layout); ``--sweep``: SWEEP below
(per layout). Every variant's outputs and windows are compared bitwise with the picked config's.
``--quick``: the 8 x 1024 case only.
"""
from __future__ import annotations

import argparse
import sys

import torch

import kdakit
from kdakit import reference
from kdakit.bench import harness
from kdakit.ops.conv1d_varlen import (Conv1dVarlenConfig, causal_conv1d_varlen, causal_conv1d_varlen_triton,
                                      conv1d_varlen_config)

DEV = "cuda"
BF16 = torch.bfloat16


def make(lengths, C, W=4, *, layout="rows", pool_layout="transposed", spare=4, seed=0, dtype=BF16):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    N, T = len(lengths), sum(lengths)
    slots = N + spare
    x = (torch.randn(C, T, device=DEV, generator=gen).to(dtype).t() if layout == "transposed"
         else torch.randn(T, C, device=DEV, generator=gen).to(dtype))
    conv = (torch.randn(slots, W - 1, C, device=DEV, generator=gen).to(dtype).transpose(1, 2)
            if pool_layout == "transposed" else torch.randn(slots, C, W - 1, device=DEV, generator=gen).to(dtype))
    idx = torch.randperm(slots, device=DEV, generator=gen)[:N].to(torch.int32)
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return {"x": x, "conv_state": conv, "weight": torch.randn(C, W, device=DEV, generator=gen) * 0.5,
            "cu_seqlens": cu.to(DEV), "slot_indices": idx,
            "has_initial_state": torch.rand(N, device=DEV, generator=gen) < 0.7,
            "bias": torch.randn(C, device=DEV, generator=gen) * 0.1}


def call(t, out, config=None):
    if config is None:
        return causal_conv1d_varlen(t["x"], t["conv_state"], t["weight"], t["cu_seqlens"], t["slot_indices"],
                                    has_initial_state=t["has_initial_state"], bias=t["bias"], out=out)
    return causal_conv1d_varlen_triton(t["x"], t["conv_state"], t["weight"], t["cu_seqlens"], t["slot_indices"],
                                       out, has_initial_state=t["has_initial_state"], bias=t["bias"], config=config)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def checks():
    lines = []
    for layout in ("rows", "transposed"):
        for lengths in ([1, 2, 37, 3, 130, 1, 64, 9], [1] * 40, [513, 7, 250]):
            t = make(lengths, 1536, layout=layout, seed=len(lengths))
            t["slot_indices"][1] = -1
            ref_conv = t["conv_state"].double()
            ref_out = torch.empty(t["x"].shape, dtype=torch.float64, device=DEV)
            reference.causal_conv1d_varlen(t["x"].double(), ref_conv, t["weight"].double(), t["cu_seqlens"],
                                           t["slot_indices"], ref_out, has_initial_state=t["has_initial_state"],
                                           bias=t["bias"].double(), compute_dtype=torch.float64)
            out = torch.full_like(t["x"], float("nan"))
            call(t, out)
            err = rel(out, ref_out)
            live = t["slot_indices"][t["slot_indices"] >= 0].long()
            win_ok = torch.equal(t["conv_state"][live], ref_conv[live].to(BF16))
            lines.append(f"float64 reference, x {layout}, {len(lengths)} seqs: out rel err {err:.2e}, "
                         f"windows bitwise {win_ok}")
            assert err < 1e-2 and win_ok, lines[-1]
    # Bitwise against chained one-token updates (float32 and bf16, pool in x's dtype).
    for dtype in (torch.float32, BF16):
        t = make([5, 1, 2, 40, 3], 1024, dtype=dtype, pool_layout="contiguous", seed=7)
        t["has_initial_state"][:] = True
        chain_pool, chain_out = t["conv_state"].clone(), torch.empty_like(t["x"])
        bounds = t["cu_seqlens"].tolist()
        for n, slot in enumerate(t["slot_indices"].tolist()):
            for tok in range(bounds[n], bounds[n + 1]):
                kdakit.causal_conv1d_update(t["x"][tok:tok + 1], chain_pool, t["weight"],
                                            t["slot_indices"][n:n + 1], bias=t["bias"], out=chain_out[tok:tok + 1])
        out = torch.empty_like(t["x"])
        call(t, out)
        ok = torch.equal(out, chain_out) and torch.equal(t["conv_state"], chain_pool)
        lines.append(f"one-token update chain, {dtype}: bitwise {ok}")
        assert ok, lines[-1]
    # CUDA graph replay equals eager.
    t = make([300, 1, 77, 2], 12288, layout="transposed", seed=9)
    pool0 = t["conv_state"].clone()
    eager_out = torch.empty_like(t["x"])
    call(t, eager_out)
    eager_pool = t["conv_state"].clone()
    t["conv_state"].copy_(pool0)
    graph_out = torch.empty_like(t["x"])
    call(t, graph_out)  # warm (compiled) before capture
    t["conv_state"].copy_(pool0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(t, graph_out)
    t["conv_state"].copy_(pool0)
    graph_out.zero_()
    g.replay()
    torch.cuda.synchronize()
    ok = torch.equal(graph_out, eager_out) and torch.equal(t["conv_state"], eager_pool)
    lines.append(f"CUDA graph replay == eager: {ok}")
    assert ok, lines[-1]
    return lines


# --sweep: Conv1dVarlenConfig fields changed from the picked config (harness.parse_configs syntax)
SWEEP = {
    "rows": "block_t=8;block_t=32,block_c=256;block_t=32;block_c=512,num_warps=2;token_major=true;"
            # many small programs (8 tokens x 256 channels, 4-byte loads a thread at 4 warps: 48k
            # programs at 1 x 8192), as sglang's conv runs at 70-74% of the floor; not yet timed
            "block_t=8,block_c=256,num_warps=2;block_t=8,block_c=256,num_warps=1;"
            "form=rows,block_t=8,block_c=256,num_warps=2;form=rows,block_t=16,block_c=256,num_warps=2;"
            # the "rows" form (each input row loaded once): 215-225 µs against 203-211 for the picked
            # tile form (results/conv1d_varlen_sweep_h100.log)
            "form=rows,block_t=32,block_c=1024,num_warps=4;form=rows,block_t=32,block_c=512,num_warps=2",
    "transposed": "token_major=true;block_c=32;block_t=128;block_t=32,block_c=128",
}
T_TOKENS = 8192
MIXED = [2900, 1, 17, 700, 2048, 64, 5, 1200, 3, 1254]  # 8192 tokens: long, short, shorter than W-1
CASES = {"1x8192": [T_TOKENS], "8x1024": [1024] * 8, "mixed": MIXED, "512x16": [16] * 512}


def bench(quick, sweep, configs_text):
    ceiling = harness.copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    C, W = 12288, 4
    rows = []
    assert sum(MIXED) == T_TOKENS
    for case, lengths in CASES.items():
        if quick and case != "8x1024":
            continue
        T, N = sum(lengths), len(lengths)
        for layout in ("rows", "transposed"):
            nbytes = 2 * T * C * 2 + 2 * N * C * (W - 1) * 2
            L = harness.layers_for(nbytes, max_layers=64)
            layers = [make(lengths, C, W, layout=layout, seed=s) for s in range(L)]
            outs = [torch.empty_like(x["x"]) for x in layers]
            picked = conv1d_varlen_config(layers[0]["x"], C)
            text = ";".join(t for t in (configs_text, SWEEP[layout] if sweep else None) if t)
            configs = [picked] + [c for c in dict.fromkeys(harness.parse_configs(text, Conv1dVarlenConfig,
                                                                                 base=picked)) if c != picked]
            pool0 = layers[0]["conv_state"].clone()
            first = None
            for cfg in configs:
                arg = None if cfg == picked else cfg  # the picked one through the public entry
                us = harness.graph_time_us([lambda t=t, o=o, c=arg: call(t, o, c) for t, o in zip(layers, outs)])
                # one fresh call on layer 0 from the same pool: bits against the picked config's
                layers[0]["conv_state"].copy_(pool0)
                call(layers[0], outs[0], arg)
                got = (outs[0].clone(), layers[0]["conv_state"].clone())
                first = first or got
                same = bool(torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]))
                name = f"{case} x {layout} " + ("picked" if cfg == picked else harness.config_name(cfg, picked))
                r = harness.row(name, us, nbytes, ceiling, case=case, layout=layout, T=T, N=N, config=str(cfg),
                                bitwise_as_picked=same)
                rows.append(r)
                print(r, flush=True)
            del layers, outs
            torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--configs", default=None, help="Conv1dVarlenConfig variants besides the picked one, as "
                   "'field=value,...;field=value' (fields not named keep the picked config's)")
    p.add_argument("--name", default="conv1d_varlen_h200")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = harness.new_results()
    for line in checks():
        print(line, flush=True)
        results["checks"].append(line)
    results["rows"] = bench(args.quick, args.sweep, args.configs)
    harness.close_results(results)
    harness.print_table(results["rows"], ["name", "us", "GB/s", "pct_of_copy", "bitwise_as_picked"])
    print(harness.save(results, args.name + ("_quick" if args.quick else ""),
                       args.out or harness.results_folder(__file__)))
    return 0 if all(r["bitwise_as_picked"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
