"""The README's performance table (Markdown) from a `kdakit bench --peers --json` record.

    python benchmarks/peers_table.py benchmarks/results/peers_h100.json            # every row
    python benchmarks/peers_table.py --compact benchmarks/results/peers_h100.json  # the README's rows
"""
from __future__ import annotations

import json
import sys

from kdakit.bench.peers import markdown_lines

# The README's rows: each op at the sizes an engine runs most (the full table is in docs/benchmarks.md).
COMPACT = {
    "packed_decode_fp32": {"N=8", "N=128", "N=512"},
    "packed_decode_bf16": {"N=8", "N=128", "N=512"},
    "eager_host": {"N=1"},
    "chain_snapshot": {"N=64 T=4", "N=64 T=8"},
    "chain_ring": {"N=8 T=4", "N=64 T=4", "N=64 T=8", "N=64 T=16"},
    "tree_snapshot": {"N=64 T=8", "N=64 T=16"},
    "tree_ring": {"N=64 T=8", "N=64 T=16"},
    "conv": {"1x8192 x-rows", "64x128 x-rows"},
    "chunk_prefill": None,  # every case
}


def compact(result: dict) -> dict:
    rows = [r for r in result["rows"] if r["op"] in COMPACT and (COMPACT[r["op"]] is None
                                                                  or r["case"] in COMPACT[r["op"]])]
    return {**result, "rows": rows}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    short = "--compact" in argv
    paths = [a for a in argv if a != "--compact"]
    if len(paths) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(paths[0]) as f:
        result = json.load(f)
    print("\n".join(markdown_lines(compact(result) if short else result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
