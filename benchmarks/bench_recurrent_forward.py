"""Varlen recurrent forward on the GPU: correctness at real sizes, then timings against fla.

    python benchmarks/bench_recurrent_forward.py [--sweep] [--quick] [--configs 'block_v=8,v_tiles=2;...']
        [--kmajor-configs 'block_v=32,num_warps=2;...']

Checks every variant against the float64 reference before timing it (varlen batches,
padding slots, 2-D per-token slots with num_accepted_tokens, token states, bf16 pools,
K-major pools through kdakit.compat.fla, a pool past 2**31 elements, CUDA-graph replay).
Then times, on varlen batches of N sequences of T tokens (T in {1, 4, 16}, N in {8, 64,
256}, H = HV = 32, K = V = 128, bf16 activations, raw gate and beta logit with the gate,
sigmoid and L2 norm in the kernel, float32 states), HBM-resident through
harness.graph_time_us, in the same process on the same inputs:
- ``kdakit``: kdakit.recurrent_forward, V-major pool updated in place (1-D slots);
- ``kdakit-compat``: kdakit.compat.fla.fused_recurrent_kda, fla's public call
  (K-major ``initial_state [N, HV, K, V]``, new float32 final state);
- ``fla``: fla's fused_recurrent_kda, the same call;
- ``fla-fwd-inplace``: fla's fused_recurrent_kda_fwd in place, ``state_v_first``
  (the op kdakit's native call does, on ``[N, HV, V, K]`` states).
``--sweep`` also times kdakit's alternative launch configs (SWEEP: RecurrentForwardConfig
fields in harness.parse_configs syntax), ``--configs`` the given ones instead (fields not
named keep the config the op picks at each size; rows ``kdakit[<config>]``);
``--kmajor-configs`` likewise the fla drop-in's config on K-major states (rows
``kdakit-compat[<config>]``). JSON via harness.save; a short table last.
"""
from __future__ import annotations

import argparse

import torch

from kdakit import reference
from kdakit.bench import harness
from kdakit.bench.inputs import varlen_inputs  # one inputs builder per op
from kdakit.compat.fla import fused_recurrent_kda as compat_fused_recurrent_kda
from kdakit.ops.recurrent_forward import (RecurrentForwardConfig, recurrent_forward, recurrent_forward_config,
                                          recurrent_forward_triton)

DEV = "cuda"


def make_layer(N, T, H, HV, K, V, *, state_dtype=torch.float32, act_dtype=torch.bfloat16, spare_slots=None,
               seqlens=None, seed=0):
    """N sequences of T tokens (or ``seqlens``), flattened to [1, total, ...]; a pool with
    ``spare_slots`` (default ``max(N, 2)``) besides the N used (inputs.varlen_inputs)."""
    return varlen_inputs([T] * N if seqlens is None else seqlens, H, HV, K, V, state_dtype=state_dtype,
                         act_dtype=act_dtype, slots=N + (spare_slots if spare_slots is not None else max(N, 2)),
                         seed=seed, device=DEV)


def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-30)) if torch.isfinite(x).all() else float("inf")


def ref_forward(layer, idx=None, num_accepted=None, lower_bound=None, token_states=False):
    """float64 reference on copies: (out, pool after, token states or None)."""
    pool = layer["state"].double()
    out = torch.empty(layer["out"].shape, dtype=torch.float64, device=DEV)
    ts = None
    if token_states:
        _, HV, V, K = layer["state"].shape
        ts = torch.empty(layer["q"].shape[1], HV, V, K, dtype=torch.float64, device=DEV)
    reference.recurrent_forward(
        *(layer[n].double() for n in ("q", "k", "v", "g", "beta")), pool, layer["idx"] if idx is None else idx, out,
        cu_seqlens=layer["cu"], A_log=layer["A_log"].double(), dt_bias=layer["dt_bias"].double(),
        lower_bound=lower_bound, beta_is_logit=True, num_accepted_tokens=num_accepted, token_states=ts,
        compute_dtype=torch.float64)
    return out, pool, ts


def kdakit_call(layer, lower_bound=None, config=None, idx=None, num_accepted=None, token_states=None):
    idx = layer["idx"] if idx is None else idx
    if config is None:
        return lambda: recurrent_forward(layer["q"], layer["k"], layer["v"], layer["g"], layer["beta"],
                                         layer["state"], idx, cu_seqlens=layer["cu"], A_log=layer["A_log"],
                                         dt_bias=layer["dt_bias"], lower_bound=lower_bound, beta_is_logit=True,
                                         num_accepted_tokens=num_accepted, token_states=token_states,
                                         out=layer["out"])
    K = layer["q"].shape[-1]
    return lambda: recurrent_forward_triton(layer["q"], layer["k"], layer["v"], layer["g"], layer["beta"],
                                            layer["state"], idx, layer["out"], cu_seqlens=layer["cu"],
                                            scale=K ** -0.5, use_qk_l2norm=True, A_log=layer["A_log"],
                                            dt_bias=layer["dt_bias"], lower_bound=lower_bound, beta_mode=1,
                                            num_accepted_tokens=num_accepted, token_states=token_states,
                                            write_final_state=True, final_states=None,
                                            config=config)


def fla_public_args(layer):
    """fla's public call on per-sequence K-major initial states [N, HV, K, V] (float32)."""
    if "h0" not in layer:
        layer["h0"] = layer["state"][layer["idx"].long()].transpose(-1, -2).float().contiguous()
    return dict(q=layer["q"], k=layer["k"], v=layer["v"], g=layer["g"], beta=layer["beta"], A_log=layer["A_log"],
                dt_bias=layer["dt_bias"], initial_state=layer["h0"], output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                cu_seqlens=layer["cu"].long())


def public_call(layer, fn):
    def call():
        layer["public_out"] = fn(**fla_public_args(layer))
    return call


def fla_fwd_inplace_call(layer):
    """fla's serving fwd, in place, V-major, states [N, HV, V, K] indexed by sequence."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    if "h_seq" not in layer:
        layer["h_seq"] = layer["state"][layer["idx"].long()].float().contiguous()
    K = layer["q"].shape[-1]
    out = torch.empty_like(layer["out"])
    layer["fla_out"] = out
    return lambda: fused_recurrent_kda_fwd(
        q=layer["q"], k=layer["k"], v=layer["v"], g=layer["g"], beta=layer["beta"], A_log=layer["A_log"],
        dt_bias=layer["dt_bias"], initial_state=layer["h_seq"], scale=K ** -0.5, output_final_state=True,
        inplace_final_state=True, state_v_first=True, cu_seqlens=layer["cu"].long(), use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, out=out)


# ----------------------------------------------------------------------------
def correctness(results):
    checks = results["checks"]
    cases = [  # (N, T, seqlens, H, HV, K, V, state dtype, lower_bound, padding rows)
        (8, 1, None, 32, 32, 128, 128, torch.float32, None, 0),
        (64, 4, None, 32, 32, 128, 128, torch.float32, -5.0, 3),
        (256, 16, None, 32, 32, 128, 128, torch.float32, None, 7),
        (6, 0, [1, 33, 0, 7, 16, 2], 32, 32, 128, 128, torch.float32, None, 1),
        (64, 4, None, 32, 32, 128, 128, torch.bfloat16, None, 2),
        (16, 8, None, 4, 16, 128, 128, torch.float32, -1.0, 1),
        (16, 8, None, 8, 8, 64, 256, torch.float32, None, 1),
        (16, 8, None, 8, 8, 256, 96, torch.float32, None, 1),
    ]
    for N, T, lens, H, HV, K, V, sd, lb, pad in cases:
        layer = make_layer(N, T, H, HV, K, V, state_dtype=sd, seqlens=lens, seed=N + T + HV)
        if pad:
            layer["idx"][torch.randperm(N, device=DEV)[:pad]] = -1
        before = layer["state"].clone()
        ref_out, ref_pool, ref_ts = ref_forward(layer, lower_bound=lb, token_states=True)
        ts = torch.full(ref_ts.shape, float("nan"), device=DEV)
        for _ in range(2):  # the second call runs the cached launch path
            layer["state"].copy_(before)
            layer["out"].fill_(float("nan"))
            kdakit_call(layer, lb, token_states=ts)()
        live = layer["idx"][layer["idx"] >= 0].long()
        unused = torch.ones(layer["state"].shape[0], dtype=torch.bool, device=DEV)
        unused[live] = False
        untouched = torch.equal(layer["state"][unused], before[unused])
        e_out, e_state, e_ts = rel(layer["out"], ref_out), rel(layer["state"][live], ref_pool[live]), rel(ts, ref_ts)
        tol = 1e-5 if sd == torch.float32 else 1e-2
        ok = e_out < 2e-2 and e_state < tol and e_ts < 1e-5 and untouched
        checks.append({"case": f"N{N}-T{T if lens is None else 'var'}-H{H}-HV{HV}-K{K}-V{V}-{str(sd)[6:]}-lb{lb}"
                               f"-pad{pad}", "out_err": e_out, "state_err": e_state, "ts_err": e_ts,
                       "untouched": untouched, "ok": ok})
    # 2-D per-token slots with num_accepted_tokens (fla's speculative path).
    N, T = 32, 4
    layer = make_layer(N, T, 32, 32, 128, 128, spare_slots=N * T, seed=5)
    slots = layer["state"].shape[0]
    per_token = torch.randperm(slots, device=DEV)[:N * T].view(N, T).to(torch.int32)
    per_token[3, 2] = -1
    accepted = torch.randint(1, T + 1, (N,), device=DEV, dtype=torch.int32)
    before = layer["state"].clone()
    ref_out, ref_pool, _ = ref_forward(layer, idx=per_token, num_accepted=accepted)
    kdakit_call(layer, idx=per_token, num_accepted=accepted)()
    written = per_token[per_token >= 0].long()
    unused = torch.ones(slots, dtype=torch.bool, device=DEV)
    unused[written] = False
    ok_untouched = torch.equal(layer["state"][unused], before[unused])
    e_out, e_state = rel(layer["out"], ref_out), rel(layer["state"][written], ref_pool[written])
    checks.append({"case": "2d-slots-num-accepted", "out_err": e_out, "state_err": e_state,
                   "untouched": ok_untouched, "ok": e_out < 2e-2 and e_state < 1e-5 and ok_untouched})
    # fla's public call through kdakit.compat.fla (K-major, not in place).
    layer = make_layer(16, 4, 32, 32, 128, 128, seed=6)
    ref_out, ref_pool, _ = ref_forward(layer)
    o, ht = compat_fused_recurrent_kda(**fla_public_args(layer))
    live = layer["idx"].long()
    e_out, e_state = rel(o, ref_out), rel(ht.transpose(-1, -2), ref_pool[live])
    checks.append({"case": "compat-fla-k-major", "out_err": e_out, "state_err": e_state,
                   "ok": e_out < 2e-2 and e_state < 1e-5})
    # A pool of more than 2**31 elements: offsets must be 64-bit.
    HV, K, V = 32, 128, 128
    slots = (2 ** 31) // (HV * V * K) + 16
    layer = make_layer(4, 3, 32, HV, K, V, spare_slots=0, seed=7)
    layer["state"] = torch.randn(slots, HV, V, K, device=DEV)
    layer["idx"] = torch.tensor([slots - 1, 3, slots - 9, slots - 2], device=DEV, dtype=torch.int32)
    ref_out, ref_pool, _ = ref_forward(layer)
    kdakit_call(layer)()
    live = layer["idx"].long()
    e_out, e_state = rel(layer["out"], ref_out), rel(layer["state"][live], ref_pool[live])
    checks.append({"case": f"pool-{slots}-slots-over-2^31-elements", "out_err": e_out, "state_err": e_state,
                   "ok": e_out < 2e-2 and e_state < 1e-5})
    del layer, ref_pool
    torch.cuda.empty_cache()
    # CUDA graph: capture once, replay with new inputs, compare with eager.
    layer = make_layer(16, 4, 32, 32, 128, 128, seed=8)
    call = kdakit_call(layer)
    harness.graph_time_us([call], replays=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    fresh = make_layer(16, 4, 32, 32, 128, 128, seed=99)
    for key in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "idx", "cu"):
        layer[key].copy_(fresh[key])
    graph.replay()
    kdakit_call(fresh)()
    ok = torch.equal(layer["out"], fresh["out"]) and torch.equal(layer["state"], fresh["state"])
    checks.append({"case": "cuda-graph-replay-new-inputs-bitwise-eager", "ok": ok})


def layer_bytes(N, T, H, HV, K, V, act_bytes=2, state_bytes=4):
    state = 2 * N * HV * V * K * state_bytes
    tokens = N * T * ((2 * H * K + HV * K + 2 * HV * V) * act_bytes + HV * act_bytes)
    return state + tokens


def with_kmajor_config(group, fn):
    """``fn`` (the fla drop-in) with its launch config for K-major pools replaced by the
    picked one with ``group``'s fields (harness.parse_configs syntax)."""
    from kdakit.ops import recurrent_forward as module

    def call(**kw):
        pinned = module.recurrent_forward_config
        module.recurrent_forward_config = lambda N, HV, V, K, tokens, k_major=False: (
            harness.parse_configs(group, RecurrentForwardConfig, base=pinned(N, HV, V, K, tokens, True))[0]
            if k_major else pinned(N, HV, V, K, tokens, k_major))
        try:
            return fn(**kw)
        finally:
            module.recurrent_forward_config = pinned
    return call


# --sweep: RecurrentForwardConfig variants (harness.parse_configs syntax; every field named, so
# the same configs at every size)
SWEEP = ";".join(f"block_v={bv},num_warps=1,v_tiles={t},prefetch_tile={p},tiles_first=false"
                 for bv, t, p in ((16, 1, "true"), (8, 1, "true"), (8, 2, "false"), (8, 4, "false"), (4, 2, "false"),
                                  (4, 4, "true"), (8, 2, "true"), (8, 4, "true")))


def config_groups(text):
    """The variants of ``text`` (harness.config_groups: each checked against the dataclass now)."""
    return harness.config_groups(text, RecurrentForwardConfig, base=recurrent_forward_config(64, 32, 128, 128, 64))


def timings(results, groups, quick: bool, kmajor_groups=()):
    """``groups``: RecurrentForwardConfig variants of kdakit's call, ``kmajor_groups``: of the fla
    drop-in's on K-major states; each applied to the config the op picks at every size."""
    ceiling = results["copy_ceiling_GBps"]
    H = HV = 32
    K = V = 128
    sizes = [(N, T) for T in (1, 4, 16) for N in (8, 64, 256)]
    if quick:
        sizes = [(8, 1), (64, 1), (256, 1)]
    for N, T in sizes:
        moved = layer_bytes(N, T, H, HV, K, V)
        num_layers = harness.layers_for(moved)
        layers = [make_layer(N, T, H, HV, K, V, spare_slots=0, seed=i) for i in range(num_layers)]
        base = {"N": N, "T": T, "layers": num_layers, "floor_us": round(moved / (ceiling * 1e3), 2)}
        ref_out, ref_pool, _ = ref_forward(layers[0])
        snap = layers[0]["state"].clone()
        live = layers[0]["idx"].long()
        picked = recurrent_forward_config(N, HV, V, K, N * T, state_bytes=layers[0]["state"].element_size())
        for name, cfg in [("kdakit", None)] + [(f"kdakit[{group}]", harness.parse_configs(
                group, RecurrentForwardConfig, base=picked)[0]) for group in groups]:
            layers[0]["state"].copy_(snap)
            kdakit_call(layers[0], config=cfg)()
            err = max(rel(layers[0]["out"], ref_out), rel(layers[0]["state"][live], ref_pool[live]))
            layers[0]["state"].copy_(snap)
            t = harness.graph_time_us([kdakit_call(layer, config=cfg) for layer in layers])
            results["rows"].append(harness.row(name, t, moved, ceiling, **base, err=round(err, 7)))
        peers = [("kdakit-compat", lambda layer: public_call(layer, compat_fused_recurrent_kda))]
        peers += [(f"kdakit-compat[{group}]",
                   lambda layer, group=group: public_call(layer, with_kmajor_config(group, compat_fused_recurrent_kda)))
                  for group in kmajor_groups]
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda as fla_fused_recurrent_kda
            peers.append(("fla", lambda layer: public_call(layer, fla_fused_recurrent_kda)))
            peers.append(("fla-fwd-inplace", fla_fwd_inplace_call))
        except Exception as exc:  # the peer is optional on the device
            results["rows"].append({"name": "fla", **base, "error": repr(exc)[:200]})
        for name, make_call in peers:
            try:
                layers[0]["state"].copy_(snap)  # the timed replays above advanced it
                layers[0].pop("h0", None)
                layers[0].pop("h_seq", None)
                make_call(layers[0])()
                if name == "fla-fwd-inplace":
                    o, final = layers[0]["fla_out"], layers[0]["h_seq"]
                else:
                    o, final = layers[0]["public_out"][0], layers[0]["public_out"][1].transpose(-1, -2)
                err = max(rel(o, ref_out), rel(final, ref_pool[live]))
                layers[0].pop("h_seq", None)
                t = harness.graph_time_us([make_call(layer) for layer in layers])
                results["rows"].append(harness.row(name, t, moved, ceiling, **base, err=round(err, 7)))
            except Exception as exc:
                results["rows"].append({"name": name, **base, "error": repr(exc)[:200]})
        del layers
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time kdakit's RecurrentForwardConfig variants of SWEEP too")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="recurrent_forward_h200")
    parser.add_argument("--configs", help="RecurrentForwardConfig variants of kdakit's call to time instead of SWEEP, "
                        "as 'field=value,...;field=value' (fields not named keep the picked config's)")
    parser.add_argument("--kmajor-configs", help="the same for the fla drop-in on fla's K-major states")
    args = parser.parse_args()
    groups = config_groups(args.configs or (SWEEP if args.sweep else None))  # wrong fields fail here
    kmajor = config_groups(args.kmajor_configs)
    results = harness.new_results()
    correctness(results)
    bad = [c for c in results["checks"] if not c["ok"]]
    timings(results, groups, args.quick, kmajor)
    harness.close_results(results)
    path = harness.save(results, args.name, harness.results_folder(__file__))
    print(f"copy ceiling {results['copy_ceiling_GBps']} GB/s (end {results['copy_ceiling_GBps_end']}); saved {path}")
    harness.print_table(results["checks"], ["case", "ok", "out_err", "state_err", "ts_err", "err"])
    harness.print_table(results["rows"], ["name", "N", "T", "us", "floor_us", "GB/s", "pct_of_copy", "err", "error"])
    print("CHECKS FAILED:" if bad else "all checks ok", [c["case"] for c in bad])


if __name__ == "__main__":
    main()
