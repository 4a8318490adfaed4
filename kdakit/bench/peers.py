"""`kdakit bench --peers`: on this GPU, kdakit beside the KDA kernels the user's engine ships.

One process, one GPU: ``kdakit check`` first (every backend against the float64 reference,
the engine-size rows included), then for every row below each implementation's agreement
with kdakit's on its own fresh copy of the same inputs, then the times, each implementation
on its own inputs and pools:

- packed decode, float32 and bf16 pools (N = 1, 8, 32, 128, 512): kdakit, sglang's Triton
  kernel, fla-core's ``fused_recurrent_kda_fwd``; floor = the state read and written at the
  copy ceiling;
- eager host cost of one packed-decode call at N = 1 (back to back, one sync at the end):
  ``kdakit.packed_decode``, the sglang drop-in ``kdakit.compat.sglang``, sglang, fla; and of one
  call of each other public op at a small size (``eager`` group);
- chain verify (1, 3, 7 drafted tokens; also 15 beside the 16-node tree) in snapshot and ring
  modes, tree verify (8 and 16 nodes, EAGLE top-2) in both modes, against sglang's target
  verify (snapshots, or its ReplaySSM ring write); floors: the state read plus the snapshots
  written, or the state read alone (ring);
- the varlen conv (C = 12288, W = 4, bf16; 1 x 8192, 8 x 1024, 8 mixed lengths, 64 x 128),
  x as the engine's row-major projection (sglang: its ``[C, T]`` view) and kdakit also on a
  channel-major x; floor = x read + out written;
- the chunked prefill (1 x 8192, 8 x 2048, 64 x 512 at H = 32; 1 x 32768 at H = 8; default and
  safe gate) against sglang's Triton ``chunk_kda`` and fla-core's ``chunk_kda`` (gather and
  scatter around it); floor = q, k, v, g, β read and o written, plus the states.

Times: a CUDA graph over enough independent layers that the working set streams from HBM
(``harness.graph_time_us``); an implementation that cannot be captured is timed eagerly with
CUDA events (its cell says ``eager``). A peer that is not installed, fails its call, or
disagrees with kdakit is a cell saying so, never a crash: disagreeing peers are not timed.

``--json PATH`` writes the whole record (GPU, date, command, copy ceiling at start and end,
versions of torch, Triton and each peer); ``--results DIR`` also writes the summaries
``extend_vs_peers_<gpu>.json`` and ``decode_vs_peers_<gpu>.json``. ``--quick`` runs a subset.
``--cpu-interpret`` runs every row at tiny sizes through Triton's interpreter (the logic,
not the speed: its times mean nothing).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from . import harness, inputs, peer_calls as pc

AGREE_TOL = 2e-2  # relative norm error between two implementations of bf16-activation calls


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The rows of one run. ``device`` "cuda" (timed) or "cpu" (interpreted, tiny)."""
    device: str
    H: int
    K: int
    W: int
    decode_ns: tuple
    bf16_decode_ns: tuple
    verify_ns: tuple
    chain_drafts: tuple
    tree_nodes: tuple
    conv_channels: int
    conv_cases: tuple      # (name, lengths)
    prefill_cases: tuple   # (name, lengths, H)
    gates: tuple = (None, -5.0)
    eager_iters: int = 2000


def _mixed_lengths(total, n, seed=7):
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(1, total, (n - 1,), generator=gen).tolist())
    lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    return [max(1, x) for x in lens]


FULL = Sizes(device="cuda", H=32, K=128, W=4, decode_ns=(1, 8, 32, 128, 512), bf16_decode_ns=(1, 8, 32, 128, 512),
             verify_ns=(8, 64, 256), chain_drafts=(1, 3, 7, 15), tree_nodes=(8, 16), conv_channels=12288,
             conv_cases=(("1x8192", [8192]), ("8x1024", [1024] * 8), ("8-mixed", _mixed_lengths(8192, 8)),
                         ("64x128", [128] * 64)),
             prefill_cases=(("1x8192-H32", [8192], 32), ("8x2048-H32", [2048] * 8, 32), ("64x512-H32", [512] * 64, 32),
                            ("1x32768-H8", [32768], 8)))
QUICK = dataclasses.replace(FULL, decode_ns=(8, 128, 512), bf16_decode_ns=(8, 512), verify_ns=(64,),
                            chain_drafts=(3, 15), tree_nodes=(16,), conv_cases=FULL.conv_cases[:2],
                            prefill_cases=FULL.prefill_cases[:2])
CPU = Sizes(device="cpu", H=2, K=16, W=4, decode_ns=(1, 3), bf16_decode_ns=(3,), verify_ns=(2,), chain_drafts=(1, 3),
            tree_nodes=(5,), conv_channels=48, conv_cases=(("2-mixed", [5, 3]),),
            prefill_cases=(("2-mixed", [70, 5], 2),), gates=(None, -5.0), eager_iters=3)


def rel(x, y, chunk: int = 1 << 24) -> float:
    """``|x - y| / |y|`` in float64, a chunk of elements at a time (the verify rows' snapshots
    are several GB: a float64 copy of the whole would not fit beside them)."""
    x, y = x.reshape(-1), y.reshape(-1)
    diff = ref = 0.0
    for i in range(0, x.numel(), chunk):
        a, b = x[i:i + chunk].double(), y[i:i + chunk].double()
        if not torch.isfinite(a).all():
            return float("inf")
        diff += float(((a - b) ** 2).sum())
        ref += float((b ** 2).sum())
    return (diff / max(ref, 1e-60)) ** 0.5


def agreement(ref: dict, other: dict) -> float:
    return max(rel(other[k], ref[k]) for k in ref if k in other)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def cpu_time_us(calls) -> float:
    """µs per call of one pass of ``calls`` on the CPU (the interpreter: the logic, not a speed)."""
    for call in calls:
        call()
    t0 = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - t0) * 1e6 / len(calls)


def time_calls(calls, device) -> tuple[float, str]:
    """(µs per call, "graph" | "eager")."""
    if device != "cuda":
        return cpu_time_us(calls), "interpreted"
    try:
        return harness.graph_time_us(calls), "graph"
    except Exception:  # noqa: BLE001  (a host sync or allocation the capture refuses)
        torch.cuda.synchronize()
        return harness.eager_time_us(calls), "eager"


class Runner:
    """Builds, checks and times one row's implementations; collects rows and progress."""

    def __init__(self, sizes: Sizes, peers: dict, progress=print, on_row=None):
        self.s, self.peers, self.progress, self.on_row = sizes, peers, progress, on_row
        self.rows, self.ceiling = [], None
        self.t0 = time.perf_counter()

    def _add(self, row):
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(self.rows)

    def peer(self, name):
        p = self.peers.get(name)
        return p if isinstance(p, dict) else None

    def cell(self, op, case, impls, moved_bytes, *, layers_bytes=None, unit="us", **extra):
        """``impls``: {name: (make(seed) -> Call) or None or a str reason}; kdakit's first.
        Agreement on seed 0 against kdakit's result, then times over fresh layers."""
        dev = self.s.device
        row = {"op": op, "case": case, "unit": unit, **extra, "floor": None, "agree": {}, "timing": {}}
        if self.ceiling and moved_bytes:
            row["floor"] = moved_bytes / (self.ceiling * 1e3)
        ref = None
        for name, make in impls.items():
            if make is None or isinstance(make, str):
                row[name] = None
                row["agree"][name] = make or "not installed"
                continue
            try:
                call = make(0)
                call.run()
                _sync(dev)
                res = call.result()
                if ref is None:
                    ref, err = res, 0.0
                else:
                    err = agreement(ref, res)
                row["agree"][name] = round(err, 7)
                del call, res
                if err > AGREE_TOL:
                    row[name] = None
                    row["agree"][name] = f"disagrees with kdakit ({err:.2e}): not timed"
                    continue
                n_layers = harness.layers_for(layers_bytes or moved_bytes or 1) if dev == "cuda" else 1
                built = [make(seed) for seed in range(n_layers)]
                t, how = time_calls([c.run for c in built], dev)
                del built
                row[name], row["timing"][name] = t / (1e3 if unit == "ms" else 1), how
            except Exception as exc:  # noqa: BLE001  (the table says what failed; other cells go on)
                row[name] = None
                row["agree"][name] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
            if dev == "cuda":
                torch.cuda.empty_cache()
        if row["floor"] is not None and unit == "ms":
            row["floor"] /= 1e3
        self._add(row)
        cells = "  ".join(f"{n} {_fmt(row.get(n))}" for n in impls)
        self.progress(f"[{time.perf_counter() - self.t0:6.1f} s] {op:22s} {case:16s} {cells}")
        return row

    def eager_cell(self, op, case, impls):
        """Host µs of one eager call, back to back (``harness.eager_host_us``)."""
        dev = self.s.device
        row = {"op": op, "case": case, "unit": "us", "floor": None, "agree": {}, "timing": {}}
        for name, make in impls.items():
            if make is None or isinstance(make, str):
                row[name], row["agree"][name] = None, make or "not installed"
                continue
            try:
                call = make(0)
                if dev == "cuda":
                    row[name] = harness.eager_host_us(call.run, self.s.eager_iters)
                else:
                    t0 = time.perf_counter()
                    for _ in range(self.s.eager_iters):
                        call.run()
                    row[name] = (time.perf_counter() - t0) / self.s.eager_iters * 1e6
                row["timing"][name] = "eager host"
            except Exception as exc:  # noqa: BLE001
                row[name], row["agree"][name] = None, f"error: {type(exc).__name__}: {str(exc)[:160]}"
        self._add(row)
        self.progress(f"[{time.perf_counter() - self.t0:6.1f} s] {op:22s} {case:16s} "
                      + "  ".join(f"{n} {_fmt(row.get(n))}" for n in impls))
        return row


def _fmt(v):
    return "—" if v is None else f"{v:.3g}"


# ------------------------------------------------------------------------------------------
# The rows
# ------------------------------------------------------------------------------------------
def decode_rows(r: Runner):
    s, dev = r.s, r.s.device
    H = HV = s.H
    K = V = s.K
    sgl, fla = r.peer("sglang"), r.peer("fla")
    for state_dtype, ns in ((torch.float32, s.decode_ns), (torch.bfloat16, s.bf16_decode_ns)):
        tag = "packed_decode_" + ("fp32" if state_dtype == torch.float32 else "bf16")
        for N in ns:
            def mk(seed, N=N, sd=state_dtype):
                return inputs.packed_decode_inputs(N, H, HV, K, V, state_dtype=sd, seed=seed, device=dev)
            impls = {"kdakit": lambda seed, mk=mk: pc.packed_decode_kdakit(mk(seed), H),
                     "sglang": (lambda seed, mk=mk: pc.packed_decode_sglang(sgl, mk(seed), H)) if sgl else
                     r.peers["sglang"],
                     "fla": (lambda seed, mk=mk: pc.packed_decode_fla(fla, mk(seed), H)) if fla else r.peers["fla"]}
            moved = 2 * N * HV * V * K * state_dtype.itemsize
            r.cell(tag, f"N={N}", impls, moved, N=N)
    # Host cost of one eager call at N = 1.
    def mk1(seed):
        return inputs.packed_decode_inputs(1, H, HV, K, V, seed=seed, device=dev)
    r.eager_cell("eager_host", "N=1", {
        "kdakit": lambda seed: pc.packed_decode_kdakit(mk1(seed), H),
        "kdakit_dropin": lambda seed: pc.packed_decode_dropin(mk1(seed), H),
        "sglang": (lambda seed: pc.packed_decode_sglang(sgl, mk1(seed), H)) if sgl else r.peers["sglang"],
        "fla": (lambda seed: pc.packed_decode_fla(fla, mk1(seed), H)) if fla else r.peers["fla"]})


def eager_rows(r: Runner):
    """Host µs of one eager call of the other public ops at a small size (engines run the
    extend path and warm-ups eagerly, many layers a step)."""
    import kdakit
    s, dev = r.s, r.s.device
    H = HV = s.H
    K = V = s.K

    def verify(seed):
        L = inputs.mtp_verify_inputs(1, 4, H, HV, K, V, conv=False, mode="snapshot", seed=seed, device=dev)
        return pc.verify_kdakit(L, "snapshot")

    def tree(seed):
        L = inputs.mtp_verify_inputs(1, 4, H, HV, K, V, conv=False, mode="snapshot", seed=seed, device=dev)
        return pc.verify_kdakit(L, "snapshot", torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32, device=dev))

    def fused(seed):
        L = inputs.fused_decode_inputs(1, H, HV, K, V, W=s.W, seed=seed, device=dev)
        return pc.Call(lambda: kdakit.fused_decode(L["qkv"], L["conv_weight"], L["conv_state"], L["a"], L["b"],
                                                   L["A_log"], L["dt_bias"], L["state"], L["idx"],
                                                   norm_gate=L["norm_gate"], norm_weight=L["norm_weight"],
                                                   out=L["out"]), lambda: {"out": L["out"]})

    def recurrent(seed):
        L = inputs.varlen_inputs([1], H, HV, K, V, seed=seed, device=dev)
        return pc.Call(lambda: kdakit.recurrent_forward(L["q"], L["k"], L["v"], L["g"], L["beta"], L["state"], L["idx"],
                                                        cu_seqlens=L["cu"], A_log=L["A_log"], dt_bias=L["dt_bias"],
                                                        beta_is_logit=True, out=L["out"]), lambda: {"out": L["out"]})
    for op, make in (("mtp_verify", verify), ("tree_verify", tree), ("fused_decode", fused),
                     ("recurrent_forward", recurrent),
                     ("chunk_prefill", lambda seed: pc.prefill_kdakit(inputs.varlen_inputs([64], H, HV, K, V, seed=seed,
                                                                                           device=dev), None)),
                     ("causal_conv1d_varlen", lambda seed: pc.conv_kdakit(pc.conv_inputs([64], 3 * H * K, s.W,
                                                                                         x_layout="rows", seed=seed,
                                                                                         device=dev)))):
        r.eager_cell("eager_host", op, {"kdakit": make})


def verify_rows(r: Runner):
    s, dev = r.s, r.s.device
    H = HV = s.H
    K = V = s.K
    sgl = r.peer("sglang")
    state_bytes = HV * V * K * 4
    shapes = [("chain", 1 + d) for d in s.chain_drafts] + [("tree", t) for t in s.tree_nodes]
    for kind, T in shapes:
        for mode in ("snapshot", "ring"):
            for N in s.verify_ns:
                def mk(seed, N=N, T=T, mode=mode):
                    return inputs.mtp_verify_inputs(N, T, H, HV, K, V, conv=False, mode=mode, seed=seed, device=dev)

                def parents_for(N, T=T, kind=kind):
                    if kind == "chain":
                        return None
                    return torch.tensor([inputs.top2_parents(T)] * N, dtype=torch.int32, device=dev)
                impls = {"kdakit": lambda seed, mk=mk, N=N, mode=mode: pc.verify_kdakit(mk(seed), mode, parents_for(N)),
                         "sglang": (lambda seed, mk=mk, N=N, mode=mode: pc.verify_sglang(sgl, mk(seed), mode,
                                                                                        parents_for(N)))
                         if sgl else r.peers["sglang"]}
                if kind == "tree" and mode == "ring":
                    impls["sglang"] = "no such mode in sglang: its tree verify reads each parent's snapshot"
                # snapshot: the state read and one snapshot per node written; ring: the state read
                # (the one-state floor; the ring entries are the step's inputs, a few KB).
                moved = N * state_bytes * (1 + T if mode == "snapshot" else 1)
                r.cell(f"{kind}_{mode}", f"N={N} T={T}", impls, moved, N=N, nodes=T,
                       layers_bytes=N * state_bytes * (1 + T))


def conv_rows(r: Runner):
    s, dev = r.s, r.s.device
    sgl = r.peer("sglang")
    C, W = s.conv_channels, s.W
    for name, lengths in s.conv_cases:
        T, N = sum(lengths), len(lengths)
        moved = 2 * T * C * 2 + 2 * N * C * (W - 1) * 2  # x read, out written; the windows read and written
        for layout in ("rows", "channels"):
            def mk(seed, lengths=lengths, layout=layout):
                return pc.conv_inputs(lengths, C, W, x_layout=layout, seed=seed, device=dev)
            impls = {"kdakit": lambda seed, mk=mk: pc.conv_kdakit(mk(seed))}
            if layout == "rows":
                impls["sglang"] = (lambda seed, mk=mk: pc.conv_sglang(sgl, mk(seed))) if sgl else r.peers["sglang"]
            r.cell("conv", f"{name} x-{layout}", impls, moved, tokens=T)


def prefill_rows(r: Runner):
    s, dev = r.s, r.s.device
    K = V = s.K
    sgl, fla = r.peer("sglang"), r.peer("fla")
    for name, lengths, H in s.prefill_cases:
        T, N = sum(lengths), len(lengths)
        moved = T * (2 * H * K + H * V + H * K + H) * 2 + T * H * V * 2 + 2 * N * H * V * K * 4
        for gate in s.gates:
            def mk(seed, lengths=lengths, H=H):
                return inputs.varlen_inputs(lengths, H, H, K, V, seed=seed, device=dev)
            impls = {"kdakit": lambda seed, mk=mk, gate=gate: pc.prefill_kdakit(mk(seed), gate),
                     "sglang": (lambda seed, mk=mk, gate=gate: pc.prefill_sglang(sgl, mk(seed), gate))
                     if sgl else r.peers["sglang"],
                     "fla": (lambda seed, mk=mk, gate=gate: pc.prefill_fla(fla, mk(seed), gate))
                     if fla else r.peers["fla"]}
            r.cell("chunk_prefill", name, impls, moved, unit="ms" if dev == "cuda" else "us", gate=gate, tokens=T)


GROUPS = {"decode": decode_rows, "eager": eager_rows, "verify": verify_rows, "conv": conv_rows,
          "prefill": prefill_rows}


# ------------------------------------------------------------------------------------------
# The run, its table and its files
# ------------------------------------------------------------------------------------------
def versions(peers) -> dict:
    import triton
    out = {"torch": torch.__version__, "triton": triton.__version__}
    from importlib import metadata
    for dist in ("kdakit", "sglang", "fla-core", "vllm", "flash-kda"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    if isinstance(peers.get("sglang"), dict) and out["sglang"] is None:
        out["sglang"] = "kernel files on PYTHONPATH (sglang 0.5.23's wheel)"
    return out


def run(sizes: Sizes, groups=tuple(GROUPS), *, check=None, progress=print, partial_json=None) -> dict:
    """The whole record. ``partial_json``: a path rewritten after every row (``"partial": true``),
    so that a run cut short still leaves its rows. ``check``: ``kdakit.check.run`` (passed in by
    the command line, which sits above both), run first on the same device; None skips it."""
    peers = pc.find_peers()
    result = {"env": harness.environment() if sizes.device == "cuda" else
              {"gpu": None, "device": "cpu (Triton interpreter)", "command": " ".join(sys.argv)},
              "versions": versions(peers), "peers": {k: ("importable" if isinstance(v, dict) else v)
                                                      for k, v in peers.items()},
              "vllm": "not timed: kdakit's vLLM rows come with its vLLM plugin"}
    for name, v in result["peers"].items():
        progress(f"peer {name}: {v}")
    if check is not None:
        rows = check(sizes.device)
        result["check"] = {"agree": sum(r["ok"] for r in rows), "of": len(rows),
                           "failed": [f"{r['op']} {r['backend']}" for r in rows if not r["ok"]]}
        progress(f"kdakit check: {result['check']['agree']} of {result['check']['of']} agree with float64"
                 + (f"; failed: {result['check']['failed']}" if result["check"]["failed"] else ""))
    def save_partial(rows):
        with open(partial_json, "w") as f:
            json.dump({**result, "partial": True, "rows": rows}, f, indent=1)
    r = Runner(sizes, peers, progress, on_row=save_partial if partial_json else None)
    if sizes.device == "cuda":
        r.ceiling = result["copy_ceiling_GBps"] = round(harness.copy_ceiling_gbps(), 1)
        progress(f"copy ceiling {r.ceiling} GB/s")
    for g in groups:
        GROUPS[g](r)
    if sizes.device == "cuda":
        result["copy_ceiling_GBps_end"] = round(harness.copy_ceiling_gbps(), 1)
    result["rows"] = r.rows
    result["seconds"] = round(time.perf_counter() - r.t0, 1)
    return result


IMPL_ORDER = ("kdakit", "kdakit_dropin", "sglang", "fla")


def table_lines(result) -> list[str]:
    lines = [f"{'op':22s} {'case':20s} {'unit':4s} {'floor':>8s} " + " ".join(f"{n:>13s}" for n in IMPL_ORDER)
             + "  kdakit vs best peer"]
    for row in result["rows"]:
        cells = []
        for n in IMPL_ORDER:
            v = row.get(n)
            if n not in row:
                cells.append(f"{'':>13s}")
            elif v is None:
                cells.append(f"{'—':>13s}")
            else:
                cells.append(f"{v:13.4g}" if row["timing"].get(n) != "eager" else f"{v:12.4g}e")
        peers = [row[n] for n in ("sglang", "fla") if row.get(n)]
        ratio = (f"{min(peers) / row['kdakit']:.2f}x" if peers and row.get("kdakit") else "")
        floor = f"{row['floor']:8.3g}" if row.get("floor") else f"{'':>8s}"
        case = row["case"] + (f" g={row['gate']}" if row.get("gate") is not None else "")
        lines.append(f"{row['op']:22s} {case:20s} {row['unit']:4s} {floor} " + " ".join(cells) + f"  {ratio}")
    return lines


def markdown_lines(result) -> list[str]:
    """The README's performance table from a run's record: each row's kdakit time, each peer's,
    the floor and kdakit's speed against the best peer (above 1: kdakit faster)."""
    env = result["env"]
    lines = [f"{env.get('gpu') or env.get('device')}, {str(env.get('date', ''))[:10]}, copy ceiling "
             f"{result.get('copy_ceiling_GBps', '—')} GB/s; `{env.get('command', '')}`", "",
             "| op | case | unit | floor | kdakit | sglang | fla | kdakit vs best peer |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(v):
        return "—" if v is None else f"{v:.4g}"
    for row in result["rows"]:
        peers = [row[n] for n in ("sglang", "fla") if row.get(n)]
        ratio = f"{min(peers) / row['kdakit']:.2f}x" if peers and row.get("kdakit") else "—"
        case = row["case"] + (f", gate {row['gate']}" if row.get("gate") is not None else "")
        kd = cell(row.get("kdakit")) + (f" (drop-in {cell(row['kdakit_dropin'])})" if "kdakit_dropin" in row else "")
        lines.append(f"| {row['op']} | {case} | {row['unit']} | {cell(row.get('floor'))} | {kd} | "
                     f"{cell(row.get('sglang'))} | {cell(row.get('fla'))} | {ratio} |")
    return lines


def gpu_tag(name: str | None) -> str:
    name = (name or "cpu").lower()
    for tag in ("h100", "h200", "h20", "b200", "a100", "l40s"):
        if tag in name:
            return tag
    return "".join(ch for ch in name if ch.isalnum())[:16] or "gpu"


def summaries(result) -> dict:
    """The issues' summary files: extend_vs_peers (conv, chunk_prefill) and decode_vs_peers."""
    env = result["env"]
    head = {"gpu": env.get("gpu"), "date": env.get("date"), "command": env.get("command"),
            "copy_ceiling_GBs": result.get("copy_ceiling_GBps"), "versions": result["versions"]}

    def pick(row, **extra):
        return {**extra, "unit": row["unit"], "floor": row["floor"], "kdakit": row.get("kdakit"),
                "sglang": row.get("sglang"), "fla": row.get("fla"), "timing": row["timing"], "agree": row["agree"]}
    extend, decode = [], []
    for row in result["rows"]:
        if row["op"] == "conv":
            extend.append(pick(row, op="conv", case=row["case"], gate=None))
        elif row["op"] == "chunk_prefill":
            extend.append(pick(row, op="chunk_prefill", case=row["case"], gate=row.get("gate")))
        elif row["op"] == "eager_host" and row["case"] == "N=1":
            decode.append(pick(row, op="eager_host", N=1, nodes=None))
            decode.append({**pick(row, op="eager_host_dropin", N=1, nodes=None), "kdakit": row.get("kdakit_dropin")})
        elif row["op"] == "eager_host":
            decode.append(pick(row, op=f"eager_host_{row['case']}", N=1, nodes=None))
        else:
            decode.append(pick(row, op=row["op"], N=row.get("N"), nodes=row.get("nodes")))
    return {"extend_vs_peers": {**head, "rows": extend}, "decode_vs_peers": {**head, "rows": decode}}


def add_arguments(p) -> None:
    p.add_argument("--json", default=None, help="with --peers: write the whole record here")
    p.add_argument("--results", default=None, help="with --peers: also write extend_vs_peers_<gpu>.json and "
                   "decode_vs_peers_<gpu>.json into this folder")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"with --peers: comma-separated, from {', '.join(GROUPS)}")
    p.add_argument("--no-check", action="store_true", help="with --peers: skip `kdakit check`")
    p.add_argument("--cpu-interpret", action="store_true",
                   help="with --peers: every row at tiny sizes through Triton's interpreter on the CPU")


def main(args, check=None) -> int:
    """``check``: ``kdakit.check.run`` (the command line passes it), skipped with ``--no-check``."""
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        print(f"kdakit bench --peers: unknown group(s) {unknown}; choose from {', '.join(GROUPS)}.", file=sys.stderr)
        return 2
    if args.cpu_interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is jitted: run the command again with it
            os.execv(sys.executable, [sys.executable, "-m", "kdakit", *sys.argv[1:]])
        os.environ.setdefault("KDAKIT_BACKEND", "triton")  # the kernels, not the PyTorch reference
        sizes = CPU
    else:
        if not torch.cuda.is_available():
            print("kdakit bench --peers: no CUDA GPU here; it times kdakit against your engine's kernels on a GPU. "
                  "`kdakit bench --peers --cpu-interpret` runs its rows at tiny sizes through Triton's interpreter.",
                  file=sys.stderr)
            return 2
        sizes = QUICK if args.quick else FULL
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    result = run(sizes, groups, check=None if args.no_check else check, progress=lambda line: print(line, flush=True),
                 partial_json=args.json)
    print()
    for line in table_lines(result):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"JSON: {args.json}")
    if args.results:
        os.makedirs(args.results, exist_ok=True)
        for stem, summary in summaries(result).items():
            path = os.path.join(args.results, f"{stem}_{gpu_tag(result['env'].get('gpu'))}.json")
            with open(path, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"summary: {path}")
    check_ok = not result.get("check", {}).get("failed")
    errors = [(row["op"], row["case"]) for row in result["rows"] if row.get("kdakit") is None]
    if errors:
        print(f"kdakit did not run on: {errors}", file=sys.stderr)
    return 0 if check_ok and not errors else 1
