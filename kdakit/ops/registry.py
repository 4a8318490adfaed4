"""Public ops as ``torch.library`` custom ops (``torch.ops.kdakit.<name>``), and the registry of them.

Why custom ops: ``torch.compile(fullgraph=True)`` cannot trace into a Triton launcher or
the reference's data-dependent indexing, and CUDA-graph trees need to know which buffers
an op writes. Each op is opaque to the compiler: a schema that names the buffers it
writes (``mutates_args``), a fake implementation (a no-op: every op writes caller-owned
buffers and returns ``None``; a custom op may not return an alias of an input), and a
body that picks the backend with :func:`kdakit.backends.select` and runs it.

An op module declares its op next to its kernel with :func:`kdakit_op` on its dispatch
body (typed with the schema; ``backend: str | None`` last) and calls the result from its
public entry, after validation::

    @kdakit_op("causal_conv1d_update", counts_errors=True, mutates=("conv_state", "out"))
    def causal_conv1d_update_op(x: torch.Tensor, ..., backend: str | None) -> None:
        _, impl = select("causal_conv1d_update", x.device, backend)
        impl(x, ...)

    def causal_conv1d_update(x, ...):          # the public entry
        check_causal_conv1d_update(...)        # its input contract, in the same module
        causal_conv1d_update_op(x, ..., backend)
        return out

How the call branches (:meth:`Op.__call__`):
  * The public entry validates first, *outside* the custom op, so under ``torch.compile``
    validation runs at trace time on fake tensors: shape, stride, dtype and device checks
    raise the usual ``ValueError`` while compiling. Data checks (``full_checks=True`` /
    ``KDAKIT_CHECKS=full``) read tensor values and cannot run on fake tensors; see
    :func:`kdakit.contracts.full_checks_enabled`.
  * Traced (``torch.compiler.is_compiling()``: ``torch.compile``, ``torch.export``) or with
    a subclass as the first tensor (fake or functional tensors of a non-Dynamo trace), it
    calls ``torch.ops.kdakit.<name>``, the scalars converted to their schema types. In
    plain eager it calls the dispatch body directly, with the arguments as given: the
    custom-op dispatcher path costs ~150 µs of host time per call in torch 2.13 (the Python
    ADInplaceOrView/autograd wrappers of a mutating custom op rebuild the schema's argument
    list for every argument), far more than a decode step takes on the GPU, and eager
    CUDA-graph capture needs no custom op (the launches are captured as they are).
  * ``backend=`` travels as an ``Optional[str]`` argument; the body calls
    ``select(op, device, backend)`` in both paths, so the ``KDAKIT_BACKEND`` variable is
    read on every call, compiled or not (and an unavailable backend raises when the op
    runs, as in eager).

Arguments with no schema type (tuples of tensors, nested ints) go through ``dispatch=``
(the eager body, taking them as the entry does), ``flatten=`` (the entry's arguments in
schema order) and the decorated function (the custom op's body, rebuilding them and calling
the dispatch body). Optional tensors are ``torch.Tensor | None``; fixed-size tuples of
tensors (``conv_weights``, ``rings``...) are flattened into separate optional tensor
arguments; any number of tensors (``commit_snapshots``' conv pools) is a ``List[Tensor]``.

Layout: every op carries ``torch.Tag.needs_exact_strides`` so inductor hands the kernels
the strides that validation saw at trace time (kernels read strides at run time and the
contracts pin some of them).

``OPS`` maps each name to its :class:`Op`: the custom op, what it mutates, its schema and
its example inputs (``@<name>_op.register_example``), which the generic tests iterate
(opcheck, fullgraph compile, the sm_90 compile, the GPU compile/graph check). An op that
treats out-of-range indices as padding rows and counts them says so (``counts_errors=True``);
:func:`error_counting_ops` lays out their counters (``kdakit.errors``); the layout lives in
``kdakit.error_layout``, below both this registry and ``kdakit.errors``.

This module imports nothing of kdakit but ``kdakit.error_layout``: the op modules sit above it.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import error_layout

TAGS = (torch.Tag.needs_exact_strides,)

OPS: dict[str, Op] = {}


def _writes_only(*args, **kwargs):
    """The fake implementation: every op writes caller-owned buffers and returns None."""
    return None


def _optional(convert):
    def maybe(x):
        return None if x is None else convert(x)
    return maybe


def _keep(x):
    return x


_SCALARS = {"FloatType": float, "BoolType": bool, "IntType": int}


def _conversion(arg_type) -> Callable:
    """What turns a Python value into an argument of ``arg_type`` (schema scalars only)."""
    kind = arg_type.kind()
    if kind == "OptionalType" and arg_type.getElementType().kind() in _SCALARS:
        return _optional(_SCALARS[arg_type.getElementType().kind()])
    return _SCALARS.get(kind, _keep)


class Op:
    """A public op: its custom op ``torch.ops.kdakit.<name>`` and the call that picks the path."""

    def __init__(self, name: str, mutates: tuple[str, ...], body: Callable, dispatch: Callable | None,
                 flatten: Callable | None, counts_errors: bool = False):
        self.name = name
        self.mutates = tuple(mutates)
        self.counts_errors = counts_errors
        self.custom_op = torch.library.custom_op(f"kdakit::{name}", mutates_args=self.mutates, tags=TAGS)(body)
        self.custom_op.register_fake(_writes_only)
        self.schema = self.overload._schema
        if self.schema.arguments[-1].name != "backend":
            raise TypeError(f"kdakit::{name}: the last argument must be `backend: str | None`.")
        self.dispatch = dispatch or body
        self.flatten = flatten
        self._conversions = tuple(_conversion(a.type) for a in self.schema.arguments)
        self.example: Callable | None = None
        self.__doc__ = body.__doc__

    def __call__(self, *args) -> None:
        """Run the op on the entry's (validated) arguments; the first one is a tensor."""
        if torch.compiler.is_compiling() or type(args[0]) is not torch.Tensor:
            getattr(torch.ops.kdakit, self.name)(*self.schema_args(*args))
        else:
            self.dispatch(*args)

    @property
    def overload(self):
        """``torch.ops.kdakit.<name>.default``, looked up on each use (as graphs hold it): torch
        builds new op objects when an op of the namespace is defined again."""
        return getattr(torch.ops.kdakit, self.name).default

    def schema_args(self, *args) -> tuple:
        """The entry's arguments as the custom op takes them (flattened, scalars converted)."""
        if self.flatten is not None:
            args = self.flatten(*args)
        return tuple([convert(x) for convert, x in zip(self._conversions, args)])

    def register_example(self, build: Callable) -> Callable:
        """Decorator: ``build(seed, device="cpu", **options) -> (public entry, args, kwargs)``,
        small inputs of a call (fresh tensors; the same scalars for every seed), which the
        generic tests run on every op."""
        self.example = build
        return build

    def __repr__(self) -> str:
        return f"<kdakit op {self.schema}>"


def kdakit_op(name: str, *, mutates: tuple[str, ...], counts_errors: bool = False,
              dispatch: Callable | None = None, flatten: Callable | None = None) -> Callable[[Callable], Op]:
    """Decorator: the typed body becomes ``torch.ops.kdakit.<name>`` (registered in ``OPS``).

    ``mutates``: the arguments the op writes. ``counts_errors``: the op counts the indices it
    finds outside their buffers on its counter (``kdakit.errors``). Without ``dispatch``, the
    body is also the eager path. ``dispatch``/``flatten``: see the module doc (arguments with
    no schema type).
    """
    def decorate(body: Callable) -> Op:
        if name in OPS:
            raise ValueError(f"kdakit::{name} is already registered.")
        if counts_errors:
            error_layout.declare(name)  # raises once the counters are laid out
        op = Op(name, mutates, body, dispatch, flatten, counts_errors)
        OPS[name] = op
        return op
    return decorate


def error_counting_ops() -> tuple[str, ...]:
    """The ops that count index errors (``counts_errors=True``), sorted by name: an op's position
    is its counter's index (``kdakit.errors.INDEX``); see :func:`kdakit.error_layout.layout`. Fixed
    by the first call; a counting op registered later raises, as the counters have no room for it."""
    return error_layout.layout()


# ----------------------------------------------------------------------------
# Example inputs (seeded on the CPU, then moved: the same values on every device)
# ----------------------------------------------------------------------------
def example_rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def example_randn(g: torch.Generator, *shape, dtype=torch.float32, scale=1.0, device="cpu") -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def example_rand(g: torch.Generator, *shape, device="cpu") -> torch.Tensor:
    return torch.rand(*shape, generator=g).to(device)


def example_pool(g: torch.Generator, slots, HV, V, K, *, dtype=torch.float32, pad=7, device="cpu") -> torch.Tensor:
    """An interleaved state pool: slot stride > HV*V*K, as when layers share one allocation."""
    stride = HV * V * K + pad
    flat = example_randn(g, slots * stride, scale=0.5).to(dtype).to(device)
    return flat.as_strided((slots, HV, V, K), (stride, V * K, K, 1))


def example_index(*values, dtype=torch.int32, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)
