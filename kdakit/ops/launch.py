"""Launching Triton kernels with little host time.

``kernel[grid](...)`` re-binds and re-specializes every argument on every call
(~25 µs for a 20-argument kernel on the H200 host): more than the decode kernel
itself at small batch, and engines that cannot graph a step pay it on every
layer. ``CachedKernel`` computes the same specialization key Triton would (dtype
and 16-byte alignment of every pointer, ``== 1`` / ``% 16`` of every integer),
keeps the compiled kernel per (device, key) and launches it directly.

That fast path calls a compiled kernel's launcher (``CompiledKernel.run`` with
its packed metadata and launch hooks), which is Triton's internal interface: it
is used only on the Triton versions in ``FAST_PATH_TRITON`` (read identical from
3.5 to 3.9, checked on the GPU with 3.6). Any other Triton, ``KDAKIT_LAUNCHER=public``,
or a fast launch that the installed Triton refuses, takes the public
``kernel[grid](...)`` launch instead (a warning once, never an error). Under
``TRITON_INTERPRET=1`` every launch is the public one.

``KDAKIT_COMPILE_ONLY=sm_90`` (CPU tensors, no interpreter) compiles each launch for
the H200 instead of running it: how CI proves on a machine without a GPU that every
kernel variant the ops launch still compiles (the interpreter accepts code that the
compiler rejects).
"""
from __future__ import annotations

import warnings

import torch
import triton
from triton.runtime import driver

from ..buffers import kept_buffer
from ..contracts import env_flag

COMPILED_FOR_TARGET: list[str] = []  # kernels compiled in compile-only mode, in order

# (major, minor) of the Triton releases whose compiled-kernel launcher takes
# (grid x, y, z, stream, function, packed metadata, launch metadata, enter hook,
# exit hook, *every argument in signature order).
FAST_PATH_TRITON = frozenset({(3, 5), (3, 6), (3, 7), (3, 8), (3, 9)})


def triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def fast_path_enabled() -> bool:
    """Whether launches go straight to the compiled kernel's launcher (module docstring)."""
    return _FAST_PATH[0]


def _initial_fast_path() -> bool:
    if env_flag("KDAKIT_LAUNCHER").strip().lower() == "public":
        return False
    if triton_version() not in FAST_PATH_TRITON:
        warnings.warn(f"kdakit: Triton {triton.__version__} is not one whose launcher kdakit knows; kernels "
                      "launch through the public kernel[grid](...) call (correct, more host time per call).",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


_FAST_PATH = [_initial_fast_path()]


def _fall_back(error: Exception) -> None:
    _FAST_PATH[0] = False
    warnings.warn(f"kdakit: Triton {triton.__version__} refused the direct kernel launch ({error!r}); kernels "
                  "launch through the public kernel[grid](...) call from now on.", RuntimeWarning, stacklevel=3)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python (0 stays 0): Triton's is a constexpr function,
    and a host-side call of it costs microseconds, several times per launch."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python, for the same reason."""
    return -(-a // b)


def interpreting() -> bool:
    """Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return env_flag("TRITON_INTERPRET") == "1"


def compile_only_target():
    """The GPU target of compile-only mode, or None."""
    name = env_flag("KDAKIT_COMPILE_ONLY")
    if not name:
        return None
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", int(name.removeprefix("sm_")), 32)


def _compile_for_target(fn, args, constexprs, num_warps, num_stages, launch_pdl, target, max_registers=None):
    # Specialized as the JIT would on the GPU (an integer 1 becomes a constant, 16-byte
    # alignment and multiples of 16 are divisibility hints): the layouts the compiler
    # picks, and the passes that can fail, depend on them.
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource
    signature, constants, attrs = {}, dict(constexprs), {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, args)):
        kind, attr = triton_specialization(arg)
        if kind == "constexpr":
            constants[name] = attr
        elif attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
        signature[name] = kind
    signature.update({name: "constexpr" for name in constexprs})
    triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs), target=target,
                   options=_options(num_warps, num_stages, launch_pdl, max_registers))
    COMPILED_FOR_TARGET.append(fn.__name__)


def _options(num_warps, num_stages, launch_pdl, max_registers) -> dict:
    """Triton's compile options of one launch (``maxnreg`` only when capped)."""
    options = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": launch_pdl}
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return options


def triton_specialization(arg) -> tuple:
    """Triton's own (type, attribute) for one kernel argument, as its JIT specializes it."""
    from triton.backends.compiler import BaseBackend
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:  # Triton 3.5 specializes in Python
        from triton.runtime.jit import create_specialize_impl
        return create_specialize_impl(BaseBackend.get_arg_specialization)(arg, False, True, True)
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def specialization_key(args) -> tuple:
    """What Triton specializes a compiled kernel on, for each runtime argument (one loop, no
    call per argument: this runs on every eager launch)."""
    key = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            key.append((arg == 1, arg % 16 == 0, -(2 ** 31) <= arg < 2 ** 31))
        elif kind is float:
            key.append("f")
        elif isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        else:
            key.append(("o", arg))
    return tuple(key)


class CachedKernel:
    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}  # (CUDA device index, specialization, options) -> compiled kernel

    def __call__(self, grid, args: tuple, constexprs: dict, *, num_warps: int = 4, num_stages: int = 3,
                 launch_pdl: bool = False, max_registers: int | None = None):
        """``launch_pdl``: a programmatic dependent launch (see ``pdl_available``); the
        kernel must ``gdc_wait`` before it reads what the previous kernel writes.
        ``max_registers``: a cap per thread (ptxas ``.maxnreg``), for kernels whose
        occupancy, not their instruction count, sets the speed."""
        first = args[0]
        if not first.is_cuda:  # the interpreter (or compile-only mode): nothing to cache
            target = compile_only_target()
            if target is not None:
                return _compile_for_target(self.fn, args, constexprs, num_warps, num_stages, launch_pdl, target,
                                           max_registers)
            return self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        device = driver.active.get_current_device()
        if first.device.index != device:
            # Triton launches on the current device; the tensors' device decides here.
            with torch.cuda.device(first.device):
                return self(grid, args, constexprs, num_warps=num_warps, num_stages=num_stages,
                            launch_pdl=launch_pdl, max_registers=max_registers)
        if not _FAST_PATH[0]:
            self.fn[grid](*args, **constexprs, **_options(num_warps, num_stages, launch_pdl, max_registers))
            return
        key = (device, specialization_key(args), tuple(constexprs.values()), num_warps, num_stages, launch_pdl,
               max_registers)
        kernel = self.compiled.get(key)
        if kernel is None:
            self.compiled[key] = self.fn[grid](*args, **constexprs,
                                               **_options(num_warps, num_stages, launch_pdl, max_registers))
            return
        # The launcher takes every argument in signature order, constexprs included.
        bound = (*args, *(constexprs[name] for name in self.fn.arg_names[len(args):]))
        stream = driver.active.get_current_stream(device)
        knobs = triton.knobs.runtime
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        try:  # the launcher's pieces; nothing has launched if one of them is not there
            run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
            metadata = kernel.launch_metadata(grid, stream, *bound)
        except (AttributeError, TypeError) as error:
            _fall_back(error)
            self.fn[grid](*args, **constexprs, **_options(num_warps, num_stages, launch_pdl, max_registers))
            return
        # Not inside the try: a launch hook may raise after the kernel ran, and a second launch
        # of an in-place op would apply it twice.
        run(grid_x, grid_y, grid_z, stream, function, packed, metadata, knobs.launch_enter_hook,
            knobs.launch_exit_hook, *bound)


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and later): a kernel launched with it may
    start while the previous kernel in the stream is still running, and must wait
    (``gdc_wait``) before reading what that kernel writes; what it reads before the wait
    must not be written by it. Used only between kdakit's own kernels, where that holds
    by construction. ``KDAKIT_PDL=0`` turns it off; compile-only mode (sm_90) turns it on
    so that CI compiles the waiting variants."""
    if env_flag("KDAKIT_PDL") == "0":
        return False
    if device.type != "cuda":
        target = compile_only_target()
        return target is not None and target.arch >= 90
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = _CAPABILITY_MAJOR.get(index)
    if major is None:
        major = _CAPABILITY_MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return major >= 9


_CAPABILITY_MAJOR: dict = {}  # CUDA device index -> compute capability major (host time per call)


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` int32 counters (or more) that are zero between launches (each kernel that
    counts arrivals on them resets what it used), a ``kept_buffer``: one set per (device,
    stream) so that two streams never share one. Graphs captured on one stream share its
    set: replay them one at a time, not concurrently on several streams."""
    return kept_buffer("arrival counters", device, count,
                       lambda size: torch.zeros(size, dtype=torch.int32, device=device))
