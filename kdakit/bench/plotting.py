"""matplotlib for the bench plots, shared by ``kdakit bench`` (kdakit/bench/__init__.py) and its
``--prefill`` sweep (kdakit/bench/prefill.py), which both import it from here (so the sweep does
not import the package that imports it)."""
from __future__ import annotations

import sys


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None (said once) when it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kdakit bench: matplotlib is not installed, so no plot; `pip install 'kdakit[bench]'` adds it.",
              file=sys.stderr)
        return None
    return plt
