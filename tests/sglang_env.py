"""Imports sglang 0.5.23's KDA modules on a CPU machine from its wheel installed without its
dependencies (``pip install --no-deps sglang==0.5.23`` plus the few packages ``SGLANG_PACKAGES``
names), for tests/test_integration_sglang.py.

- ``sglang/__init__.py`` (transformers patches, the frontend language) is not run: ``sys.modules``
  gets a bare package whose ``__path__`` is the installed ``sglang/`` folder.
- ``kda_backend.py`` imports the model runner, the schedulers and the model configs for its type
  hints and the backend class; the packages those need and the wheel does not bring are replaced,
  only while sglang is imported and only where they are not installed, by modules whose every
  attribute is an inert class. Four sglang packages that pull in the whole server and every
  model config (``STUBBED_SGLANG``) are replaced the same way, installed packages or not (a
  transformers other than sglang's pin breaks its configs); nothing the KDA kernels or the
  dispatcher run comes from them.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

# The real packages the KDA modules need beyond torch and triton (the .ci/run install line).
SGLANG_PACKAGES = ("msgspec", "orjson", "psutil", "pybase64", "requests", "pillow", "starlette", "dill")
STUBBED_PACKAGES = ("pydantic", "pydantic_core", "zmq", "transformers", "IPython", "tqdm", "huggingface_hub",
                    "safetensors", "tvm_ffi", "compressed_tensors", "regex", "gguf")
STUBBED_SGLANG = ("sglang.srt.model_executor.model_runner", "sglang.srt.managers", "sglang.srt.speculative",
                  "sglang.srt.configs")
MODULES = ("sglang.srt.plugins", "sglang.srt.plugins.hook_registry",
           "sglang.srt.layers.attention.linear.utils",
           "sglang.srt.layers.attention.linear.kernels.kda_triton",
           "sglang.srt.layers.attention.linear.kda_backend")


class _InertMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert

    def __call__(cls, *args, **kwargs):
        return _Inert

    def __getitem__(cls, key):
        return _Inert

    def __setitem__(cls, key, value):
        pass

    def __or__(cls, other):
        return _Inert

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __contains__(cls, key):
        return False

    def __len__(cls):
        return 0


class _Inert(metaclass=_InertMeta):
    def __init_subclass__(cls, **kwargs):
        pass


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Inert,), {})


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = tuple(names)

    def find_spec(self, fullname, path, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def sglang_root() -> str | None:
    """The installed ``sglang/`` folder, without running its ``__init__``."""
    loaded = sys.modules.get("sglang")
    if loaded is not None and getattr(loaded, "__path__", None):
        return list(loaded.__path__)[0]
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def import_sglang_kda():
    """Imports ``MODULES``; returns them by name. Raises ImportError (with the cause) when the
    wheel or one of ``SGLANG_PACKAGES`` is missing."""
    root = sglang_root()
    if root is None:
        raise ImportError("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    if "sglang" not in sys.modules:
        bare = types.ModuleType("sglang")
        bare.__path__ = [root]
        sys.modules["sglang"] = bare
    # sglang reads this at import to decide whether its Triton kernels load; the GPU path is the one we test.
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    absent = [n for n in STUBBED_PACKAGES if importlib.util.find_spec(n) is None]
    finder = _InertFinder(absent + list(STUBBED_SGLANG))
    before = set(sys.modules)
    # sglang/srt/utils/common.py rebinds triton.next_power_of_2 process-wide at import (its version
    # gives 1 for 0); put Triton's back so that the other tests of this process see Triton's own.
    import triton
    triton_attrs = {name: getattr(triton, name) for name in ("next_power_of_2", "cdiv")}
    sys.meta_path.insert(0, finder)
    try:
        return {name: importlib.import_module(name) for name in MODULES}
    finally:
        for name, value in triton_attrs.items():
            setattr(triton, name, value)
        sys.meta_path.remove(finder)
        # The inert third-party modules leave sys.modules again (other tests must not find them);
        # sglang's modules keep the references they took.
        for name in set(sys.modules) - before:
            if any(name == n or name.startswith(n + ".") for n in absent):
                del sys.modules[name]
