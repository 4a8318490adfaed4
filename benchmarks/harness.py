"""The benchmark harness now lives in the package (`kdakit.bench.harness`, used by
`kdakit bench`); the scripts here keep importing it as `harness`. Results of these
scripts still default to benchmarks/results/ (or $OUT on a device run)."""
from __future__ import annotations

import os

from kdakit.bench import harness as _harness
from kdakit.bench.harness import *  # noqa: F401,F403
from kdakit.bench.harness import _git_rev  # noqa: F401


def save(result: dict, name: str, folder: str | None = None) -> str:
    """JSON into $OUT (device runs) or benchmarks/results/."""
    return _harness.save(result, name, folder or os.environ.get("OUT")
                         or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
