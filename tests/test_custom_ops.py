"""Every public op through ``torch.library`` custom ops (kdakit/ops/registry.py):
``torch.compile(fullgraph=True)`` gives eager's results, in-place pool writes and
padding rows included; ``opcheck`` passes on each ``torch.ops.kdakit.*`` op; the
shape contract still raises while compiling. CPU, reference backend (and the
Triton interpreter for the ``backend=`` pass-through)."""
import re

import pytest
import torch

from torch._dynamo.testing import CompileCounterWithBackend

import kdakit
from kdakit.ops.mtp_verify import mtp_verify_tensors
from kdakit.ops.registry import OPS

W = 4
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own closures of one code object: start from an empty cache
    (else Dynamo's per-code recompile limit trips)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rnd(g, *shape, dtype=F32, s=1.0):
    return (torch.randn(*shape, generator=g) * s).to(dtype)


def _strided_pool(g, slots, HV, V, K, dtype=F32, pad=7):
    """An interleaved pool: slot stride > HV*V*K, as when layers share one allocation."""
    stride = HV * V * K + pad
    flat = _rnd(g, slots * stride, s=0.5).to(dtype)
    return flat.as_strided((slots, HV, V, K), (stride, V * K, K, 1))


# ----------------------------------------------------------------------------
# One case per op: build(seed) -> (args, kwargs) with fresh tensors; the public op is
# called as op(*args, **kwargs). Tuples in args/kwargs hold tensors too.
# ----------------------------------------------------------------------------
def packed_decode_case(seed, *, act=BF16, out=True):
    g = _gen(seed)
    B, H, HV, K, V, slots = 3, 1, 2, 8, 16, 5
    args = (_rnd(g, B, 2 * H * K + HV * V, dtype=act), _rnd(g, B, HV * K, dtype=act), _rnd(g, B, HV, dtype=act),
            torch.rand(HV, generator=g), _rnd(g, HV * K, s=0.5), _strided_pool(g, slots, HV, V, K),
            torch.tensor([3, -1, 0], dtype=torch.int32))
    kw = dict(lower_bound=-2.0)
    if out:
        kw["out"] = torch.full((B, 1, HV, V), 7.0, dtype=act)
    return kdakit.packed_decode, args, kw


def fused_decode_case(seed, *, out=True):
    g = _gen(seed)
    B, H, HV, K, V, slots = 3, 1, 2, 8, 16, 5
    C = 2 * H * K + HV * V
    args = (_rnd(g, B, C, dtype=BF16), _rnd(g, C, W, s=0.5), _rnd(g, slots, C, W - 1, dtype=BF16),
            _rnd(g, B, HV * K, dtype=BF16), _rnd(g, B, HV, dtype=BF16), torch.rand(HV, generator=g),
            _rnd(g, HV * K, s=0.5), _rnd(g, slots, HV, V, K, s=0.5), torch.tensor([-1, 4, 1], dtype=torch.int32))
    kw = dict(conv_bias=_rnd(g, C, s=0.1), norm_gate=_rnd(g, B, HV * V, dtype=BF16),
              norm_weight=torch.rand(V, generator=g) + 0.5)
    if out:
        kw["out"] = torch.full((B, 1, HV, V), 7.0, dtype=BF16)
    return kdakit.fused_decode, args, kw


def conv1d_case(seed, *, out=True):
    g = _gen(seed)
    B, C, slots = 3, 24, 4
    args = (_rnd(g, B, C, dtype=BF16), _rnd(g, slots, C, W - 1, dtype=BF16), _rnd(g, C, W, s=0.5),
            torch.tensor([2, -1, 0], dtype=torch.int64))
    kw = dict(bias=_rnd(g, C, s=0.1))
    if out:
        kw["out"] = torch.full((B, C), 7.0, dtype=BF16)
    return kdakit.causal_conv1d_update, args, kw


def conv1d_varlen_case(seed, *, out=True):
    g = _gen(seed)
    T, C, slots = 9, 24, 5
    # x as the transposed [C, T] view engines hold, the pool as sglang's [slots, W-1, C] transposed
    args = (_rnd(g, C, T, dtype=BF16).t(), _rnd(g, slots, W - 1, C, dtype=BF16).transpose(1, 2),
            _rnd(g, C, W, s=0.5), torch.tensor([0, 4, 5, 9], dtype=torch.int32),
            torch.tensor([3, -1, 0], dtype=torch.int64))
    kw = dict(has_initial_state=torch.tensor([True, True, False]), bias=_rnd(g, C, s=0.1))
    if out:
        kw["out"] = torch.full((T, C), 7.0, dtype=BF16)
    return kdakit.causal_conv1d_varlen, args, kw


def gated_rmsnorm_case(seed, *, out=True):
    g = _gen(seed)
    B, HV, V = 3, 2, 16
    wide = _rnd(g, B, HV * V + 8, dtype=BF16)  # gate sliced from a wider projection: strided rows
    args = (_rnd(g, B, 1, HV, V, dtype=BF16), wide[:, :HV * V].view(B, 1, HV, V), torch.rand(V, generator=g) + 0.5)
    kw = dict(eps=1e-5)
    if out:
        kw["out"] = torch.full((B, 1, HV, V), 7.0, dtype=BF16)
    return kdakit.gated_rmsnorm, args, kw


def _verify_inputs(g, N, T, H, HV, K, V, slots):
    return (_rnd(g, N, T, H, K, dtype=BF16), _rnd(g, N, T, H, K, dtype=BF16), _rnd(g, N, T, HV, V, dtype=BF16),
            _rnd(g, N, T, HV, K, dtype=BF16), _rnd(g, N, T, HV, dtype=BF16), torch.rand(HV, generator=g),
            _rnd(g, HV * K, s=0.5), _rnd(g, slots, HV, V, K, s=0.5), torch.tensor([4, -1, 1], dtype=torch.int32),
            torch.tensor([0, 2, 1], dtype=torch.int32))


def mtp_verify_case(seed, *, mode="snapshot", out=True):
    g = _gen(seed)
    N, T, H, HV, K, V, slots, scratch = 3, 3, 1, 2, 8, 16, 5, 3
    channels = (H * K, H * K, HV * V)
    args = _verify_inputs(g, N, T, H, HV, K, V, slots)
    kw = dict(conv_weights=tuple(_rnd(g, c, W, s=0.5) for c in channels),
              conv_states=tuple(_rnd(g, slots, c, W - 1, dtype=BF16) for c in channels),
              intermediate_conv=tuple(torch.full((scratch, T + 1, c, W - 1), 7.0, dtype=BF16) for c in channels),
              lower_bound=-5.0)
    if mode == "snapshot":
        kw["snapshots"] = torch.full((scratch, T + 1, HV, V, K), 7.0)
        kw.update(conv_bias=tuple(_rnd(g, c, s=0.1) for c in channels))
    else:
        L = T + 1
        kw["rings"] = (torch.full((slots, H, L, K), 7.0, dtype=BF16), torch.full((slots, HV, L, V), 7.0, dtype=BF16),
                       torch.full((slots, HV, L, K), 7.0), torch.full((slots, HV, L), 7.0))
        kw.update(norm_gate=_rnd(g, N, T, HV, V, dtype=BF16), norm_weight=torch.rand(V, generator=g) + 0.5)
    if out:
        kw["out"] = torch.full((N, T, HV, V), 7.0, dtype=BF16)
    return kdakit.mtp_verify, args, kw


def commit_snapshots_case(seed, *, merged_conv_only=False):
    g = _gen(seed)
    HV, K, V, slots, scratch, L = 2, 8, 16, 5, 3, 4
    channels = (8, 8, 32)
    rows = (torch.tensor([4, -1, 1], dtype=torch.int32), torch.tensor([0, 2, 1], dtype=torch.int32),
            torch.tensor([2, 1, -1], dtype=torch.int32))
    if merged_conv_only:  # one merged q|k|v conv pool, no state snapshot (after a ring commit)
        C = sum(channels)
        args = (_rnd(g, slots, HV, V, K), None, *rows)
        kw = dict(conv_states=(_rnd(g, slots, C, W - 1, dtype=BF16),),
                  intermediate_conv=(_rnd(g, scratch, L, C, W - 1, dtype=BF16),))
    else:
        args = (_strided_pool(g, slots, HV, V, K), _rnd(g, scratch, L, HV, V, K), *rows)
        kw = dict(conv_states=tuple(_rnd(g, slots, c, W - 1, dtype=BF16) for c in channels),
                  intermediate_conv=tuple(_rnd(g, scratch, L, c, W - 1, dtype=BF16) for c in channels))
    return kdakit.commit_snapshots, args, kw


def commit_ring_case(seed, *, track=True):
    g = _gen(seed)
    H, HV, K, V, slots, L = 1, 2, 8, 16, 6, 4
    args = (_rnd(g, slots, HV, V, K, s=0.5), _rnd(g, slots, H, L, K, dtype=BF16), _rnd(g, slots, HV, L, V, dtype=BF16),
            -torch.rand(slots, HV, L, K, generator=g), torch.rand(slots, HV, L, generator=g),
            torch.tensor([4, -1, 1, 2], dtype=torch.int32), torch.tensor([3, 2, 1, 0], dtype=torch.int32))
    kw = dict(null_block_id=-1)
    if track:
        kw.update(track_slots=torch.tensor([5, 0, 3, 0], dtype=torch.int32),
                  track_steps=torch.tensor([1, 0, 0, 0], dtype=torch.int32))
    return kdakit.commit_ring, args, kw


def recurrent_forward_case(seed, *, out=True):
    g = _gen(seed)
    T, H, HV, K, V, slots = 5, 1, 2, 8, 16, 5
    args = (_rnd(g, 1, T, H, K), _rnd(g, 1, T, H, K), _rnd(g, 1, T, HV, V), _rnd(g, 1, T, HV, K),
            _rnd(g, 1, T, HV), _strided_pool(g, slots, HV, V, K), torch.tensor([3, -1, 0], dtype=torch.int32))
    kw = dict(cu_seqlens=torch.tensor([0, 2, 3, 5], dtype=torch.int32), A_log=torch.rand(HV, generator=g),
              dt_bias=_rnd(g, HV * K, s=0.5), lower_bound=-3.0, beta_is_logit=True,
              token_states=torch.full((T, HV, V, K), 7.0))
    if out:
        kw["out"] = torch.full((1, T, HV, V), 7.0)
    return kdakit.recurrent_forward, args, kw


CASES = {
    "packed_decode": packed_decode_case,
    "packed_decode-f32-out=None": lambda s: packed_decode_case(s, act=F32, out=False),
    "fused_decode": fused_decode_case,
    "fused_decode-out=None": lambda s: fused_decode_case(s, out=False),
    "causal_conv1d_update": conv1d_case,
    "causal_conv1d_varlen": conv1d_varlen_case,
    "causal_conv1d_varlen-out=None": lambda s: conv1d_varlen_case(s, out=False),
    "gated_rmsnorm": gated_rmsnorm_case,
    "gated_rmsnorm-out=None": lambda s: gated_rmsnorm_case(s, out=False),
    "mtp_verify-snapshot": mtp_verify_case,
    "mtp_verify-ring-norm-out=None": lambda s: mtp_verify_case(s, mode="ring", out=False),
    "commit_snapshots": commit_snapshots_case,
    "commit_snapshots-merged-conv-only": lambda s: commit_snapshots_case(s, merged_conv_only=True),
    "commit_ring-track": commit_ring_case,
    "recurrent_forward": recurrent_forward_case,
    "recurrent_forward-out=None": lambda s: recurrent_forward_case(s, out=False),
}


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
    op, args, kw = CASES[case](0)
    eager_out = op(*args, **kw)
    eager_tensors = _tensors(args, kw)

    op, args, kw = CASES[case](0)
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
    op, args, kw = packed_decode_case(1)
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
    op, args, kw = packed_decode_case(2, act=F32)
    eager = op(*args, **kw, backend="triton").clone()
    eager_state = args[5].clone()
    op, args, kw = packed_decode_case(2, act=F32)
    kw_tensors, kw_consts = _split_kw(kw)
    got, _ = _compiled(op, dict(kw_consts, backend="triton"))(args, kw_tensors)
    assert torch.equal(got, eager) and torch.equal(args[5], eager_state)
    with pytest.raises(ValueError, match="has no helion implementation"):  # raised when the op runs
        _compiled(kdakit.causal_conv1d_update, {"backend": "helion"})(*conv1d_case(0)[1:2], {})


def _dynamo_message(excinfo) -> str:
    return str(excinfo.value)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_shape_errors_raise_while_compiling(fullgraph):
    """Validation runs at trace time, before the op: nothing is written. With
    fullgraph=True Dynamo reports the ValueError (its text included) as Unsupported;
    without, it falls back to eager, which raises the ValueError itself."""
    op, args, kw = packed_decode_case(3)
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
    op, args, kw = conv1d_case(4)
    kw_tensors, kw_consts = _split_kw(kw)

    def fn(args, kw_tensors):
        return op(*args, **kw_tensors, full_checks=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="full_checks=True reads tensor values"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(args, kw_tensors)

    monkeypatch.setenv("KDAKIT_CHECKS", "full")
    eager_op, eager_args, eager_kw = conv1d_case(4)
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
def _opcheck_args(case):
    """The public call's arguments in the custom op's schema order (after the entry's defaults)."""
    op, args, kw = CASES[case](5)
    if case.startswith("packed_decode"):
        return "packed_decode", (*args, kw["out"], 8 ** -0.5, True, kw["lower_bound"], None)
    if case.startswith("fused_decode"):
        return "fused_decode", (*args, kw["out"], kw["conv_bias"], 8 ** -0.5, None, kw["norm_gate"],
                                kw["norm_weight"], 1e-6, None)
    if case.startswith("causal_conv1d_update"):
        return "causal_conv1d_update", (*args, kw["out"], kw["bias"], None)
    if case.startswith("causal_conv1d_varlen"):
        return "causal_conv1d_varlen", (*args, kw["out"], kw["has_initial_state"], kw["bias"], True, None)
    if case.startswith("gated_rmsnorm"):
        x, gate, weight = args
        groups = kdakit.contracts.check_gated_rmsnorm(x, gate, weight, kw["out"], eps=kw["eps"])
        (n_outer, n_inner, strides) = groups
        flat_groups = [n_outer, n_inner] + [s for pair in strides for s in pair]
        return "gated_rmsnorm", (x, gate, weight, kw["out"], kw["eps"], flat_groups, None)
    if case.startswith("mtp_verify"):
        flat = mtp_verify_tensors(kw["conv_weights"], kw["conv_states"], kw["intermediate_conv"], kw.get("conv_bias"),
                                  kw.get("snapshots"), kw.get("rings"))
        return "mtp_verify", (*args, kw["out"], *flat, 8 ** -0.5, kw["lower_bound"], kw.get("norm_gate"),
                              kw.get("norm_weight"), 1e-6, None)
    if case.startswith("commit_snapshots"):
        return "commit_snapshots", (*args, list(kw["conv_states"]), list(kw["intermediate_conv"]), None)
    if case.startswith("commit_ring"):
        return "commit_ring", (*args, kw["track_slots"], kw["track_steps"], True, -1, None)
    if case.startswith("recurrent_forward"):
        from kdakit.ops.recurrent_forward import BETA_SIGMOID
        return "recurrent_forward", (*args, kw["out"], kw["cu_seqlens"], None, True, kw["A_log"], kw["dt_bias"],
                                     kw["lower_bound"], BETA_SIGMOID, None, kw["token_states"], True, None, True, None)
    raise AssertionError(case)


OPCHECK_CASES = ["packed_decode", "fused_decode", "causal_conv1d_update", "causal_conv1d_varlen", "gated_rmsnorm", "mtp_verify-snapshot",
                 "commit_snapshots", "commit_ring-track", "recurrent_forward"]


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    name, args = _opcheck_args(case)
    # test_autograd_registration is inapplicable (inference-only ops, no tensor requires grad),
    # so it is left out; schema (declared mutations), fake impl and AOT dispatch are checked.
    torch.library.opcheck(getattr(torch.ops.kdakit, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_every_public_op_is_registered():
    public = {"packed_decode", "fused_decode", "causal_conv1d_update", "causal_conv1d_varlen", "gated_rmsnorm",
              "mtp_verify", "commit_snapshots", "commit_ring", "recurrent_forward"}
    public |= {"tree_verify", "commit_tree_ring"}
    public |= {"chunk_prefill"}
    assert set(OPS) == public
    for name in public:
        schema = getattr(torch.ops.kdakit, name).default._schema
        assert len(schema.returns) == 0, f"{name} must return None (it writes caller-owned buffers)"
        assert any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments), name
