"""GPU check: indices outside their buffers, on CUDA (the cases of tests/test_out_of_range.py).

    python benchmarks/gpu_out_of_range_check.py

For each case: the call with one index past its buffer, eagerly and replayed three times
from a CUDA graph captured on a stream that had run it once (its error counters kept): the
memory around every view stays bitwise unchanged, the output and buffers equal the same
Triton call's with that row as padding, and ``kdakit.take_errors()`` reports one row per call.
Exits 1 when a check fails. Needs CUDA.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_out_of_range as cases  # noqa: E402
from helpers import RING_FORMS, rel_err, with_ring_form  # noqa: E402

import kdakit  # noqa: E402
from kdakit.ops import fused_decode as fused_module  # noqa: E402
from kdakit.ops import mtp_verify as verify_module  # noqa: E402
from kdakit.ops import tree_verify as tree_module  # noqa: E402


PINNED = {"verify": verify_module.mtp_verify_config, "tree": tree_module.tree_verify_config,
          "fused": fused_module.fused_decode_config}


def configure(name: str) -> None:
    # the public calls' launch configs: the pinned ones, with the ring form and the chain forced by case
    form = next((f for f in sorted(RING_FORMS, key=len, reverse=True) if f"ring-{f}-" in name), "recurrent")
    verify_module.mtp_verify_config = lambda *a, **kw: with_ring_form(PINNED["verify"](*a, **kw), form)
    tree_module.tree_verify_config = lambda *a, **kw: with_ring_form(PINNED["tree"](*a, **kw), form)
    fused_module.fused_decode_config = functools.partial(PINNED["fused"], chain_above_pairs=0 if "chain" in name
                                                         else fused_module.CHAIN_ABOVE_PAIRS)
    # the one-kernel fused step runs only without dependent launches
    os.environ["KDAKIT_PDL"] = "0" if name.startswith("fused_decode-slot") else "1"
    os.environ["KDAKIT_BACKEND"] = "triton"  # the drop-in's backend; the others pass theirs


def check(param) -> list[str]:
    op, build, out_row = param.values
    configure(param.id)
    failures = []
    kdakit.take_errors()
    expect = cases.Buffers(0, "cuda")
    call, ix, bad, views = build(expect)
    # the same Triton call with that row as padding: the same kernels, so the same bits (the
    # reference differs by the products' TF32 and bf16 roundings where an op uses them)
    expected_out = call(cases._padding_instead(ix, bad), "triton")
    expected = [v.clone() for v in views]
    kdakit.take_errors()

    bufs = cases.Buffers(0, "cuda")
    call, ix, bad, views = build(bufs)
    bad_ix = cases._with_bad(ix, bad)
    out = call(bad_ix, "triton")
    torch.cuda.synchronize()
    try:
        bufs.assert_outside_untouched()
    except AssertionError as e:
        failures.append(f"eager: {e}")
    if (got := kdakit.take_errors()) != {op: 1}:
        failures.append(f"eager: take_errors() = {got}")
    for got, want in zip(views, expected):
        err = rel_err(got, want)
        if err >= 1e-5:
            failures.append(f"eager: updated buffer relative error {err:.2e}")
    if out is not None:
        if out_row is not None and out[out_row].abs().max() != 0:
            failures.append("eager: the bad row's output is not zero")
        err = rel_err(out, expected_out)
        if err >= 1e-5:
            failures.append(f"eager: output relative error {err:.2e}")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(bad_ix, "triton")  # the capture stream's counters now exist and are kept
    torch.cuda.synchronize()
    kdakit.take_errors()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call(bad_ix, "triton")
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    try:
        bufs.assert_outside_untouched()
    except AssertionError as e:
        failures.append(f"graph: {e}")
    if (got := kdakit.take_errors()) != {op: 3}:
        failures.append(f"graph: take_errors() after 3 replays = {got}")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose id holds this text")
    only = parser.parse_args(argv).only
    ok = True
    for param in (p for p in cases.CASES if only in p.id):
        failures = check(param)
        ok &= not failures
        print(f"{param.id:<42} {'ok' if not failures else 'FAILED: ' + '; '.join(failures)}", flush=True)
    print("all checks ok" if ok else "CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
