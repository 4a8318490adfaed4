"""GPU check: fla's own forward-only KDA tests, run against kdakit's fla drop-ins.

    python benchmarks/gpu_fla_conformance.py --test-file .fla-tests/test_kda.py --out DIR

``--test-file`` is a copy of fla's ``tests/ops/test_kda.py`` (fla-core 0.6.0 or the fla
repository's test of the same API); it imports ``fla`` (``fla.ops.kda``, ``fla.ops.kda.gate``,
``fla.ops.kda.naive``, ``fla.ops.utils.cache``, ``fla.utils``), ``triton`` and ``pytest``, all
from the installed fla-core. The file is imported by pytest as usual; then, before any test
runs, the module's globals ``chunk_kda``, ``fused_recurrent_kda`` and
``fused_recurrent_kda_fwd`` (bound by its ``from fla.ops.kda import ...`` lines) are replaced
by kdakit's ``kdakit.compat.fla`` functions, wrapped to count their calls. fla's naive
references (``naive_recurrent_kda``, ``naive_kda_gate``, ``naive_kda_lowerbound_gate``) and
its ``assert_close`` stay fla's.

Selected tests: pytest's ``-k "test_chunk_varlen_prefill or test_fused_recurrent"`` (override
with ``-k``), minus every selected test whose source calls ``.backward(`` (kdakit is
inference only; none of fla's tests that match today do). With fla's test file of this
writing that runs:

- ``test_chunk_varlen_prefill``: ``chunk_kda`` against ``naive_recurrent_kda`` (varlen,
  ``A_log [1, 1, H, 1]``, D = 60, 64, 100, 128, 256, -1000 masks, gate in kernel or the safe
  gate). fla skips its D = 256 case when ``FLA_CACHE_MODE`` uses the default config.
- ``test_fused_recurrent``: ``fused_recurrent_kda`` against ``naive_recurrent_kda``.
- ``test_fused_recurrent_vllm_decode``: ``fused_recurrent_kda_fwd`` in place on a pool against
  ``naive_recurrent_kda`` (fla runs it on CUDA only).
- ``test_fused_recurrent_use_beta_sigmoid_in_kernel``, ``test_fused_recurrent_state_v_first``,
  ``test_fused_recurrent_gate_in_kernel``: fla compares two calls of ``fused_recurrent_kda``,
  both of which are kdakit's here (beta sigmoid / layout / gate in kernel against the same
  call with them done outside).

Writes ``DIR/fla_conformance.log`` (pytest's report, one line per test), ``DIR/junit.xml`` and
``DIR/fla_conformance.jsonl`` (per test: outcome, seconds, calls into each drop-in). A test
that passes without calling a drop-in counts as a failure (the patch did not reach it).
Exits 0 when every selected test passed or was skipped by fla, 1 otherwise. Needs CUDA for a
meaningful run (fla's tests put their tensors on ``fla.utils.device``); on a machine without
one, ``--device cpu`` with ``KDAKIT_BACKEND=reference`` runs the small cases on kdakit's
reference backend (``-k`` to pick them), which checks the collection and the patching.
"""
from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import os
import sys
import time

import pytest

DROP_INS = ("chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd")
DEFAULT_K = "test_chunk_varlen_prefill or test_fused_recurrent"


class Tee:
    """Writes to the terminal and the log file."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()

    def isatty(self):
        return False

    def __getattr__(self, name):
        return getattr(self.streams[0], name)


class DropInPlugin:
    """Patches the test module's drop-in globals after import and records each test."""

    def __init__(self, records_path, device=None):
        import kdakit.compat.fla as ours
        self.device = device
        self.calls = collections.Counter()
        self.patched = {}
        for name in DROP_INS:
            self.patched[name] = self._counted(name, getattr(ours, name))
        self.records = open(records_path, "w")
        self.deselected_backward = []
        self.unpatched_passes = []
        self.patched_modules = []

    def _counted(self, name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    @pytest.hookimpl(trylast=True)  # after -k has deselected
    def pytest_collection_modifyitems(self, session, config, items):
        keep, drop = [], []
        for item in items:
            module = getattr(item, "module", None)
            if module is not None and module.__name__ not in self.patched_modules:
                missing = [n for n in DROP_INS if not hasattr(module, n)]
                if missing:
                    raise SystemExit(f"{module.__file__} does not bind {missing}: is it fla's test_kda.py?")
                for name, fn in self.patched.items():
                    setattr(module, name, fn)
                if self.device is not None:
                    module.device = self.device
                self.patched_modules.append(module.__name__)
            func = getattr(item, "function", None)
            try:
                src = inspect.getsource(func) if func is not None else ""
            except (OSError, TypeError):
                src = ""
            (drop if ".backward(" in src else keep).append(item)
        if drop:
            self.deselected_backward = [i.nodeid for i in drop]
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_runtest_setup(self, item):
        self.calls.clear()
        self._start = time.perf_counter()

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            calls = dict(self.calls)
            outcome = report.outcome
            if outcome == "passed" and not calls:
                outcome = "failed (no drop-in called)"
                self.unpatched_passes.append(report.nodeid)
            self.records.write(json.dumps({"test": report.nodeid, "outcome": outcome,
                                           "seconds": round(report.duration, 3), "calls": calls,
                                           "message": str(report.longrepr)[-2000:] if report.failed else ""})
                               + "\n")
            self.records.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--test-file", required=True, help="a copy of fla's tests/ops/test_kda.py")
    ap.add_argument("--out", required=True, help="folder for the log, junit.xml and the per-test records")
    ap.add_argument("-k", default=DEFAULT_K, help=f"pytest -k expression (default: {DEFAULT_K!r})")
    ap.add_argument("--device", default=None,
                    help="replace the test module's `device` (fla.utils.device), e.g. cpu to smoke-test the "
                         "patching with KDAKIT_BACKEND=reference on a machine without a GPU")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.test_file):
        ap.error(f"--test-file {args.test_file!r} is not a file")
    os.makedirs(args.out, exist_ok=True)
    os.environ.pop("TRITON_INTERPRET", None)  # fla's test runs the real kernels
    import torch

    log = open(os.path.join(args.out, "fla_conformance.log"), "w")
    tee = Tee(sys.stdout, log)
    plugin = DropInPlugin(os.path.join(args.out, "fla_conformance.jsonl"), device=args.device)
    test_dir = os.path.dirname(os.path.abspath(args.test_file))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(f"fla conformance of kdakit.compat.fla on {device}; torch {torch.__version__}; "
          f"test file {args.test_file}; -k {args.k!r}", file=tee)
    try:
        import fla
        print(f"fla-core {getattr(fla, '__version__', '?')} at {os.path.dirname(fla.__file__)}", file=tee)
    except ImportError as e:
        print(f"fla is not importable: {e}", file=tee)
        return 1
    pytest_argv = [os.path.abspath(args.test_file), "-k", args.k, "-v", "-rA", "-p", "no:cacheprovider",
                   "--rootdir", test_dir, "-c", os.devnull, "--color=no",
                   "--junitxml", os.path.join(args.out, "junit.xml"), *args.pytest_args]
    stdout = sys.stdout
    sys.stdout = tee
    try:
        rc = pytest.main(pytest_argv, plugins=[plugin])
    finally:
        sys.stdout = stdout
    plugin.records.close()
    summary = [f"patched modules: {plugin.patched_modules}",
               f"deselected (need backward): {plugin.deselected_backward or 'none'}"]
    if plugin.unpatched_passes:
        summary.append(f"passed without calling a drop-in (counted as failures): {plugin.unpatched_passes}")
    for line in summary:
        print(line, file=tee)
    log.close()
    ok = int(rc) in (0,) and not plugin.unpatched_passes
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
