"""The Python-level work of one eager call, counted (never timed): a guard against an op's
host path growing again. Wall time per eager call is a benchmark row (`kdakit bench --peers`,
group ``decode``: ``eager_host``), measured on a GPU host, never asserted here.

Counted: every Python and C function call (``sys.setprofile`` "call" and "c_call" events) of
one call after a warm-up, with the kernel launch itself stubbed out (``CachedKernel.__call__``),
so only kdakit's own path is counted: contract checks, backend choice, config pick, argument
packing. The budgets are today's counts plus about 10%."""
from __future__ import annotations

import sys

import pytest
import torch

import kdakit
from kdakit.bench.inputs import packed_decode_inputs
from kdakit.compat import sglang as compat_sglang
from kdakit.ops import launch

BUDGET = {"packed_decode": 108}  # 98 calls (2026-12-08: environment reads off os.environ's Mapping path, the config cached)
DROPIN_EXTRA = 4  # a drop-in may add a few calls (its own frame, argument mapping), never a path of its own


def python_calls(fn) -> int:
    fn()  # warm-up: configs, counters and kept buffers made once
    count = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    launched = []
    monkeypatch.setattr(launch.CachedKernel, "__call__", lambda self, *a, **k: launched.append(self.fn.__name__))
    return launched


def test_packed_decode_and_its_sglang_dropin(no_launch):
    P = packed_decode_inputs(3, 2, 2, 16, 16, device="cpu")

    def native():
        kdakit.packed_decode(P["mixed"], P["a"], P["b"], P["A_log"], P["dt_bias"], P["state"], P["idx"], P["out"])

    def dropin():
        compat_sglang.fused_recurrent_kda_packed_decode(P["mixed"], P["a"], P["b"], P["A_log"], P["dt_bias"],
                                                        16 ** -0.5, P["state"], P["out"], P["idx"],
                                                        use_qk_l2norm_in_kernel=True, lower_bound=None)
    n_native, n_dropin = python_calls(native), python_calls(dropin)
    assert no_launch and set(no_launch) == {"_packed_decode_kernel"}  # the path reached the launch each time
    assert n_native <= BUDGET["packed_decode"], f"packed_decode's eager path grew to {n_native} calls"
    assert n_dropin <= n_native + DROPIN_EXTRA, f"the sglang drop-in costs {n_dropin} calls, the op {n_native}"


def test_the_counter_sees_added_work(no_launch):
    """The count moves when the path does more (else the guard above could not fail)."""
    P = packed_decode_inputs(3, 2, 2, 16, 16, device="cpu")

    def call():
        kdakit.packed_decode(P["mixed"], P["a"], P["b"], P["A_log"], P["dt_bias"], P["state"], P["idx"], P["out"])

    def heavier():
        for _ in range(20):
            torch.empty(1)
        call()
    assert python_calls(heavier) >= python_calls(call) + 20
