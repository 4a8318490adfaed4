"""The README's performance table (Markdown) from a `kdakit bench --peers --json` record.

    python benchmarks/peers_table.py benchmarks/results/peers_h100.json
"""
from __future__ import annotations

import json
import sys

from kdakit.bench.peers import markdown_lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print("\n".join(markdown_lines(json.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
