"""The cached launcher's logic on CPU: its specialization key against Triton's own, the
version gate, the fall back to the public launch, and the CUDA device in the cache key.

The fast path itself launches only on a GPU; here a stand-in JIT function and driver
record what the launcher would call, so the decisions are tested without one."""
from __future__ import annotations

import contextlib
import os
import types
import warnings

import pytest
import torch
import triton

from kdakit.ops import launch


# ----------------------------------------------------------------------------
# The specialization key agrees with Triton's
# ----------------------------------------------------------------------------
def _triton_spec(arg):
    return launch.triton_specialization(arg)


def _sample_args():
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 1000, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -1, -16, -(2 ** 31),
            -(2 ** 31) - 1]
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32),
               torch.zeros(8, dtype=torch.bfloat16)[1:], torch.zeros(8, dtype=torch.int64)]
    return ints + [0.5, 1.0] + tensors


def test_specialization_key_matches_triton():
    """Two arguments get the same cached kernel only if Triton would compile them alike,
    and the key does not split what Triton compiles alike more than by int32/int64 range."""
    args = _sample_args()
    for x in args:
        for y in args:
            if type(x) is not type(y) and not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                continue
            same_key = launch.specialization_key((x,)) == launch.specialization_key((y,))
            same_triton = _triton_spec(x) == _triton_spec(y)
            assert same_key == same_triton, (x if not isinstance(x, torch.Tensor) else (x.dtype, x.data_ptr() % 16),
                                             y if not isinstance(y, torch.Tensor) else (y.dtype, y.data_ptr() % 16),
                                             _triton_spec(x), _triton_spec(y))


# ----------------------------------------------------------------------------
# Stand-ins for a GPU launch
# ----------------------------------------------------------------------------
class _Device:
    def __init__(self, index):
        self.index = index
        self.type = "cuda"


class _CudaArg:
    """The first kernel argument, as the launcher sees a CUDA tensor."""
    is_cuda = True

    def __init__(self, index):
        self.device = _Device(index)

    # As two tensors of one dtype and alignment on two GPUs: one specialization.
    def __eq__(self, other):
        return isinstance(other, _CudaArg)

    def __hash__(self):
        return 0


class _Compiled:
    def __init__(self, log, device, refuse=False):
        self.log, self.device, self.refuse = log, device, refuse
        self.function, self.packed_metadata = object(), object()

    def launch_metadata(self, grid, stream, *args):
        if self.refuse:  # as a Triton whose compiled kernels take launch metadata otherwise
            raise TypeError("launch_metadata() takes other arguments")
        return None

    def run(self, gx, gy, gz, stream, function, packed, metadata, enter, exit_, *args):
        self.log.append(("fast", self.device, (gx, gy, gz), stream, len(args)))


class _Jit:
    """A JIT function: ``fn[grid](*args, **kwargs)`` compiles (once per device) and launches."""
    arg_names = ["x", "n", "BLOCK"]

    def __init__(self, driver, refuse=False):
        self.log, self.driver, self.refuse = [], driver, refuse

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            device = self.driver.device
            self.log.append(("public", device, grid, kwargs.get("launch_pdl")))
            return _Compiled(self.log, device, self.refuse)
        return launch


class _Driver:
    def __init__(self):
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def fake_gpu(monkeypatch):
    driver = _Driver()
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=driver))

    @contextlib.contextmanager
    def device_guard(device):
        before, driver.device = driver.device, device.index
        try:
            yield
        finally:
            driver.device = before

    monkeypatch.setattr(launch.torch.cuda, "device", device_guard)
    monkeypatch.setattr(launch, "_FAST_PATH", [True])
    return driver


_ARGS = {0: _CudaArg(0), 1: _CudaArg(1)}


def _launch(kernel, device_index, n=7):
    kernel((2, 3), (_ARGS[device_index], n), {"BLOCK": 16}, num_warps=1, num_stages=1)


def test_fast_path_after_first_launch(fake_gpu):
    jit = _Jit(fake_gpu)
    kernel = launch.CachedKernel(jit)
    _launch(kernel, 0)
    _launch(kernel, 0)
    _launch(kernel, 0, n=16)  # a multiple of 16 is another specialization: compiled anew
    assert [entry[0] for entry in jit.log] == ["public", "fast", "public"]
    assert jit.log[1] == ("fast", 0, (2, 3, 1), 1000, 3)  # constexprs passed in signature order


def test_each_device_gets_its_own_compiled_kernel(fake_gpu):
    """A kernel loaded for one GPU's context is never launched on another."""
    jit = _Jit(fake_gpu)
    kernel = launch.CachedKernel(jit)
    _launch(kernel, 0)
    _launch(kernel, 1)  # the tensors live on GPU 1 while GPU 0 is current
    _launch(kernel, 1)
    _launch(kernel, 0)
    assert [(entry[0], entry[1]) for entry in jit.log] == [("public", 0), ("public", 1), ("fast", 1), ("fast", 0)]
    assert jit.log[2][3] == 1001  # GPU 1's stream
    assert fake_gpu.device == 0  # the current device is restored


def test_refused_fast_launch_falls_back_once(fake_gpu):
    jit = _Jit(fake_gpu, refuse=True)
    kernel = launch.CachedKernel(jit)
    _launch(kernel, 0)
    with pytest.warns(RuntimeWarning, match="public kernel"):
        _launch(kernel, 0)
    assert not launch.fast_path_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _launch(kernel, 0)
    assert [entry[0] for entry in jit.log] == ["public", "public", "public"]


def test_public_launch_when_fast_path_off(fake_gpu, monkeypatch):
    monkeypatch.setattr(launch, "_FAST_PATH", [False])
    jit = _Jit(fake_gpu)
    kernel = launch.CachedKernel(jit)
    for _ in range(3):
        kernel((4,), (_ARGS[0], 3), {"BLOCK": 16}, num_warps=1, num_stages=1, launch_pdl=True)
    assert jit.log == [("public", 0, (4,), True)] * 3


@pytest.mark.parametrize("version, fast", [("3.5.1", True), ("3.6.0", True), ("3.8.0", True), ("3.9.0", True),
                                           ("3.10.0", False), ("4.0.0", False), ("3.4.0", False)])
def test_version_gate(monkeypatch, version, fast):
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.delenv("KDAKIT_LAUNCHER", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert launch._initial_fast_path() is fast
    assert (len(caught) == 0) is fast


def test_launcher_forced_public(monkeypatch):
    monkeypatch.setenv("KDAKIT_LAUNCHER", "public")
    assert launch._initial_fast_path() is False


def test_installed_triton_in_supported_range():
    """The installed Triton is one the package declares (pyproject's range)."""
    assert (3, 5) <= launch.triton_version() < (4, 0)


def test_host_side_integer_helpers_match_triton():
    for n in range(0, 5000):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 64, 100):
            assert launch.cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_error_after_a_fast_launch_is_not_launched_again(fake_gpu, monkeypatch):
    """An exception from the launcher itself (e.g. an exit hook, after the kernel ran) propagates:
    an in-place op must never be applied twice."""
    jit = _Jit(fake_gpu)
    kernel = launch.CachedKernel(jit)
    _launch(kernel, 0)

    def run_then_fail(self, *args):
        self.log.append(("fast",))
        raise TypeError("a launch hook failed")
    monkeypatch.setattr(_Compiled, "run", run_then_fail)
    with pytest.raises(TypeError, match="launch hook"):
        _launch(kernel, 0)
    assert [entry[0] for entry in jit.log] == ["public", "fast"]
    assert launch.fast_path_enabled()


def test_env_flag_follows_the_environment_as_it_changes(monkeypatch):
    """``env_flag`` reads os.environ's own mapping: a set, a changed and a removed variable all
    show on the next read (users and tests flip KDAKIT_* at run time)."""
    from kdakit.contracts import env_flag
    name = "KDAKIT_TEST_FLAG_READ"
    monkeypatch.delenv(name, raising=False)
    assert env_flag(name) == ""
    monkeypatch.setenv(name, "full")
    assert env_flag(name) == "full"
    os.environ[name] = "triton"
    assert env_flag(name) == "triton"
    del os.environ[name]
    assert env_flag(name) == ""
    monkeypatch.setenv(name, "é")  # not ASCII: decoded as os.environ decodes it
    assert env_flag(name) == os.environ[name]
