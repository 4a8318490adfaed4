"""One process driving two GPUs: every public op on ``cuda:0`` and ``cuda:1``, against the same call
on one device.

    python benchmarks/gpu_multi_device_check.py [--out DIR]     # a host with two GPUs

For every op of the registry (``kdakit.ops.registry.OPS``, its example inputs: seeded on the
CPU, the same values on every device):

- single: the call on ``cuda:0`` alone; every tensor of the call afterwards (outputs, pools
  written in place, read-only inputs) is the yardstick;
- alternating: fresh inputs on both devices, the op called on ``cuda:1``, ``cuda:0``,
  ``cuda:1``, ``cuda:0`` in turn: every result bitwise the yardstick;
- graphs: on each device, a CUDA graph captured (on that device's stream) on fresh inputs
  and replayed: bitwise the yardstick;
- placement: ``torch.cuda.current_device()`` is the same before and after every call (kdakit
  launches on the device of its tensors without changing the caller's current device), and
  every tensor stays on its device.

Then the error counters: a packed decode on ``cuda:1`` with one slot past the pool counts one
row in ``cuda:1``'s counter and none in ``cuda:0``'s (``kdakit.errors.counters``), and
``take_errors()`` reports it once. Prints a table; JSON ``multi_device_check_<gpu>.json``
(GPU names, rows, ok) to ``--out`` (default ``$OUT`` or benchmarks/results/); exit code 0
only when every check passes.

``--devices cpu,cpu`` runs the eager checks on the CPU (the PyTorch reference; no graphs, no
counters per device): how the script's logic is checked on a machine without GPUs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kdakit  # noqa: E402
from kdakit import errors  # noqa: E402
from kdakit.ops.registry import OPS  # noqa: E402


def tensors(args, kw):
    """Every tensor of a call, in a fixed order (nested tuples and lists included)."""
    found = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
    walk(list(args))
    walk([kw[k] for k in sorted(kw)])
    return found


def same(got, want):
    if len(got) != len(want):
        return False
    return all(g.dtype == w.dtype and g.shape == w.shape and torch.equal(g.cpu(), w) for g, w in zip(got, want))


def call_on(name, seed, device):
    """Run op ``name``'s example on ``device``; the call's tensors (moved to the CPU) and whether
    the current device and every tensor's device stayed as they were."""
    op, args, kw = OPS[name].example(seed, device=device)
    before = torch.cuda.current_device() if torch.device(device).type == "cuda" else None
    op(*args, **kw)
    placed = all(t.device == torch.device(device) for t in tensors(args, kw))
    if before is not None:
        torch.cuda.synchronize(device)
        placed &= torch.cuda.current_device() == before
    return [t.cpu() for t in tensors(args, kw)], placed


def graph_on(name, seed, device):
    """Capture op ``name``'s example on ``device`` in a CUDA graph (fresh inputs), replay once."""
    op, args, kw = OPS[name].example(seed, device=device)
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            op(*args, **kw)
        graph.replay()
        torch.cuda.synchronize()
    return [t.cpu() for t in tensors(args, kw)]


def check_op(name, devices, cuda):
    row = {"op": name}
    want, placed = call_on(name, 0, devices[0])
    row["placement"] = placed
    for d in devices[1:]:
        got, placed = call_on(name, 0, d)
        row[f"single on {d}"] = same(got, want)
        row["placement"] &= placed
    results = []
    for d in [devices[1], devices[0], devices[1], devices[0]]:  # alternating, fresh inputs each time
        got, placed = call_on(name, 0, d)
        results.append(same(got, want))
        row["placement"] &= placed
    row["alternating"] = all(results)
    if cuda:
        for d in devices:  # (each device ran the op eagerly above: its kept buffers exist)
            row[f"graph on {d}"] = same(graph_on(name, 0, d), want)
    row["ok"] = all(v for k, v in row.items() if k != "op")
    return row


def check_counters(devices):
    """A slot past the pool on devices[1]: counted there only."""
    from kdakit.bench.inputs import packed_decode_inputs
    kdakit.take_errors()
    row = {"op": "error counters"}
    L = packed_decode_inputs(4, 2, 2, 16, 16, device=devices[1])
    L["idx"][0] = L["state"].shape[0] + 3
    kdakit.packed_decode(L["mixed"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"], L["idx"], L["out"])
    i = errors.INDEX["packed_decode"]
    counts = {d: int(errors.counters(torch.device(d))[i]) for d in devices}
    row["counted on the call's device"] = counts[devices[1]] == 1
    row["not on the other"] = counts[devices[0]] == 0
    row["take_errors"] = kdakit.take_errors() == {"packed_decode": 1}
    row["ok"] = all(v for k, v in row.items() if k != "op")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="cuda:0,cuda:1")
    p.add_argument("--ops", default=None, help="comma-separated op names (default: every registered op)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    devices = args.devices.split(",")
    cuda = all(torch.device(d).type == "cuda" for d in devices)
    if cuda and torch.cuda.device_count() < len(devices):
        print(f"needs {len(devices)} GPUs (found {torch.cuda.device_count()})", file=sys.stderr)
        return 2
    names = args.ops.split(",") if args.ops else sorted(OPS)
    rows = []
    for name in names:
        try:
            rows.append(check_op(name, devices, cuda))
        except Exception:  # noqa: BLE001  (a failing op is a row, the others still run)
            rows.append({"op": name, "ok": False, "error": traceback.format_exc()[-600:]})
        print(rows[-1], flush=True)
    if cuda:
        try:
            rows.append(check_counters(devices))
        except Exception:  # noqa: BLE001
            rows.append({"op": "error counters", "ok": False, "error": traceback.format_exc()[-600:]})
        print(rows[-1], flush=True)
    ok = all(r["ok"] for r in rows)
    gpus = [torch.cuda.get_device_name(torch.device(d)) if cuda else d for d in devices]
    result = {"env": {"gpus": gpus, "torch": torch.__version__,
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "command": " ".join(["python"] + sys.argv)}, "rows": rows, "ok": ok}
    tag = next((m.lower() for m in ("H100", "H200") if m in gpus[0]), "cpu" if not cuda else "gpu")
    folder = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"multi_device_check_{tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print()
    for r in rows:
        failed = [k for k, v in r.items() if v is False]
        print(f"{r['op']:28s} {'ok' if r['ok'] else 'FAILED: ' + ', '.join(failed)}")
    print(f"ok={ok}; JSON: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
