"""The extend path's accuracy at engine sizes, on the GPU, against a float64 recurrence of its own.

For each case (1 x 8192 and 8 x 2048 at H = HV = 32, 1 x 32768 at H = 8; K = V = 128; bf16
q/k/v/gate/beta, float32 pool; both gates) and each input regime, every implementation runs
on the same input tensors, each from a fresh copy of the same pool:

- ``kdakit.chunk_prefill`` (the picked config, and forced variants that localise an error or
  trade speed for accuracy: float32 update factors, the float32
  form, three-pass TF32, no chain pieces, outputs in the chain),
- ``kdakit.recurrent_forward``,
- ``kdakit.compat.sglang.chunk_kda`` (pool in place, sglang's keywords and ``A_log [1, 1, HV, 1]``),
- ``kdakit.compat.fla.chunk_kda`` (fla's keywords, K-major initial states gathered from the pool),
- fla-core's ``chunk_kda`` and, when importable (``.sglang-peer`` on ``PYTHONPATH``), sglang
  0.5.23's Triton ``chunk_kda``: the peers.

The reference (``ref64`` below) is written here, independent of kdakit.reference: token by
token in float64 on the GPU, all sequences of one length at once. Reported: relative norm
error ``|x - ref| / |ref|`` of the outputs (every token) and of the final states (the
sequences' slots), whether the pool's other slots are bitwise untouched, and whether every
output was written (outputs start as NaN for the calls that take an ``out``).

Input regimes (``--regimes``):
- ``model``: Kimi Linear's gate initialisation (``A_log = log U(1, 16)``, ``dt_bias`` the
  inverse softplus of ``U(0.001, 0.1)``), raw gate input ``0.5 · N(0, 1)``: per-token log-decays
  of about -0.002 to -0.5, so the state carries over thousands of tokens and the chunk-to-chunk
  chain decides the result.
- ``fla_test``: fla's own test distribution (``A_log = log U(1, 16)``, ``dt_bias ~ N(0, 1)``,
  raw gate ``N(0, 1)``): strong decay, the state forgets within tens of tokens.

``--pool-reuse`` also shows what a harness sees when it runs the implementations one after
the other on one pool without restoring it (sglang's and kdakit's calls update the pool in
place): kdakit then starts from the state sglang left, not from the initial state.

Run on a GPU: ``python benchmarks/gpu_prefill_accuracy.py [--quick]``; JSON to ``$OUT`` (or
benchmarks/results/) as ``prefill_accuracy_<gpu>.json``. Exit code 1 when a kdakit row is
less accurate than fla's on its case (outputs or states, with 10% grace for rounding noise).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kdakit  # noqa: E402
from kdakit.bench import harness  # noqa: E402
from kdakit.compat import fla as compat_fla  # noqa: E402
from kdakit.compat import sglang_chunk as compat_sglang  # noqa: E402
from kdakit.ops.chunk_prefill import ChunkConfig, chunk_config  # noqa: E402
from kdakit.ops.chunk_prefill import chunk_prefill_triton  # noqa: E402

K = V = 128
CASES = {"1x8192-H32": ([8192], 32), "8x2048-H32": ([2048] * 8, 32), "1x32768-H8": ([32768], 8),
         "64x512-H32": ([512] * 64, 32)}
QUICK = ("8x2048-H32",)
GATES = {"default": None, "safe": -5.0}
SLOTS_SPARE = 3


def make_inputs(seqlens, H, regime, seed, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    def uni(*shape):
        return torch.rand(*shape, device=device, generator=gen)
    N, T, HV = len(seqlens), sum(seqlens), H
    cu = torch.zeros(N + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(seqlens, device=device, dtype=torch.int32), 0)
    A_log = torch.log(1 + 15 * uni(HV))
    if regime == "model":
        dt = 0.001 + 0.099 * uni(HV * K)
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
        g = 0.5 * rnd(1, T, HV, K)
    elif regime == "fla_test":
        dt_bias = rnd(HV * K)
        g = rnd(1, T, HV, K)
    else:
        raise ValueError(f"unknown regime {regime!r}")
    slots = N + SLOTS_SPARE
    L = {"q": rnd(1, T, H, K).bfloat16(), "k": rnd(1, T, H, K).bfloat16(), "v": rnd(1, T, HV, V).bfloat16(),
         "g": g.bfloat16(), "beta": rnd(1, T, HV).bfloat16(), "A_log": A_log, "dt_bias": dt_bias,
         "state": rnd(slots, HV, V, K) * 0.5, "cu": cu,
         "idx": torch.randperm(slots, device=device, generator=gen)[:N].to(torch.int32)}
    return L


def ref64(L, lower_bound, scale):
    """Outputs [1, T, HV, V] and final states [N, HV, V, K], float64, token by token (the math of
    one token: L2 norm, gate, β = sigmoid(b), decay, delta update, o = S q̂)."""
    q, k, v = (L[n].double()[0] for n in ("q", "k", "v"))
    a, b = L["g"].double()[0], L["beta"].double()[0]
    A_log, dt_bias = L["A_log"].double(), L["dt_bias"].double()
    T, H, _ = q.shape
    HV = v.shape[1]
    rep = HV // H
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    x = a + dt_bias.view(HV, K)
    if lower_bound is None:
        gate = -torch.exp(A_log)[:, None] * torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))
    else:
        gate = lower_bound * torch.sigmoid(torch.exp(A_log)[:, None] * x)
    beta = torch.sigmoid(b)
    cu = L["cu"].tolist()
    N = len(cu) - 1
    out = torch.zeros(T, HV, V, dtype=torch.float64, device=q.device)
    final = torch.empty(N, HV, V, K, dtype=torch.float64, device=q.device)
    by_len = {}
    for n in range(N):
        by_len.setdefault(cu[n + 1] - cu[n], []).append(n)
    for length, seqs in by_len.items():
        starts = torch.tensor([cu[n] for n in seqs], device=q.device)
        S = L["state"].double()[L["idx"][seqs].long()]  # [n, HV, V, K]
        for t in range(length):
            tok = starts + t
            S = S * torch.exp(gate[tok])[:, :, None, :]
            kt = k[tok]
            u = beta[tok][:, :, None] * (v[tok] - torch.einsum("nhvk,nhk->nhv", S, kt))
            S = S + u[..., None] * kt[:, :, None, :]
            out[tok] = torch.einsum("nhvk,nhk->nhv", S, q[tok])
        final[seqs] = S
    return out[None], final


def rel(x, ref):
    if x is None:
        return None
    x = x.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm())


def sglang_peer():
    try:
        from sglang.kernels.ops.attention.fla.kda import chunk_kda
        return chunk_kda
    except Exception as exc:  # noqa: BLE001  (not on PYTHONPATH, or its imports fail here)
        print(f"sglang's Triton chunk_kda not importable: {exc!r}", flush=True)
        return None


def fla_peer():
    try:
        from fla.ops.kda import chunk_kda
        return chunk_kda
    except Exception as exc:  # noqa: BLE001
        print(f"fla's chunk_kda not importable: {exc!r}", flush=True)
        return None


def implementations(L, lb, scale, pool):
    """name -> callable(pool) returning (outputs [1, T, HV, V], final states [N, HV, V, K]); ``pool``
    is a fresh copy of the initial pool that the call may update."""
    HV = L["v"].shape[2]
    N = L["cu"].numel() - 1
    idx = L["idx"]
    T = L["q"].shape[1]
    common = dict(cu_seqlens=L["cu"], A_log=L["A_log"], dt_bias=L["dt_bias"], lower_bound=lb, beta_is_logit=True,
                  scale=scale)
    picked = chunk_config(N, HV, K, V, act_dtype=torch.bfloat16, T=T)
    impls = {}

    def native(op):
        def call(P):
            out = torch.full_like(L["v"], float("nan"))
            op(L["q"], L["k"], L["v"], L["g"], L["beta"], P, idx, out=out, **common)
            return out, P[idx.long()]
        return call
    impls["kdakit.chunk_prefill"] = native(kdakit.chunk_prefill)

    def forced(cfg):
        def call(P):
            out = torch.full_like(L["v"], float("nan"))
            chunk_prefill_triton(L["q"], L["k"], L["v"], L["g"], L["beta"], P, idx, out, cu_seqlens=L["cu"],
                                 scale=scale, use_qk_l2norm=True, A_log=L["A_log"], dt_bias=L["dt_bias"],
                                 lower_bound=lb, beta_mode=1, has_initial_state=None, chunk_states=None,
                                 chunk_state_indices=None, config=cfg)
            return out, P[idx.long()]
        return call
    f32_form = chunk_config(N, HV, K, V, act_dtype=torch.float32, T=T)  # float32 factors and products
    variants = {
        "update factors f32": ChunkConfig(**{**picked.__dict__, "update_factor_dtype": "float32"}),
        "float32 form, tf32": ChunkConfig(**{**f32_form.__dict__, "dot_precision": "tf32"}),
        "float32 form, tf32, q factor bf16": ChunkConfig(**{**f32_form.__dict__, "dot_precision": "tf32",
                                                            "factor_dtype": "bfloat16",
                                                            "update_factor_dtype": "float32"}),
        "float32 form, tf32x3": f32_form,
    }
    if picked.chain_pieces > 1:
        variants["one piece"] = ChunkConfig(**{**picked.__dict__, "chain_pieces": 1})
    if picked.outputs == "after_chain" or picked.chain_pieces > 1:
        variants["outputs in chain, one piece"] = ChunkConfig(**{**picked.__dict__, "chain_pieces": 1,
                                                                 "outputs": "in_chain"})
    for name, cfg in variants.items():
        if cfg != picked:
            impls[f"kdakit.chunk_prefill[{name}]"] = forced(cfg)

    impls["kdakit.recurrent_forward"] = native(kdakit.recurrent_forward)

    def dropin_sglang(P):
        o = compat_sglang.chunk_kda(L["q"], L["k"], L["v"], L["g"], L["beta"], scale=scale, initial_state=P,
                                    initial_state_indices=idx, use_qk_l2norm_in_kernel=True, cu_seqlens=L["cu"],
                                    A_log=L["A_log"].view(1, 1, HV, 1), dt_bias=L["dt_bias"], lower_bound=lb,
                                    beta_is_raw=True)
        return o, P[idx.long()]
    impls["kdakit.compat.sglang.chunk_kda"] = dropin_sglang

    def fla_kwargs():
        return dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, safe_gate=lb is not None, lower_bound=lb,
                    cu_seqlens=L["cu"].long(), A_log=L["A_log"], dt_bias=L["dt_bias"])

    def dropin_fla(P):
        h0 = P[idx.long()].transpose(-1, -2).contiguous()  # fla's K-major [N, HV, K, V]
        o, ht = compat_fla.chunk_kda(L["q"], L["k"], L["v"], L["g"], L["beta"], initial_state=h0, **fla_kwargs())
        return o, ht.transpose(-1, -2)
    impls["kdakit.compat.fla.chunk_kda"] = dropin_fla

    fla = fla_peer()
    if fla is not None:
        def peer_fla(P):
            h0 = P[idx.long()].transpose(-1, -2).contiguous()
            o, ht = fla(q=L["q"], k=L["k"], v=L["v"], g=L["g"], beta=L["beta"], initial_state=h0, **fla_kwargs())
            return o, ht.transpose(-1, -2)
        impls["fla-core chunk_kda"] = peer_fla
    sgl = sglang_peer()
    if sgl is not None:
        def peer_sglang(P):
            o = sgl(L["q"], L["k"], L["v"], L["g"], L["beta"], scale=scale, initial_state=P,
                    initial_state_indices=idx, use_qk_l2norm_in_kernel=True, cu_seqlens=L["cu"],
                    A_log=L["A_log"].view(1, 1, HV, 1), dt_bias=L["dt_bias"], lower_bound=lb, beta_is_raw=True)
            o = o[0] if isinstance(o, tuple) else o
            return o, P[idx.long()]
        impls["sglang chunk_kda (Triton)"] = peer_sglang
    return impls


def run_case(case, regime, gate, seed, pool_reuse=False):
    lens, H = CASES[case]
    lb = GATES[gate]
    scale = K ** -0.5
    L = make_inputs(lens, H, regime, seed)
    t0 = time.perf_counter()
    ref_out, ref_final = ref64(L, lb, scale)
    t_ref = time.perf_counter() - t0
    rows = []
    live = L["idx"].long()
    unused = torch.ones(L["state"].shape[0], dtype=torch.bool, device="cuda")
    unused[live] = False
    impls = implementations(L, lb, scale, L["state"])
    for name, call in impls.items():
        P = L["state"].clone()
        row = {"case": case, "regime": regime, "gate": gate, "impl": name}
        try:
            out, final = call(P)
            torch.cuda.synchronize()
            row["out_err"] = rel(out, ref_out)
            row["state_err"] = rel(final, ref_final)
            row["untouched"] = bool(torch.equal(P[unused], L["state"][unused]))
        except Exception as exc:  # noqa: BLE001  (a peer that refuses the case: recorded, not fatal)
            row["error"] = repr(exc)[:300]
        rows.append(row)
        print(f"  {name:48s} out {row.get('out_err', float('nan')):.3e}  state {row.get('state_err', float('nan')):.3e}"
              f"  untouched {row.get('untouched')}  {row.get('error', '')}", flush=True)
    if pool_reuse and "sglang chunk_kda (Triton)" in impls:
        P = L["state"].clone()  # one pool for all, as a harness that forgets to restore it
        for name in ("fla-core chunk_kda", "sglang chunk_kda (Triton)", "kdakit.chunk_prefill"):
            out, final = impls[name](P)
        torch.cuda.synchronize()
        row = {"case": case, "regime": regime, "gate": gate, "impl": "kdakit.chunk_prefill after sglang on one pool",
               "out_err": rel(out, ref_out), "state_err": rel(final, ref_final)}
        rows.append(row)
        print(f"  {row['impl']:48s} out {row['out_err']:.3e}  state {row['state_err']:.3e}", flush=True)
    print(f"  (float64 reference {t_ref:.1f} s)", flush=True)
    del L, ref_out, ref_final
    torch.cuda.empty_cache()
    return rows


def verdict(rows):
    """Per (case, regime, gate): kdakit's native call and drop-ins at least as accurate as fla's (10% grace)."""
    ok, groups = True, {}
    for r in rows:
        groups.setdefault((r["case"], r["regime"], r["gate"]), []).append(r)
    for key, group in groups.items():
        fla = next((r for r in group if r["impl"] == "fla-core chunk_kda" and "out_err" in r), None)
        for r in group:
            if not r["impl"].startswith("kdakit") or "[" in r["impl"] or "one pool" in r["impl"]:
                continue
            good = ("out_err" in r and math.isfinite(r["out_err"]) and r.get("untouched", True))
            if fla is not None and good:
                good = r["out_err"] <= 1.1 * fla["out_err"] + 1e-6 and r["state_err"] <= 1.1 * fla["state_err"] + 1e-6
            r["at_least_as_accurate_as_fla"] = bool(good)
            ok &= good
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=None, help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--regimes", default="model,fla_test")
    p.add_argument("--gates", default="default,safe")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--pool-reuse", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_prefill_accuracy: needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = args.cases.split(",") if args.cases else list(QUICK if args.quick else
                                                          ("1x8192-H32", "8x2048-H32", "1x32768-H8"))
    rows = []
    for i, case in enumerate(cases):
        for regime in args.regimes.split(","):
            for gate in args.gates.split(","):
                print(f"{case} {regime} {gate}", flush=True)
                rows += run_case(case, regime, gate, seed=100 + i, pool_reuse=args.pool_reuse)
    ok = verdict(rows)
    env = harness.environment()
    gpu = next((m.lower() for m in ("H100", "H200", "B200") if m in env.get("gpu", "")), "gpu")
    results = {"env": env, "shape": {"K": K, "V": V, "activations": "bfloat16", "state": "float32"},
               "rows": rows, "ok": ok}
    folder = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    path = harness.save(results, args.name or f"prefill_accuracy_{gpu}", folder)
    print()
    print(f"{'case':12s} {'regime':8s} {'gate':7s} {'implementation':48s} {'out err':>9s} {'state err':>9s}")
    for r in rows:
        print(f"{r['case']:12s} {r['regime']:8s} {r['gate']:7s} {r['impl']:48s} "
              f"{r.get('out_err', float('nan')):9.2e} {r.get('state_err', float('nan')):9.2e}"
              + ("" if r.get("at_least_as_accurate_as_fla", True) else "  WORSE THAN FLA")
              + (f"  {r['error'][:60]}" if "error" in r else ""))
    print(f"ok={ok}; JSON: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
