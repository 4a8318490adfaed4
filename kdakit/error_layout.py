"""Which ops count the indices they find outside their buffers, and the order of their counters.

The bottom of the import graph, shared by the op registry (``kdakit/ops/registry.py``: an op
registered with ``kdakit_op(..., counts_errors=True)`` is declared here) and the counters
(``kdakit/errors.py``: ``OPS`` and ``INDEX`` are this layout), so neither imports the other.
Imports nothing of kdakit.
"""
from __future__ import annotations

_declared: set[str] = set()
_layout: tuple[str, ...] | None = None  # fixed by the first layout() call


def declare(name: str) -> None:
    """``name`` counts index errors. Raises once the counters are laid out: they have no room for it."""
    if _layout is not None:
        raise RuntimeError(f"kdakit::{name} counts index errors but registers after the counters were laid "
                           f"out for {', '.join(_layout)}; import its module from kdakit/__init__.py.")
    _declared.add(name)


def layout() -> tuple[str, ...]:
    """The ops that count index errors, sorted by name: an op's position is its counter's index,
    which its kernels take as a constexpr (``kdakit.errors.INDEX``). Sorted, the layout does not
    depend on the order the op modules import each other in. Fixed by the first call, when the
    counters are first used (``import kdakit`` has registered every op by then)."""
    global _layout
    if _layout is None:
        _layout = tuple(sorted(_declared))
    return _layout
