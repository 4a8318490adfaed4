"""The kdakit command line: `kdakit check` (and `python -m kdakit check`)."""
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
    parser = argparse.ArgumentParser(prog="kdakit", description="Kimi Delta Attention serving kernels")
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check", help="every backend available here against the float64 reference")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    args = parser.parse_args(argv)
    if args.command in (None, "check"):
        _interpret_triton_on_cpu(getattr(args, "device", None))
        from . import check as check_mod
        return check_mod.main(getattr(args, "device", None))
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
