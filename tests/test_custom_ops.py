"""Every public op through ``torch.library`` custom ops (kdakit/ops/registry.py):
``torch.compile(fullgraph=True)`` gives eager's results, in-place pool writes and
padding rows included; ``opcheck`` passes on each ``torch.ops.kdakit.*`` op; the
shape contract still raises while compiling. CPU, reference backend (and the
Triton interpreter for the ``backend=`` pass-through). Every op in the registry
(``kdakit.ops.registry.OPS``) runs here on its example inputs."""
import re

import pytest
import torch

from torch._dynamo.testing import CompileCounterWithBackend

import kdakit
from kdakit.ops.registry import OPS

F32 = torch.float32


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own closures of one code object: start from an empty cache
    (else Dynamo's per-code recompile limit trips)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def example(name, seed, **options):
    """``(public op, args, kwargs)``: the registry's example inputs of op ``name`` (fresh tensors)."""
    return OPS[name].example(seed, **options)


# ----------------------------------------------------------------------------
# The cases: every registered op's example (a new op is covered by its registration),
# then variants of some (op name, example options). The public op is called as
# op(*args, **kwargs); tuples in args/kwargs hold tensors too.
# ----------------------------------------------------------------------------
VARIANTS = {
    "packed_decode-f32-out=None": ("packed_decode", dict(act=F32, out=False)),
    "fused_decode-out=None": ("fused_decode", dict(out=False)),
    "causal_conv1d_varlen-out=None": ("causal_conv1d_varlen", dict(out=False)),
    "gated_rmsnorm-out=None": ("gated_rmsnorm", dict(out=False)),
    "mtp_verify-ring-norm-out=None": ("mtp_verify", dict(mode="ring", out=False)),
    "commit_snapshots-merged-conv-only": ("commit_snapshots", dict(merged_conv_only=True)),
    "recurrent_forward-out=None": ("recurrent_forward", dict(out=False)),
    "tree_verify-ring-norm": ("tree_verify", dict(mode="ring")),
}
CASES = {name: (name, {}) for name in OPS} | VARIANTS


def build(case, seed):
    name, options = CASES[case]
    return example(name, seed, **options)


def _tensors(args, kw):
    """Every tensor of a call, in a fixed order (tuple members included)."""
    flat = []
    for x in list(args) + [kw[k] for k in sorted(kw)]:
        for t in (x if isinstance(x, (tuple, list)) else (x,)):
            if isinstance(t, torch.Tensor):
                flat.append(t)
    return flat


def _compiled(op, kw_consts, counter=None):
    """A function of the tensors only (scalars and flags baked in), compiled whole."""
    def fn(args, kw_tensors):
        result = op(*args, **kw_tensors, **kw_consts)
        # Something after the op that reads its output: the graph must order it after the write.
        return result, (result.float().sum() if isinstance(result, torch.Tensor) else None)
    return torch.compile(fn, fullgraph=True, backend=counter or "aot_eager")


def _split_kw(kw):
    tensors = {k: v for k, v in kw.items() if isinstance(v, (torch.Tensor, tuple, list))}
    return tensors, {k: v for k, v in kw.items() if k not in tensors}


@pytest.mark.parametrize("case", list(CASES))
def test_compile_fullgraph_matches_eager(case):
    op, args, kw = build(case, 0)
    eager_out = op(*args, **kw)
    eager_tensors = _tensors(args, kw)

    op, args, kw = build(case, 0)
    kw_tensors, kw_consts = _split_kw(kw)
    counter = CompileCounterWithBackend("aot_eager")
    got, checksum = _compiled(op, kw_consts, counter)(args, kw_tensors)
    assert counter.frame_count == 1
    called = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert getattr(torch.ops.kdakit, op.__name__) in called or getattr(torch.ops.kdakit, op.__name__).default \
        in called, f"the graph must hold torch.ops.kdakit.{op.__name__} (got {called})"
    if eager_out is None:
        assert got is None
    else:
        assert torch.equal(got, eager_out)
        assert checksum == eager_out.float().sum()
        if "out" in kw:
            assert torch.equal(kw["out"], eager_out), "the caller's `out` must hold the result"
    for i, (after_compiled, after_eager) in enumerate(zip(_tensors(args, kw), eager_tensors)):
        # pools written in place, read-only inputs untouched, padding rows untouched: exactly as eager
        assert torch.equal(after_compiled, after_eager), f"tensor #{i} differs from eager after the compiled call"


def test_compile_padding_rows_and_untouched_slots():
    op, args, kw = example("packed_decode", 1)
    state = args[5]
    before = state.clone()
    kw_tensors, kw_consts = _split_kw(kw)
    out, _ = _compiled(op, kw_consts)(args, kw_tensors)
    assert torch.equal(out[1], torch.zeros_like(out[1])), "padding row output must be zero"
    for slot in (1, 2, 4):  # not in slot_indices [3, -1, 0]
        assert torch.equal(state[slot], before[slot])
    assert not torch.equal(state[3], before[3]) and not torch.equal(state[0], before[0])


def test_compile_backend_argument_passes_through():
    """``backend="triton"`` (Triton interpreter on CPU) under compile == eager Triton."""
    op, args, kw = example("packed_decode", 2, act=F32)
    eager = op(*args, **kw, backend="triton").clone()
    eager_state = args[5].clone()
    op, args, kw = example("packed_decode", 2, act=F32)
    kw_tensors, kw_consts = _split_kw(kw)
    got, _ = _compiled(op, dict(kw_consts, backend="triton"))(args, kw_tensors)
    assert torch.equal(got, eager) and torch.equal(args[5], eager_state)
    with pytest.raises(ValueError, match="has no helion implementation"):  # raised when the op runs
        _compiled(kdakit.causal_conv1d_update, {"backend": "helion"})(*example("causal_conv1d_update", 0)[1:2], {})


def _dynamo_message(excinfo) -> str:
    return str(excinfo.value)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_shape_errors_raise_while_compiling(fullgraph):
    """Validation runs at trace time, before the op: nothing is written. With
    fullgraph=True Dynamo reports the ValueError (its text included) as Unsupported;
    without, it falls back to eager, which raises the ValueError itself."""
    op, args, kw = example("packed_decode", 3)
    args = list(args)
    args[1] = args[1][:, :-1]  # `a` one column short
    state_before = args[5].clone()
    kw_tensors, kw_consts = _split_kw(kw)

    def fn(args, kw_tensors):
        return op(*args, **kw_tensors, **kw_consts)
    compiled = torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")
    text = re.escape("`a` must have shape [B, HV*K] with HV=2, K=8 (got a.shape=(3, 15)).")
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"ValueError\(.*" + text):
            compiled(args, kw_tensors)
    else:
        with pytest.raises(ValueError, match=text):
            compiled(args, kw_tensors)
    assert torch.equal(args[5], state_before)
    assert torch.equal(kw["out"], torch.full_like(kw["out"], 7.0))


def test_full_checks_under_compile(monkeypatch):
    """Explicit full_checks=True cannot run on fake tensors: a clear error while compiling.
    The KDAKIT_CHECKS=full default is skipped while compiling (shape checks still run)."""
    op, args, kw = example("causal_conv1d_update", 4)
    kw_tensors, kw_consts = _split_kw(kw)

    def fn(args, kw_tensors):
        return op(*args, **kw_tensors, full_checks=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="full_checks=True reads tensor values"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(args, kw_tensors)

    monkeypatch.setenv("KDAKIT_CHECKS", "full")
    eager_op, eager_args, eager_kw = example("causal_conv1d_update", 4)
    expected = eager_op(*eager_args, **eager_kw)  # eager still runs the data checks
    got, _ = _compiled(op, kw_consts)(args, kw_tensors)
    assert torch.equal(got, expected)
    bad = list(eager_args)
    bad[3] = torch.tensor([2, -1, 9], dtype=torch.int64)  # slot 9 is out of range for 4 slots
    with pytest.raises(ValueError, match="out of range"):
        eager_op(*bad, **eager_kw)


# ----------------------------------------------------------------------------
# opcheck on the custom ops themselves (schema, fake impl, mutations, AOT dispatch)
# ----------------------------------------------------------------------------
def schema_args(name, public, args, kw) -> tuple:
    """The custom op's arguments for this public call (after the entry's defaults and
    validation): what its traced branch passes to ``torch.ops.kdakit.<name>``."""
    op, calls = OPS[name], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(op, "dispatch", lambda *a: calls.append(a))  # record the eager call, run nothing
        public(*args, **kw)
    (call,) = calls
    return op.schema_args(*call)


@pytest.mark.parametrize("name", list(OPS))
def test_opcheck(name):
    args = schema_args(name, *example(name, 5))
    # test_autograd_registration is inapplicable (inference-only ops, no tensor requires grad),
    # so it is left out; schema (declared mutations), fake impl and AOT dispatch are checked.
    torch.library.opcheck(getattr(torch.ops.kdakit, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_every_public_op_is_registered():
    public = {name for name in kdakit.__all__
              if callable(getattr(kdakit, name)) and getattr(kdakit, name).__module__.startswith("kdakit.ops.")}
    assert public >= {"packed_decode", "fused_decode", "causal_conv1d_update", "causal_conv1d_varlen",
                      "gated_rmsnorm", "mtp_verify", "commit_snapshots", "commit_ring", "recurrent_forward",
                      "tree_verify", "commit_tree_ring", "chunk_prefill"}
    assert set(OPS) == public
    for name in public:
        op = OPS[name]
        schema = getattr(torch.ops.kdakit, name).default._schema
        assert len(schema.returns) == 0, f"{name} must return None (it writes caller-owned buffers)"
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written and written == set(op.mutates), name
        assert torch.Tag.needs_exact_strides in getattr(torch.ops.kdakit, name).default.tags, name
        assert op.example is not None, f"{name} has no example inputs (@{name}_op.register_example)"
        assert op.example(0)[0] is getattr(kdakit, name), f"{name}'s example must call the public entry"
