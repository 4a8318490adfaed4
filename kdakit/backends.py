"""One registry that decides which implementation runs an op.

Each op module registers its implementations by backend name. Selection:
``KDAKIT_BACKEND=reference|triton|helion`` forces a backend for every op that has
it; otherwise CUDA tensors take the first of ``triton``, ``reference`` that the op
has, and CPU tensors take ``reference``. The Triton backend runs on CPU tensors
only through Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI tests
the kernels.
"""
from __future__ import annotations

from typing import Callable

import torch

from .contracts import env_flag

BACKENDS = ("reference", "triton", "helion")
_DEVICE_PREFERENCE = {"cuda": ("triton", "reference")}
_IMPLS: dict[str, dict[str, Callable]] = {}


def register(op: str, backend: str):
    """Decorator: ``fn`` implements ``op`` on ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kdakit backend {backend!r}; known: {', '.join(BACKENDS)}.")

    def decorate(fn):
        _IMPLS.setdefault(op, {})[backend] = fn
        return fn
    return decorate


def available(op: str) -> tuple[str, ...]:
    return tuple(_IMPLS.get(op, {}))


def forced_backend() -> str | None:
    name = env_flag("KDAKIT_BACKEND").strip().lower() or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"KDAKIT_BACKEND={name!r} is not a kdakit backend; choose one of {', '.join(BACKENDS)}.")
    return name


def triton_runs_on(device: torch.device) -> bool:
    """CUDA tensors; CPU tensors under the interpreter, or in compile-only mode (launch.py)."""
    return device.type == "cuda" or env_flag("TRITON_INTERPRET") == "1" or bool(env_flag("KDAKIT_COMPILE_ONLY"))


def select(op: str, device: torch.device, backend: str | None = None) -> tuple[str, Callable]:
    """The (name, implementation) that runs ``op`` for tensors on ``device``."""
    impls = _IMPLS.get(op, {})
    name = backend or forced_backend()
    if name is not None and name in impls:
        runs_here = triton_runs_on(device) if name == "triton" else (
            device.type == "cuda" or env_flag("HELION_INTERPRET") == "1")
        if name in ("triton", "helion") and not runs_here:
            raise ValueError(f"the {name} backend needs CUDA tensors, or CPU tensors with "
                             f"{'TRITON' if name == 'triton' else 'HELION'}_INTERPRET=1 (got {device.type} tensors).")
        return name, impls[name]
    if backend is not None:
        raise ValueError(f"`{op}` has no {backend} implementation; available: {', '.join(impls)}.")
    for candidate in _DEVICE_PREFERENCE.get(device.type, ("reference",)):
        if candidate in impls:
            return candidate, impls[candidate]
    raise ValueError(f"`{op}` has no implementation for {device.type} tensors.")
