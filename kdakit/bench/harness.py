"""Benchmark harness shared by `kdakit bench` and the scripts under benchmarks/ (GPU only).

How it measures (docs/tuning.md): each timed call is replayed from a CUDA graph that
runs it on ``L`` independent layers (own pool, own inputs), so the state streams
from HBM rather than the 60 MB L2; the reported time is the median graph replay
divided by ``L``. Bandwidth is reported against the device-to-device copy
ceiling measured in the same run.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

L2_FLUSH_BYTES = 1 << 30  # working set per timed graph: far above the 60 MB L2


def copy_ceiling_gbps(num_bytes: int = 2 << 30, reps: int = 30) -> float:
    """Device-to-device copy (bytes read + written) in GB/s, median of ``reps``."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(3):
        dst.copy_(src)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / statistics.median(times) / 1e9


def layers_for(bytes_per_layer: int, max_layers: int = 512) -> int:
    """How many independent layers make the graph's working set exceed the L2 many times."""
    return int(min(max_layers, max(2, math.ceil(L2_FLUSH_BYTES / max(bytes_per_layer, 1)))))


def graph_time_us(calls, replays: int = 20, warmup: int = 3) -> float:
    """Median µs per call of ``calls`` (one callable per layer), replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(5):  # first replays pay TLB and clock warm-up
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times) / len(calls)


def eager_time_us(calls, reps: int = 10) -> float:
    """Median µs per call over ``reps`` passes of ``calls`` run eagerly (CUDA events around each
    pass), after a warm-up pass: for calls that cannot be captured in a graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def eager_host_us(call, iters: int = 300) -> float:
    """Wall µs per eager call (host overhead dominates at small sizes), after a warm-up."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def row(name: str, time_us: float, num_bytes: float, ceiling_gbps: float, **extra) -> dict:
    gbps = num_bytes / (time_us * 1e-6) / 1e9
    return {"name": name, "us": round(time_us, 2), "GB/s": round(gbps, 1),
            "pct_of_copy": round(100 * gbps / ceiling_gbps, 1), **extra}


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    import triton
    return {"gpu": props.name, "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "git": _git_rev(), **_measured_commit()}


def new_results(**env_extra) -> dict:
    """A benchmark's record: the environment, empty checks and rows, the copy ceiling now."""
    return {"env": {**environment(), **env_extra}, "checks": [], "rows": [],
            "copy_ceiling_GBps": round(copy_ceiling_gbps(), 1)}


def close_results(results: dict) -> None:
    """The copy ceiling again at the end, so drift during the run shows in the record."""
    results["copy_ceiling_GBps_end"] = round(copy_ceiling_gbps(), 1)


def _measured_commit() -> dict:
    """A copy of a working tree (the device machine's) may carry a stale ``.git``: the
    commit that really ran is then passed in ``KDAKIT_MEASURED_COMMIT``."""
    commit = os.environ.get("KDAKIT_MEASURED_COMMIT")
    return {"measured_commit": commit} if commit else {}


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except Exception:
        return "unknown"


def results_folder(script_file: str | None = None) -> str:
    """Where a run's records go: $OUT (device runs), else ``results/`` beside
    ``script_file`` (the scripts under benchmarks/ pass ``__file__``), else the
    current directory."""
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    if script_file:
        return os.path.join(os.path.dirname(os.path.abspath(script_file)), "results")
    return os.getcwd()


def save(result: dict, name: str, folder: str | None = None) -> str:
    """JSON into ``folder``, else $OUT (device runs), else the current directory."""
    folder = folder or os.environ.get("OUT") or os.getcwd()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def parse_configs(text: str | None, config_type, base=None) -> list:
    """Launch configs from the command line, in one syntax for every benchmark: the
    dataclass's own fields, ``field=value`` pairs joined by ``,``, configs joined by ``;``
    (``"block_v=16,state_warps=4;block_v=32"``). Fields not named keep ``base``'s value
    (the op's picked config, when the caller passes it) or the dataclass default."""
    if not text:
        return []
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    configs = []
    for group in (g.strip() for g in text.split(";")):
        if not group:
            continue
        values = {}
        for pair in (p.strip() for p in group.split(",") if p.strip()):
            name, sep, raw = pair.partition("=")
            name = name.strip()
            if not sep or name not in fields:
                raise ValueError(f"config {group!r}: {pair!r} is not field=value with a field of "
                                 f"{config_type.__name__} ({', '.join(fields)}).")
            kind = type(getattr(base, name)) if base is not None else type(fields[name].default)
            raw = raw.strip()
            if kind is bool:
                if raw.lower() not in ("1", "0", "true", "false"):
                    raise ValueError(f"config {group!r}: {name} takes true or false, not {raw!r}.")
                values[name] = raw.lower() in ("1", "true")
            elif raw.lower() == "none":
                values[name] = None
            elif kind is type(None):  # an optional field left at None: a number, or none
                values[name] = _number(raw, group, name)
            else:
                values[name] = kind(raw) if kind in (int, float) else raw
        configs.append(dataclasses.replace(base, **values) if base is not None else config_type(**values))
    return configs


def _number(raw: str, group: str, name: str):
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    raise ValueError(f"config {group!r}: {name} takes a number or none, not {raw!r}.")


def config_groups(text: str | None, config_type, base=None) -> list[str]:
    """``text``'s configs (:func:`parse_configs` syntax) one by one, each as its own text, for
    callers that apply each to a config picked per shape (``parse_configs(group, config_type,
    base=picked)[0]``) and name rows by it. Every group is parsed here first (against ``base``,
    else the dataclass defaults), so that a wrong field fails before anything runs."""
    groups = []
    for group in (text or "").split(";"):
        group = ",".join("=".join(x.strip() for x in p.partition("=")[::2]) if "=" in p else p.strip()
                         for p in group.split(",") if p.strip())
        if group:
            parse_configs(group, config_type, base=base)
            groups.append(group)
    return groups


def config_name(config, base=None) -> str:
    """A config's row name: the fields that differ from ``base`` (all of them without one)."""
    ref = base if base is not None else None
    parts = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
             if ref is None or getattr(config, f.name) != getattr(ref, f.name)]
    return ",".join(parts) or "picked"


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))
