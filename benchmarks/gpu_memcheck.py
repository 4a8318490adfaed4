"""GPU check: no op touches memory outside its buffers, whatever its indices hold.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python benchmarks/gpu_memcheck.py

For every case of ``gpu_compile_graph_check.py`` (real sizes, a padding row in every batch):
the call as it is, then once per index argument with one live row's index pushed outside its
buffer (just past the end, and 2**30 past it). Each such call must write exactly what the same
call writes with that row made a padding row (slot -1): every tensor bitwise equal (outputs,
pools, scratch), and ``kdakit.take_errors()`` must count it under the op's name. Without the
caching allocator every tensor is its own allocation, so a stray access lands outside every
allocation and memcheck reports it. Prints a table last; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import kdakit  # noqa: E402
from gpu_compile_graph_check import CASES, SLOTS, compare, tensors_of  # noqa: E402

# (case, where the index tensor is: ("arg", position) or ("kw", name), its buffer's length,
#  which argument to set to -1 for the same row to make it a padding row)
INDEX_ARGS = {
    "packed_decode": [(("arg", 6), SLOTS, ("arg", 6))],
    "fused_decode": [(("arg", 8), SLOTS, ("arg", 8))],
    "causal_conv1d_update": [(("arg", 3), SLOTS, ("arg", 3))],
    "mtp_verify-snapshot": [(("arg", 8), SLOTS, ("arg", 8)), (("arg", 9), 4, ("arg", 8))],
    "mtp_verify-ring": [(("arg", 8), SLOTS, ("arg", 8)), (("arg", 9), 4, ("arg", 8))],
    "commit_snapshots": [(("arg", 2), SLOTS, ("arg", 2)), (("arg", 3), 4, ("arg", 2))],
    "commit_ring": [(("arg", 5), SLOTS, ("arg", 5))],
    "recurrent_forward": [(("arg", 6), SLOTS, ("arg", 6))],
    "causal_conv1d_varlen": [(("arg", 4), SLOTS, ("arg", 4))],
    "tree_verify-snapshot": [(("arg", 8), SLOTS, ("arg", 8)), (("arg", 9), 4, ("arg", 8))],
    "tree_verify-ring": [(("arg", 8), SLOTS, ("arg", 8)), (("arg", 9), 4, ("arg", 8))],
    "commit_tree_ring": [(("arg", 5), SLOTS, ("arg", 5))],
    "chunk_prefill-long": [(("arg", 6), SLOTS, ("arg", 6))],
    "chunk_prefill-pieces": [(("arg", 6), SLOTS, ("arg", 6))],
    "chunk_prefill-tiles": [(("arg", 6), SLOTS, ("arg", 6))],
    "mtp_verify-ring-chunk": [(("arg", 8), SLOTS, ("arg", 8)), (("arg", 9), 4, ("arg", 8))],
    "tree_verify-ring-chunk": [(("arg", 8), SLOTS, ("arg", 8)), (("arg", 9), 4, ("arg", 8))],
    "tree_verify-ring-chunk-post-conv": [(("arg", 8), SLOTS, ("arg", 8))],  # no conv: no scratch row is read
    "chunk_prefill-example": [(("arg", 6), 5, ("arg", 6))],
}


def _get(args, kw, where):
    kind, key = where
    return args[key] if kind == "arg" else kw[key]


def _live_row(index: torch.Tensor) -> int:
    return int(torch.nonzero(index >= 0)[0])


def run(build, seed, edit=None, skip=()):
    """Every tensor of the call after it ran, but the index tensors at ``skip`` (edited on purpose)."""
    op, args, kw = build(seed)
    args = list(args)
    if edit is not None:
        edit(args, kw)
    op(*args, **kw)
    torch.cuda.synchronize()
    edited = [id(_get(args, kw, where)) for where in skip]
    return [t for t in tensors_of(args, kw) if id(t) not in edited]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma-separated subset of: " + ", ".join(CASES))
    names = [n for n in parser.parse_args(argv).ops.split(",") if n] or list(CASES)
    rows, failed = [], False
    kdakit.take_errors()
    for name in names:
        build = CASES[name]
        run(build, 1)
        errors = kdakit.take_errors()
        rows.append((name, "valid", "ok" if not errors else f"counted {errors}"))
        failed |= bool(errors)
        for where, length, pad_where in INDEX_ARGS.get(name, []):
            _, args0, kw0 = build(1)
            row = _live_row(_get(list(args0), kw0, pad_where))

            def pad(args, kw, row=row, pad_where=pad_where):
                _get(args, kw, pad_where)[row] = -1
            want = run(build, 1, pad, skip=(where, pad_where))
            kdakit.take_errors()
            for past in (0, 2 ** 30):
                def push(args, kw, row=row, where=where, value=length + past):
                    _get(args, kw, where)[row] = value
                got = run(build, 1, push, skip=(where, pad_where))
                errors = kdakit.take_errors()
                problem = compare(got, want)
                op_name = name.partition("-")[0]  # cases are named <op> or <op>-<variant>
                counted = errors.get(op_name, 0)
                if problem is None and counted < 1 and op_name in kdakit.errors.OPS:
                    problem = f"not counted (take_errors() = {errors})"
                failed |= problem is not None
                rows.append((name, f"{where[0]} {where[1]} = {length + past}", problem or f"ok, counted {counted}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print("\nRESULT:", "FAIL" if failed else "every out-of-range index acted as a padding row (and was counted by the ops in kdakit.errors.OPS)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
