"""Two ChunkConfig forms of the chunked prefill give the same bits on the GPU.

    python benchmarks/gpu_config_bits_check.py 'qk_pairs_dtype=float32' [--cases 8x2k,mixed] [--tolerance 1e-2]

The picked config at each case's shapes against the picked config with the given fields
changed (harness.parse_configs syntax), on bench_chunk_prefill's inputs, both gates, plus the
steep-gate inputs: outputs and pools compared bit for bit. For forms whose CPU test claims equal
bits, so that the GPU's float64 checks of one form hold for the other. ``--tolerance``: for forms
that round differently (``chain_pieces``), the relative error of the other form's outputs and
pools against the picked form's must stay below it instead."""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_chunk_prefill import kdakit_call, rel  # noqa: E402
from kdakit.bench import harness  # noqa: E402
from kdakit.bench.prefill import CASES, make_layer, parse_cases  # noqa: E402
from kdakit.ops.chunk_prefill import ChunkConfig, chunk_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fields")
    ap.add_argument("--cases", default="8x2k,mixed")
    ap.add_argument("--tolerance", type=float, default=None)
    args = ap.parse_args()
    bad = 0
    for name in parse_cases(args.cases):
        lens, H = CASES[name]
        picked = chunk_config(len(lens), H, 128, 128, act_dtype=torch.bfloat16, T=sum(lens))
        other = harness.parse_configs(args.fields, ChunkConfig, base=picked)[0]
        for steep, lower_bound in ((False, None), (False, -5.0), (True, None)):
            got = []
            for config in (picked, other):
                layer = make_layer(lens, H, H, seed=3, steep=steep)
                layer["out"].fill_(float("nan"))
                kdakit_call(layer, lower_bound, config)()
                got.append((layer["out"], layer["state"]))
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(got[0][0].float()).all())
            if args.tolerance is None:
                same = torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
                what = f"bitwise={same}"
            else:
                errs = rel(got[1][0], got[0][0]), rel(got[1][1], got[0][1])
                same = max(errs) < args.tolerance
                what = f"rel out {errs[0]:.2e} pool {errs[1]:.2e} (< {args.tolerance:g}: {same})"
            bad += not (same and finite)
            gate = "steep" if steep else ("safe" if lower_bound else "default")
            print(f"{'ok  ' if same and finite else 'FAIL'} {name} {gate} gate, picked vs [{args.fields}]: "
                  f"{what} finite={finite}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
