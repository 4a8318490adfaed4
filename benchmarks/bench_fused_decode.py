"""Fused decode on the GPU: correctness at real sizes, then fused vs the unfused chain.

    python benchmarks/bench_fused_decode.py [--quick] [--sweep one|chain] [--name NAME]
        [--configs 'block_v=16,v_tiles=2;...'] [--conv-configs 'block_c=512,num_warps=4;...']
        [--decode-configs 'block_v=8,v_tiles=2;...'] [--norm-configs 'rows=8,num_warps=4;...']

Checks `fused_decode` against the float64 reference (and against the unfused chain of
public ops causal_conv1d_update -> packed_decode -> gated_rmsnorm) at Kimi sizes (H = HV =
32, K = V = 128, bf16 activations and conv windows, float32 state pool), the one-kernel
step and the chain of dependent launches on their own, then times, HBM-resident through
harness.graph_time_us: `fused_decode` as it dispatches (with and without the output norm),
the one-kernel step, the chain of public ops, the op's chain with and without dependent
launches, and packed decode alone (post-conv inputs, no norm: the recurrence's floor).
Writes JSON (harness.save) and prints a table last.

Launch-config variants, each checked before it is timed, in harness.parse_configs syntax
(the config dataclass's fields, ``field=value`` joined by ``,``, configs by ``;``; fields not
named keep the config picked at each size): ``--configs`` the one-kernel step's
FusedDecodeConfig (``--sweep one``: SWEEP_ONE), ``--conv-configs`` / ``--decode-configs``
the dependent chain's conv (Conv1dUpdateConfig) and decode (PackedDecodeConfig) kernels
(``--sweep chain``: SWEEP_CHAIN_CONV and SWEEP_CHAIN_DECODE), ``--norm-configs`` its norm
kernel (GatedRMSNormConfig; by default NORM_VARIANTS, always checked and timed).
"""
from __future__ import annotations

import argparse

import torch

from kdakit import reference
from kdakit.bench import harness
from kdakit.bench.inputs import fused_decode_inputs  # one inputs builder per op
from kdakit.ops.conv1d_update import Conv1dUpdateConfig, causal_conv1d_update, conv1d_update_config
from kdakit.ops.fused_decode import FusedDecodeConfig, chain_decode_config, fused_decode
from kdakit.ops.fused_decode import one_kernel_config as pinned_one_kernel_config
from kdakit.ops.gated_rmsnorm import GatedRMSNormConfig, gated_rmsnorm, gated_rmsnorm_config
from kdakit.ops.packed_decode import PackedDecodeConfig, packed_decode

W = 4  # Kimi short conv width


def make_layer(N, H, HV, K, V, **kw):
    """inputs.fused_decode_inputs (``kw``: its options), and the unfused chain's buffers."""
    layer = fused_decode_inputs(N, H, HV, K, V, W=W, **kw)
    C, act_dtype, dev = layer["qkv"].shape[1], layer["qkv"].dtype, layer["qkv"].device
    layer.update(mixed=torch.empty(N, C, device=dev, dtype=act_dtype),
                 o=torch.empty(N, 1, HV, V, device=dev, dtype=act_dtype),
                 y=torch.empty(N, 1, HV, V, device=dev, dtype=act_dtype))
    return layer


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


def dependent_chain_call(layer, norm=True, pdl=True, groups=None):
    """The op's own unfused chain, each kernel a programmatic dependent launch of the one before.
    ``groups``: a dict of ``conv``, ``decode``, ``norm`` texts (harness.parse_configs syntax) applied
    to the config the chain picks for that kernel at this layer's sizes (chain_config)."""
    from kdakit.ops.fused_decode import _unfused_chain
    configs = {f"{part}_config": chain_config(part, group, layer) for part, group in (groups or {}).items()}
    kw = dict(norm_gate=layer["norm_gate"], norm_weight=layer["norm_weight"]) if norm else dict(norm_gate=None,
                                                                                                 norm_weight=None)
    K = layer["state"].shape[-1]
    return lambda: _unfused_chain(layer["qkv"], layer["conv_weight"], layer["conv_state"], layer["a"], layer["b"],
                                  layer["A_log"], layer["dt_bias"], layer["state"], layer["idx"], layer["out"],
                                  conv_bias=None, scale=K ** -0.5, lower_bound=None, norm_eps=1e-6, pdl=pdl,
                                  **configs, **kw)


# The chain's kernels: each one's config class and the config the chain picks at a layer's sizes.
CHAIN_PARTS = {
    "conv": (Conv1dUpdateConfig, lambda L: conv1d_update_config(L["qkv"].shape[1])),
    "decode": (PackedDecodeConfig, lambda L: chain_decode_config(L["out"].shape[0], L["state"].shape[1],
                                                                 L["state"].shape[2], L["state"].shape[3],
                                                                 L["state"].element_size())),
    "norm": (GatedRMSNormConfig, lambda L: gated_rmsnorm_config(L["out"].shape[-1],
                                                                       L["out"].shape[0] * L["out"].shape[2])),
}


def chain_config(part, group, layer):
    """``group``'s fields on the config the chain picks for ``part`` at ``layer``'s sizes."""
    config_type, picked = CHAIN_PARTS[part]
    return harness.parse_configs(group, config_type, base=picked(layer))[0] if group is not None else None


def packed_call(layer):
    # post-conv inputs are the raw qkv here: the recurrence alone, for the floor it sets
    return lambda: packed_decode(layer["qkv"], layer["a"], layer["b"], layer["A_log"], layer["dt_bias"],
                                 layer["state"], layer["idx"], layer["o"])


def ref_fused(layer, norm=True, lower_bound=None):
    st, conv = layer["state"].double(), layer["conv_state"].double()
    out = torch.empty(layer["out"].shape, dtype=torch.float64, device=layer["out"].device)
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

        def run(pdl, layer=layer, state0=state0, conv0=conv0):
            layer["state"].copy_(state0)
            layer["conv_state"].copy_(conv0)
            layer["out"].fill_(float("nan"))
            dependent_chain_call(layer, norm, pdl, groups=chain_kw)()
            return layer["out"].clone(), layer["state"].clone(), layer["conv_state"].clone()

        plain = run(False)
        same = all(all(torch.equal(x, y) for x, y in zip(plain, run(True))) for _ in range(100))
        live = layer["idx"][layer["idx"] >= 0].long()
        e_out, e_state = rel(plain[0], ref_out), rel(plain[1][live], ref_state[live])
        conv_ok = torch.equal(plain[2][live], ref_conv[live].to(plain[2].dtype))
        variant = "".join(f"-{k}[{v}]" for k, v in chain_kw.items())
        results["checks"].append({"case": f"dependent-chain-N{N}-norm{int(norm)}{variant}-repeat100-bitwise-plain",
                                  "out_err": e_out, "state_err": e_state, "conv_bitwise": conv_ok,
                                  "untouched": same, "ok": same and conv_ok and e_out < 2e-2 and e_state < 1e-3})
        del layer
    torch.cuda.empty_cache()


def one_kernel_config(N, H=32, HV=32, K=128, V=128):
    """The one-kernel step's pinned config (what runs without dependent launches)."""
    return pinned_one_kernel_config(N, H, HV, V, K)


def config_call(layer, config, norm):
    """The one-kernel step (or what ``config``, a FusedDecodeConfig, plans) through the Triton launcher."""
    from kdakit.ops.fused_decode import fused_decode_triton
    kw = dict(norm_gate=layer["norm_gate"], norm_weight=layer["norm_weight"]) if norm else dict(norm_gate=None,
                                                                                                 norm_weight=None)
    return lambda: fused_decode_triton(layer["qkv"], layer["conv_weight"], layer["conv_state"], layer["a"],
                                       layer["b"], layer["A_log"], layer["dt_bias"], layer["state"], layer["idx"],
                                       layer["out"], conv_bias=None, scale=0.0884, lower_bound=None, norm_eps=1e-6,
                                       config=config, **kw)


def one_kernel_variant(group, N, H=32, HV=32):
    """``group``'s FusedDecodeConfig fields on the one-kernel step's pinned config at ``N``."""
    return harness.parse_configs(group, FusedDecodeConfig, base=one_kernel_config(N, H, HV))[0]


# Launch-config sweeps, harness.parse_configs syntax (fields not named keep the picked config's).
# --sweep one / --configs: FusedDecodeConfig of the one-kernel step, with the norm: V split over
# programs of one tile or of several, one one-warp program per head streaming its tiles, or one
# multi-warp program holding the whole row of a head (the norm on registers).
SWEEP_ONE = ";".join(f"block_v={bv},v_tiles={t},num_warps={w}" for bv, t, w in (
    (16, 1, 1), (8, 16, 1), (8, 2, 1), (8, 4, 1), (8, 8, 1), (16, 2, 1), (16, 4, 1), (128, 1, 4), (128, 1, 8),
    (128, 1, 16)))
# --sweep chain / --conv-configs, --decode-configs: the dependent chain with other launch configs
# of its conv kernel (Conv1dUpdateConfig) or its decode kernel (PackedDecodeConfig).
SWEEP_CHAIN_CONV = "block_c=128,num_warps=1;block_c=512,num_warps=4;block_c=1024,num_warps=4;block_c=64,num_warps=1"
SWEEP_CHAIN_DECODE = ";".join(f"block_v={bv},v_tiles={t}" for bv, t in ((2, 1), (4, 1), (8, 1), (16, 1), (8, 2),
                                                                            (4, 2)))
# Always checked and timed (--norm-configs: others instead): the dependent chain with its norm
# over several rows a program (GatedRMSNormConfig); the op pins 8 rows past 2048 rows
# (kdakit/ops/gated_rmsnorm.py).
NORM_VARIANTS = "rows=1,num_warps=1;rows=8,num_warps=4"

SWEEP = []        # one-kernel variants (groups), set from --sweep one / --configs
CHAIN_SWEEP = []  # (part, group) of the chain, set from --sweep chain / --conv-configs / --decode-configs
CHAIN_VARIANTS = {}  # row name: dict(norm=group), set from NORM_VARIANTS / --norm-configs


def set_sweeps(sweep=None, configs=None, conv_configs=None, decode_configs=None, norm_configs=None):
    """Fill SWEEP, CHAIN_SWEEP and CHAIN_VARIANTS from the options (each group parsed now, so a
    wrong field fails before the checks)."""
    probe = make_probe()
    SWEEP[:] = harness.config_groups(configs or (SWEEP_ONE if sweep == "one" else None), FusedDecodeConfig,
                                     base=one_kernel_config(8))
    conv = conv_configs or (SWEEP_CHAIN_CONV if sweep == "chain" else None)
    decode = decode_configs or (SWEEP_CHAIN_DECODE if sweep == "chain" else None)
    CHAIN_SWEEP[:] = [(part, group) for part, text in (("conv", conv), ("decode", decode))
                      for group in harness.config_groups(text, CHAIN_PARTS[part][0], base=CHAIN_PARTS[part][1](probe))]
    CHAIN_VARIANTS.clear()
    CHAIN_VARIANTS.update({f"norm[{group}]": dict(norm=group) for group in harness.config_groups(
        norm_configs or NORM_VARIANTS, GatedRMSNormConfig, base=CHAIN_PARTS["norm"][1](probe))})


def make_probe(N=8, H=32, HV=32, K=128, V=128):
    """A layer's shapes without its tensors (meta device), for the pickers' configs."""
    C = 2 * H * K + HV * V
    return {"qkv": torch.empty(N, C, device="meta"), "out": torch.empty(N, 1, HV, V, device="meta"),
            "state": torch.empty(2 * N, HV, V, K, device="meta")}


def config_name(group, norm):
    return f"fused{'+norm' if norm else ''}[{group}]"


def check_chain_configs(results):
    """Every swept chain config against float64 at N = 8 (one padding row)."""
    H = HV = 32
    K = V = 128
    for part, group in CHAIN_SWEEP:
        layer = make_layer(8, H, HV, K, V, seed=71)
        layer["idx"][5] = -1
        ref_out, ref_state, ref_conv = ref_fused(layer, True)
        layer["out"].fill_(float("nan"))
        dependent_chain_call(layer, True, True, groups={part: group})()
        live = layer["idx"][layer["idx"] >= 0].long()
        conv_ok = torch.equal(layer["conv_state"][live], ref_conv[live].to(layer["conv_state"].dtype))
        e_out, e_state = rel(layer["out"], ref_out), rel(layer["state"][live], ref_state[live])
        results["checks"].append({"case": f"dependent-chain-{part}[{group}]-N8-pad1", "out_err": e_out,
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
    norm = True
    for group in SWEEP:
        config = one_kernel_variant(group, 8)
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
        results["checks"].append({"case": config_name(group, norm) + "-N8-pad1-repeat20", "out_err": e_out,
                                  "state_err": e_state, "conv_bitwise": conv_ok, "untouched": same and zero,
                                  "ok": same and zero and conv_ok and e_out < 2e-2 and e_state < 1e-3})
        del layer
        torch.cuda.empty_cache()


def timings(results, quick: bool):
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
                           *((f"dependent chain+norm, {name}", lambda l, kw=kw: dependent_chain_call(l, True, groups=kw))
                             for name, kw in CHAIN_VARIANTS.items()),
                           ("plain chain+norm (op)", lambda l: dependent_chain_call(l, True, False)),
                           ("packed_decode alone", packed_call)) + tuple(
                (config_name(group, True), (lambda l, c=one_kernel_variant(group, N): config_call(l, c, True)))
                for group in SWEEP) + tuple(
                (f"dependent chain+norm {part}[{group}]",
                 (lambda l, part=part, group=group: dependent_chain_call(l, True, True, groups={part: group})))
                for part, group in CHAIN_SWEEP):
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
    parser.add_argument("--sweep", choices=("one", "chain"), help="time launch-config variants: of the one-kernel "
                        "step (SWEEP_ONE) or of the chain's conv and decode kernels (SWEEP_CHAIN_CONV, _DECODE)")
    parser.add_argument("--configs", help="FusedDecodeConfig variants of the one-kernel step (with the norm) to time, "
                        "as 'field=value,...;field=value' (fields not named keep the pinned one-kernel config's)")
    parser.add_argument("--conv-configs", help="Conv1dUpdateConfig variants of the dependent chain's conv kernel, "
                        "the same syntax (fields not named keep the chain's pick)")
    parser.add_argument("--decode-configs", help="PackedDecodeConfig variants of the dependent chain's decode kernel")
    parser.add_argument("--norm-configs", help="GatedRMSNormConfig variants of the dependent chain's norm kernel, "
                        "checked and timed instead of NORM_VARIANTS")
    parser.add_argument("--name", default="fused_decode_h200")
    args = parser.parse_args()
    set_sweeps(args.sweep, args.configs, args.conv_configs, args.decode_configs, args.norm_configs)
    results = harness.new_results()
    correctness(results)
    check_dependent_chain(results)
    if SWEEP:
        check_configs(results)
    if CHAIN_SWEEP:
        check_chain_configs(results)
    bad = [c for c in results["checks"] if not c["ok"]]
    timings(results, args.quick)
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
