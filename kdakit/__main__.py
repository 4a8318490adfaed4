"""The kdakit command line (also `python -m kdakit`).

- `kdakit demo` (the main job; also what `kdakit` alone runs): a tiny KDA model decoded
  plainly and speculatively, with identical tokens.
- `kdakit check`: every backend available here against the float64 reference.
- `kdakit bench`: the GPU benchmark sweep (table, JSON, plot).
"""
from __future__ import annotations

import argparse
import sys


def _interpret_triton_on_cpu(device) -> None:
    """Without a GPU the Triton kernels still run, through Triton's interpreter; it must
    be chosen before the kernels are jitted, so re-run this command with it set."""
    import os
    import torch
    if os.environ.get("TRITON_INTERPRET") == "1" or (device != "cpu" and torch.cuda.is_available()):
        return
    os.environ["TRITON_INTERPRET"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "kdakit", *sys.argv[1:]])


def main(argv=None) -> int:
    from . import demo
    parser = argparse.ArgumentParser(prog="kdakit", description="Kimi Delta Attention serving kernels")
    sub = parser.add_subparsers(dest="command")
    demo.add_arguments(sub.add_parser(
        "demo", help="(default) transformers' Kimi Linear as is, with kdakit.enable() and served by kdakit "
        "(plain and speculative): identical tokens; --toy: kdakit's own KDA model"))
    check = sub.add_parser("check", help="every backend available here against the float64 reference")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    bench = sub.add_parser("bench", help="GPU benchmark sweep: table, JSON and a GB/s plot")
    from . import bench as bench_mod
    bench_mod.add_arguments(bench)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("demo", "check", "bench", "-h", "--help"):
        argv = ["demo", *argv]  # `kdakit [demo options]` runs the demo
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.main(args)
    if args.command == "check":
        _interpret_triton_on_cpu(args.device)
        from . import check as check_mod
        return check_mod.main(args.device)
    if args.command == "bench":
        from . import check as check_mod
        return bench_mod.main(args, check=check_mod.run)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
