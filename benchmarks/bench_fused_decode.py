"""Fused decode on the GPU: correctness at real sizes, then fused vs the unfused chain.

    python benchmarks/bench_fused_decode.py [--quick] [--sweep one|chain] [--name NAME]

Checks `fused_decode` against the float64 reference (and against the unfused chain of
public ops causal_conv1d_update -> packed_decode -> gated_rmsnorm) at Kimi sizes (H = HV =
32, K = V = 128, bf16 activations and conv windows, float32 state pool), the one-kernel
step and the chain of dependent launches on their own, then times, HBM-resident through
harness.graph_time_us: `fused_decode` as it dispatches (with and without the output norm),
the one-kernel step, the chain of public ops, the op's chain with and without dependent
launches, and packed decode alone (post-conv inputs, no norm: the recurrence's floor).
Writes JSON (harness.save) and prints a table last.
"""
from __future__ import annotations

import argparse

import torch

from kdakit import reference
from kdakit.bench import harness
from kdakit.ops.conv1d_update import Conv1dUpdateConfig, causal_conv1d_update
from kdakit.ops.fused_decode import fused_decode
from kdakit.ops.gated_rmsnorm import gated_rmsnorm
from kdakit.ops.packed_decode import packed_decode

W = 4  # Kimi short conv width


def make_layer(N, H, HV, K, V, *, state_dtype=torch.float32, act_dtype=torch.bfloat16, conv_dtype=torch.bfloat16,
               transposed_conv=True, spare_slots=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    slots = N + (spare_slots if spare_slots is not None else max(N, 2))
    C = 2 * H * K + HV * V
    if transposed_conv:  # stored [slots, W-1, C], passed as a [slots, C, W-1] view
        conv = torch.randn(slots, W - 1, C, device=dev, generator=g).to(conv_dtype).transpose(1, 2)
    else:
        conv = torch.randn(slots, C, W - 1, device=dev, generator=g).to(conv_dtype)
    return {
        "qkv": torch.randn(N, C, device=dev, generator=g).to(act_dtype),
        "conv_weight": torch.randn(C, W, device=dev, generator=g) * 0.5,
        "conv_state": conv,
        "a": torch.randn(N, HV * K, device=dev, generator=g).to(act_dtype),
        "b": torch.randn(N, HV, device=dev, generator=g).to(act_dtype),
        "A_log": torch.rand(HV, device=dev, generator=g) * 2 - 1,
        "dt_bias": torch.randn(HV * K, device=dev, generator=g) * 0.5,
        "state": (torch.randn(slots, HV, V, K, device=dev, generator=g) * 0.5).to(state_dtype),
        "idx": torch.randperm(slots, device=dev, generator=g)[:N].to(torch.int32),
        "norm_gate": torch.randn(N, HV * V, device=dev, generator=g).to(act_dtype),
        "norm_weight": torch.rand(V, device=dev, generator=g) + 0.5,
        "out": torch.empty(N, 1, HV, V, device=dev, dtype=act_dtype),
        # unfused chain buffers
        "mixed": torch.empty(N, C, device=dev, dtype=act_dtype),
        "o": torch.empty(N, 1, HV, V, device=dev, dtype=act_dtype),
        "y": torch.empty(N, 1, HV, V, device=dev, dtype=act_dtype),
    }


def fused_call(layer, norm=True, lower_bound=None):
    kw = dict(norm_gate=layer["norm_gate"], norm_weight=layer["norm_weight"]) if norm else {}
    return lambda: fused_decode(layer["qkv"], layer["conv_weight"], layer["conv_state"], layer["a"], layer["b"],
                                layer["A_log"], layer["dt_bias"], layer["state"], layer["idx"], out=layer["out"],
                                lower_bound=lower_bound, **kw)


def chain_call(layer, norm=True, lower_bound=None):
    N, _, HV, V = layer["out"].shape

    def call():
        causal_conv1d_update(layer["qkv"], layer["conv_state"], layer["conv_weight"], layer["idx"], out=layer["mixed"])
        packed_decode(layer["mixed"], layer["a"], layer["b"], layer["A_log"], layer["dt_bias"], layer["state"],
                      layer["idx"], layer["o"], lower_bound=lower_bound)
        if norm:
            gated_rmsnorm(layer["o"], layer["norm_gate"].view(N, 1, HV, V), layer["norm_weight"], out=layer["y"])
    return call


def dependent_chain_call(layer, norm=True, pdl=True, conv_config=None, decode_config=None, **chain_kw):
    """The op's own unfused chain, each kernel a programmatic dependent launch of the one before."""
    from kdakit.ops.fused_decode import _unfused_chain
    from kdakit.ops.gated_rmsnorm import GatedRMSNormConfig
    from kdakit.ops.packed_decode import PackedDecodeConfig
    conv_config = Conv1dUpdateConfig(*conv_config) if conv_config is not None else None
    decode_config = PackedDecodeConfig(*decode_config) if decode_config is not None else None
    if chain_kw.get("norm_config") is not None:  # the sweeps' tuples, as configs
        chain_kw = dict(chain_kw, norm_config=GatedRMSNormConfig(*chain_kw["norm_config"]))
    kw = dict(norm_gate=layer["norm_gate"], norm_weight=layer["norm_weight"]) if norm else dict(norm_gate=None,
                                                                                                 norm_weight=None)
    K = layer["state"].shape[-1]
    return lambda: _unfused_chain(layer["qkv"], layer["conv_weight"], layer["conv_state"], layer["a"], layer["b"],
                                  layer["A_log"], layer["dt_bias"], layer["state"], layer["idx"], layer["out"],
                                  conv_bias=None, scale=K ** -0.5, lower_bound=None, norm_eps=1e-6, pdl=pdl,
                                  conv_config=conv_config, decode_config=decode_config, **chain_kw, **kw)


def packed_call(layer):
    # post-conv inputs are the raw qkv here: the recurrence alone, for the floor it sets
    return lambda: packed_decode(layer["qkv"], layer["a"], layer["b"], layer["A_log"], layer["dt_bias"],
                                 layer["state"], layer["idx"], layer["o"])


def ref_fused(layer, norm=True, lower_bound=None):
    st, conv = layer["state"].double(), layer["conv_state"].double()
    out = torch.empty(layer["out"].shape, dtype=torch.float64, device="cuda")
    kw = dict(norm_gate=layer["norm_gate"].double(), norm_weight=layer["norm_weight"].double()) if norm else {}
    reference.fused_decode(layer["qkv"].double(), layer["conv_weight"].double(), conv, layer["a"].double(),
                           layer["b"].double(), layer["A_log"].double(), layer["dt_bias"].double(), st, layer["idx"],
                           out, lower_bound=lower_bound, compute_dtype=torch.float64, **kw)
    return out, st, conv


def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm()) if torch.isfinite(x).all() else float("inf")


# ----------------------------------------------------------------------------
def correctness(results):
    """Kimi sizes against float64 and against the unfused chain; unused slots and padding checked."""
    cases = [  # (N, norm, lower_bound, padding, transposed conv pool)
        (1, True, None, 0, True),
        (32, True, -5.0, 3, True),
        (32, False, None, 0, False),
        (256, True, None, 7, False),
        (256, False, -1.0, 0, True),
    ]
    H = HV = 32
    K = V = 128
    for N, norm, lb, pad, transposed in cases:
        layer = make_layer(N, H, HV, K, V, transposed_conv=transposed, seed=N + pad)
        if pad:
            layer["idx"][torch.randperm(N, device="cuda")[:pad]] = -1
        state0, conv0 = layer["state"].clone(), layer["conv_state"].clone()
        ref_out, ref_state, ref_conv = ref_fused(layer, norm, lb)
        for _ in range(2):  # first call of a shape compiles; check the cached launch path
            layer["state"].copy_(state0)
            layer["conv_state"].copy_(conv0)
            layer["out"].fill_(float("nan"))
            fused_call(layer, norm, lb)()
        fused_state, fused_conv = layer["state"].clone(), layer["conv_state"].clone()
        live = layer["idx"][layer["idx"] >= 0].long()
        unused = torch.ones(layer["state"].shape[0], dtype=torch.bool, device="cuda")
        unused[live] = False
        untouched = (torch.equal(layer["state"][unused], state0[unused])
                     and torch.equal(layer["conv_state"][unused], conv0[unused]))
        pad_zero = bool((layer["out"][layer["idx"] < 0] == 0).all())
        e_out = rel(layer["out"], ref_out)
        e_state = rel(layer["state"][live], ref_state[live])
        conv_ok = torch.equal(layer["conv_state"][live], ref_conv[live].to(layer["conv_state"].dtype))
        # the unfused chain from the same starting pools
        fused_out = layer["out"].clone()
        layer["state"].copy_(state0)
        layer["conv_state"].copy_(conv0)
        chain_call(layer, norm, lb)()
        chain_out = layer["y"] if norm else layer["o"]
        e_chain = rel(fused_out, chain_out)
        chain_state = rel(fused_state[live], layer["state"][live])
        chain_conv = torch.equal(fused_conv, layer["conv_state"])
        # bf16 out: both round o to bf16 before the norm; a reduction-order ulp can still flip a
        # bf16 rounding here and there.
        # bf16 post-conv values: a float32 and a float64 conv can round to neighbouring bf16s, so
        # against the float64 reference the state agrees at the 1e-4 level, not 1e-7.
        ok = (e_out < 2e-2 and e_state < 1e-3 and conv_ok and untouched and pad_zero and chain_conv
              and chain_state < 1e-6 and e_chain < (1e-2 if norm else 2e-3))
        results["checks"].append({"case": f"N{N}-norm{int(norm)}-lb{lb}-pad{pad}-conv{'T' if transposed else 'C'}",
                                  "out_err": e_out, "state_err": e_state, "conv_bitwise": conv_ok,
                                  "vs_chain": e_chain, "chain_state": chain_state, "chain_conv": chain_conv,
                                  "untouched": untouched, "padding_zero": pad_zero, "ok": ok})
        del layer
    torch.cuda.empty_cache()
    # V split over programs (small batch, and GVA always): the last program of a key head to
    # arrive shifts the q/k windows and norms. Many repeats from the same pools must give the
    # same windows, state and output every time, and leave the arrival counters at zero.
    from kdakit.ops.launch import arrival_counters
    for N, H_, HV_ in ((1, 32, 32), (2, 32, 32), (8, 8, 32)):
        layer = make_layer(N, H_, HV_, K, V, seed=40 + N)
        state0, conv0 = layer["state"].clone(), layer["conv_state"].clone()
        ref_out, ref_state, ref_conv = ref_fused(layer)
        first, same = None, True
        for _ in range(200):  # the one-kernel step (the op itself may run the chain here)
            layer["state"].copy_(state0)
            layer["conv_state"].copy_(conv0)
            config_call(layer, one_kernel_config(N, H_, HV_), True)()
            now = (layer["out"].clone(), layer["state"].clone(), layer["conv_state"].clone())
            first = first or now
            same = same and all(torch.equal(a, b) for a, b in zip(first, now))
        live = layer["idx"][layer["idx"] >= 0].long()
        conv_ok = torch.equal(layer["conv_state"][live], ref_conv[live].to(layer["conv_state"].dtype))
        e = max(rel(layer["out"], ref_out), rel(layer["state"][live], ref_state[live]))
        zero = not arrival_counters(layer["qkv"].device, N * H_).any()
        results["checks"].append({"case": f"split-repeat-200-N{N}-H{H_}-HV{HV_}", "err": e, "conv_bitwise": conv_ok,
                                  "untouched": same and zero, "ok": same and zero and conv_ok and e < 2e-2})
        del layer
    # A state pool of more than 2**31 elements: offsets must be 64-bit.
    layer = make_layer(4, H, HV, K, V, spare_slots=0, seed=5)
    slots = (2 ** 31) // (HV * V * K) + 16
    layer["state"] = torch.randn(slots, HV, V, K, device="cuda")
    layer["conv_state"] = torch.randn(slots, W - 1, layer["qkv"].shape[1], device="cuda").bfloat16().transpose(1, 2)
    layer["idx"] = torch.tensor([slots - 1, 3, slots - 9, slots - 2], device="cuda", dtype=torch.int32)
    ref_out, ref_state, _ = ref_fused(layer)
    fused_call(layer)()
    live = layer["idx"].long()
    e = max(rel(layer["out"], ref_out), rel(layer["state"][live], ref_state[live]))
    results["checks"].append({"case": f"pool-{slots}-slots-over-2^31-elements", "err": e, "ok": e < 2e-2})
    del layer, ref_state
    torch.cuda.empty_cache()
    # CUDA graph: capture once, replay with new inputs, compare with eager.
    layer = make_layer(16, H, HV, K, V)
    call = fused_call(layer)
    harness.graph_time_us([call], replays=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    fresh = make_layer(16, H, HV, K, V, seed=99)
    for key in ("qkv", "conv_weight", "conv_state", "a", "b", "A_log", "dt_bias", "state", "idx", "norm_gate",
                "norm_weight"):
        layer[key].copy_(fresh[key])
    graph.replay()
    fused_call(fresh)()
    ok = (torch.equal(layer["out"], fresh["out"]) and torch.equal(layer["state"], fresh["state"])
          and torch.equal(layer["conv_state"], fresh["conv_state"]))
    results["checks"].append({"case": "cuda-graph-replay-new-inputs-bitwise-eager", "ok": ok})


def check_dependent_chain(results):
    """The chain with programmatic dependent launches: against float64, and 100 repeats from
    the same pools bitwise equal to the same chain launched plainly (a read before its
    wait would see the previous kernel's output half-written, and differ)."""
    H = HV = 32
    K = V = 128
    for N, norm, chain_kw in ((1, True, {}), (8, False, {}), (32, True, {}), (256, True, {}),
                              *((n, True, kw) for kw in CHAIN_VARIANTS.values() for n in (8, 256))):
        layer = make_layer(N, H, HV, K, V, seed=300 + N)
        if N > 1:
            layer["idx"][N // 2] = -1
        state0, conv0 = layer["state"].clone(), layer["conv_state"].clone()
        ref_out, ref_state, ref_conv = ref_fused(layer, norm)

        def run(pdl):
            layer["state"].copy_(state0)
            layer["conv_state"].copy_(conv0)
            layer["out"].fill_(float("nan"))
            dependent_chain_call(layer, norm, pdl, **chain_kw)()
            return layer["out"].clone(), layer["state"].clone(), layer["conv_state"].clone()

        plain = run(False)
        same = all(all(torch.equal(x, y) for x, y in zip(plain, run(True))) for _ in range(100))
        live = layer["idx"][layer["idx"] >= 0].long()
        e_out, e_state = rel(plain[0], ref_out), rel(plain[1][live], ref_state[live])
        conv_ok = torch.equal(plain[2][live], ref_conv[live].to(plain[2].dtype))
        variant = "".join(f"-{k}{v}" for k, v in chain_kw.items())
        results["checks"].append({"case": f"dependent-chain-N{N}-norm{int(norm)}{variant}-repeat100-bitwise-plain",
                                  "out_err": e_out, "state_err": e_state, "conv_bitwise": conv_ok,
                                  "untouched": same, "ok": same and conv_ok and e_out < 2e-2 and e_state < 1e-3})
        del layer
    torch.cuda.empty_cache()


def one_kernel_config(N, H=32, HV=32, K=128, V=128):
    """The one-kernel step's pinned config (what runs without dependent launches)."""
    from kdakit.ops.fused_decode import one_kernel_config as pinned
    config = pinned(N, H, HV, V, K)
    return config.block_v, config.v_tiles, config.num_warps


def config_call(layer, config, norm):
    from kdakit.ops.fused_decode import FusedDecodeConfig, fused_decode_triton
    kw = dict(norm_gate=layer["norm_gate"], norm_weight=layer["norm_weight"]) if norm else dict(norm_gate=None,
                                                                                                 norm_weight=None)
    return lambda: fused_decode_triton(layer["qkv"], layer["conv_weight"], layer["conv_state"], layer["a"],
                                       layer["b"], layer["A_log"], layer["dt_bias"], layer["state"], layer["idx"],
                                       layer["out"], conv_bias=None, scale=0.0884, lower_bound=None, norm_eps=1e-6,
                                       config=FusedDecodeConfig(*config), **kw)


# (BLOCK_V, V_TILES, num_warps), with the norm: V split over programs of one tile or of
# several, one one-warp program per head streaming its tiles, or one multi-warp program
# holding the whole row of a head (the norm on registers).
SWEEPS = {
    "one": [(c, True) for c in ((16, 1, 1), (8, 16, 1), (8, 2, 1), (8, 4, 1), (8, 8, 1), (16, 2, 1), (16, 4, 1),
                                (128, 1, 4), (128, 1, 8), (128, 1, 16))],
    "chain": [],
}
SWEEP = []  # set from --sweep
# --sweep chain: the dependent chain with other launch configs of its conv kernel
# (BLOCK_C, num_warps) or its decode kernel (BLOCK_V, V_TILES, num_warps, num_stages, EVICT)
CHAIN_SWEEP = [("conv", c) for c in ((128, 1), (512, 4), (1024, 4), (64, 1))] + [
    ("decode", c) for c in ((2, 1, 1, 1, ""), (4, 1, 1, 1, ""), (8, 1, 1, 1, ""), (16, 1, 1, 1, ""), (8, 2, 1, 1, ""),
                            (4, 2, 1, 1, ""))]


# The dependent chain with its norm over several rows a program (ROWS, num_warps); the
# op pins 8 rows past 2048 rows (kdakit/ops/gated_rmsnorm.py).
CHAIN_VARIANTS = {"norm rows 1x1": dict(norm_config=(1, 1)), "norm rows 8x4": dict(norm_config=(8, 4))}


def config_name(config, norm):
    return "fused{}-bv{}-t{}-w{}".format("+norm" if norm else "", *config)


def check_chain_configs(results):
    """Every swept chain config against float64 at N = 8 (one padding row)."""
    H = HV = 32
    K = V = 128
    for part, config in CHAIN_SWEEP:
        layer = make_layer(8, H, HV, K, V, seed=71)
        layer["idx"][5] = -1
        ref_out, ref_state, ref_conv = ref_fused(layer, True)
        layer["out"].fill_(float("nan"))
        dependent_chain_call(layer, True, True, **{part + "_config": config})()
        live = layer["idx"][layer["idx"] >= 0].long()
        conv_ok = torch.equal(layer["conv_state"][live], ref_conv[live].to(layer["conv_state"].dtype))
        e_out, e_state = rel(layer["out"], ref_out), rel(layer["state"][live], ref_state[live])
        results["checks"].append({"case": f"dependent-chain-{part}{list(config)}-N8-pad1", "out_err": e_out,
                                  "state_err": e_state, "conv_bitwise": conv_ok,
                                  "ok": conv_ok and e_out < 2e-2 and e_state < 1e-3})
        del layer
    torch.cuda.empty_cache()


def check_configs(results):
    """Every swept config against float64 at N = 8 (one padding row), and 20 repeats bitwise
    alike with the arrival counters back at zero."""
    from kdakit.ops.launch import arrival_counters
    H = HV = 32
    K = V = 128
    for config, norm in SWEEP:
        layer = make_layer(8, H, HV, K, V, seed=70)
        layer["idx"][3] = -1
        state0, conv0 = layer["state"].clone(), layer["conv_state"].clone()
        ref_out, ref_state, ref_conv = ref_fused(layer, norm)
        first, same = None, True
        for _ in range(20):
            layer["state"].copy_(state0)
            layer["conv_state"].copy_(conv0)
            layer["out"].fill_(float("nan"))
            config_call(layer, config, norm)()
            now = (layer["out"].clone(), layer["state"].clone(), layer["conv_state"].clone())
            first = first or now
            same = same and all(torch.equal(a, b) for a, b in zip(first, now))
        live = layer["idx"][layer["idx"] >= 0].long()
        conv_ok = torch.equal(layer["conv_state"][live], ref_conv[live].to(layer["conv_state"].dtype))
        e_out, e_state = rel(layer["out"], ref_out), rel(layer["state"][live], ref_state[live])
        zero = not arrival_counters(layer["qkv"].device, 8 * H).any()
        results["checks"].append({"case": config_name(config, norm) + "-N8-pad1-repeat20", "out_err": e_out,
                                  "state_err": e_state, "conv_bitwise": conv_ok, "untouched": same and zero,
                                  "ok": same and zero and conv_ok and e_out < 2e-2 and e_state < 1e-3})
        del layer
        torch.cuda.empty_cache()


def timings(results, quick: bool, sweep: str | None = None):
    ceiling = results["copy_ceiling_GBps"]
    batches = [1, 8, 32, 128, 512] if not quick else [1, 32, 128]
    H = HV = 32
    K = V = 128
    C = 2 * H * K + HV * V
    state_bytes = HV * V * K * 4
    for N in batches:
        # bytes the fused step must move: state r+w, windows r+w, qkv, a, b, gate in, out
        moved = N * (2 * state_bytes + 2 * C * (W - 1) * 2 + C * 2 + HV * K * 2 + HV * 2 + 2 * HV * V * 2)
        num_layers = harness.layers_for(moved)
        layers = [make_layer(N, H, HV, K, V, seed=i) for i in range(num_layers)]
        base = {"N": N, "layers": num_layers, "floor_us": round(moved / (ceiling * 1e3), 2)}
        for name, make in (("fused+norm", lambda l: fused_call(l, True)),
                           ("fused", lambda l: fused_call(l, False)),
                           ("chain conv+decode+norm", lambda l: chain_call(l, True)),
                           ("chain conv+decode", lambda l: chain_call(l, False)),
                           ("one-kernel step+norm", lambda l: config_call(l, one_kernel_config(N), True)),
                           ("dependent chain+norm", lambda l: dependent_chain_call(l, True)),
                           ("dependent chain", lambda l: dependent_chain_call(l, False)),
                           *((f"dependent chain+norm, {name}", lambda l, kw=kw: dependent_chain_call(l, True, **kw))
                             for name, kw in CHAIN_VARIANTS.items()),
                           ("plain chain+norm (op)", lambda l: dependent_chain_call(l, True, False)),
                           ("packed_decode alone", packed_call)) + tuple(
                (config_name(c, norm), (lambda l, c=c, norm=norm: config_call(l, c, norm)))
                for c, norm in SWEEP) + tuple(
                (f"dependent chain+norm {part}{list(c)}",
                 (lambda l, part=part, c=c: dependent_chain_call(l, True, True, **{part + "_config": c})))
                for part, c in (CHAIN_SWEEP if sweep == "chain" else ())):
            try:
                t = harness.graph_time_us([make(layer) for layer in layers])
                results["rows"].append(harness.row(name, t, moved, ceiling, **base))
            except Exception as exc:  # keep the other rows
                results["rows"].append({"name": name, **base, "error": repr(exc)[:200]})
        del layers
        torch.cuda.empty_cache()
    for row in results["rows"]:  # speedup of fused over its chain at the same N
        if (row["name"].startswith("fused") or row["name"].startswith("dependent")) and "us" in row:
            chain = "chain conv+decode+norm" if "+norm" in row["name"] else "chain conv+decode"
            match = [r for r in results["rows"] if r["name"] == chain and r["N"] == row["N"] and "us" in r]
            if match:
                row["x_vs_chain"] = round(match[0]["us"] / row["us"], 2)
    layer = make_layer(1, H, HV, K, V)
    results["eager_us_N1"] = {"fused+norm": round(harness.eager_host_us(fused_call(layer)), 1),
                              "chain": round(harness.eager_host_us(chain_call(layer)), 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", choices=sorted(SWEEPS), help="time launch-config variants of the fused kernel")
    parser.add_argument("--name", default="fused_decode_h200")
    args = parser.parse_args()
    results = harness.new_results()
    correctness(results)
    check_dependent_chain(results)
    if args.sweep:
        SWEEP.extend(SWEEPS[args.sweep])
        check_configs(results)
        if args.sweep == "chain":
            check_chain_configs(results)
    bad = [c for c in results["checks"] if not c["ok"]]
    timings(results, args.quick, args.sweep)
    harness.close_results(results)
    path = harness.save(results, args.name, harness.results_folder(__file__))
    print(f"copy ceiling {results['copy_ceiling_GBps']} GB/s (end {results['copy_ceiling_GBps_end']}); saved {path}")
    print("eager us/call N=1:", results["eager_us_N1"])
    harness.print_table(results["checks"], ["case", "ok", "out_err", "state_err", "conv_bitwise", "vs_chain",
                                            "chain_state", "untouched", "padding_zero", "err"])
    print("CHECKS FAILED:" if bad else "all checks ok", [c["case"] for c in bad])
    harness.print_table(results["rows"], ["name", "N", "us", "floor_us", "GB/s", "pct_of_copy", "x_vs_chain",
                                          "layers", "error"])


if __name__ == "__main__":
    main()
