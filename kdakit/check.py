"""`kdakit check`: every backend available on this machine against the float64 reference.

Each op has a case builder (small random inputs on the device at hand) and a
runner per backend; the table shows the relative error of the outputs and of
the updated pools, and whether unused pool slots stayed bitwise.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from . import backends, reference
from .ops.packed_decode import packed_decode


def available_backends(device: torch.device) -> list[str]:
    names = ["reference"]
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        names.append("triton")
    if importlib.util.find_spec("helion") is not None and (
            device.type == "cuda" or os.environ.get("HELION_INTERPRET") == "1"):
        names.append("helion")
    return names


def _rel(x, y) -> float:
    x, y = x.double(), y.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def check_packed_decode(backend: str, device, seed: int = 0) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, H, HV, K, V, slots = 4, 2, 4, 32, 64, 9

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)
    mixed, a, b = rnd(B, 2 * H * K + HV * V), rnd(B, HV * K), rnd(B, HV)
    A_log, dt_bias = torch.rand(HV, generator=gen).to(device), rnd(HV * K) * 0.5
    state = rnd(slots, HV, V, K)
    idx = torch.tensor([7, -1, 2, 4], dtype=torch.int32, device=device)
    before = state.clone()
    ref_state, ref_out = state.double(), torch.empty(B, 1, HV, V, dtype=torch.float64, device=device)
    reference.packed_decode(mixed.double(), a.double(), b.double(), A_log.double(), dt_bias.double(), ref_state,
                            idx, ref_out, lower_bound=-2.0, compute_dtype=torch.float64)
    out = torch.full((B, 1, HV, V), float("nan"), device=device)
    packed_decode(mixed, a, b, A_log, dt_bias, state, idx, out, lower_bound=-2.0, backend=backend)
    unused = [s for s in range(slots) if s not in (7, 2, 4)]
    return {"out_err": _rel(out, ref_out), "pool_err": _rel(state, ref_state),
            "untouched": bool(torch.equal(state[unused], before[unused]))}


CHECKS = {"packed_decode": check_packed_decode}


def run(device: str | None = None) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for op, check in CHECKS.items():
        for backend in available_backends(dev):
            if backend not in backends.available(op):
                continue
            try:
                result = check(backend, dev)
                ok = result["out_err"] < 1e-4 and result["pool_err"] < 1e-4 and result["untouched"]
                rows.append({"op": op, "backend": backend, **result, "ok": ok})
            except Exception as exc:  # report, don't hide: the table says what failed
                rows.append({"op": op, "backend": backend, "error": f"{type(exc).__name__}: {exc}", "ok": False})
    return rows


def main(device: str | None = None) -> int:
    rows = run(device)
    print(f"{'op':18s} {'backend':10s} {'out err':>10s} {'pool err':>10s} {'untouched':>9s}  ok")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:18s} {r['backend']:10s} ERROR {r['error']}")
        else:
            print(f"{r['op']:18s} {r['backend']:10s} {r['out_err']:10.2e} {r['pool_err']:10.2e} "
                  f"{str(r['untouched']):>9s}  {'yes' if r['ok'] else 'NO'}")
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
