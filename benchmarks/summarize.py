"""Compact view of benchmark JSON files (device runs print this last).

    python benchmarks/summarize.py results/a.json [results/b.json ...]

One line per timed row (name, the case keys, us, % of the copy ceiling, speedup fields),
and every failed check.
"""
from __future__ import annotations

import json
import sys

CASE_KEYS = ("N", "T", "num_spec")
EXTRA_KEYS = ("x_vs_chain", "err", "error")


def summarize(path: str) -> None:
    with open(path) as f:
        result = json.load(f)
    print(f"== {path}: ceiling {result.get('copy_ceiling_GBps')} GB/s")
    failed = [c for c in result.get("checks", []) if not c.get("ok")]
    print(f"checks: {len(result.get('checks', [])) - len(failed)} ok, {len(failed)} failed")
    for check in failed:
        print("  FAILED", check)
    for row in result.get("rows", []):
        case = " ".join(f"{k}={row[k]}" for k in CASE_KEYS if k in row)
        extra = " ".join(f"{k}={row[k]}" for k in EXTRA_KEYS if k in row)
        print(f"{row['name']:<34} {case:<18} {row.get('us', '-'):>9} us {row.get('pct_of_copy', '-'):>6}% {extra}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)
