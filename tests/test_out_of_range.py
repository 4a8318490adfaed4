"""Indices outside their buffers: every op treats such a row as padding (no read or write of
that buffer, zero output), counts it on the op's error counter (``kdakit.take_errors()``),
and full-check mode raises before launch instead.

Every pool, scratch buffer and ring here is a view into a larger buffer poisoned with a
sentinel before and after it; the bad index points into the poisoned part. The rest of the
larger buffer must stay bitwise unchanged, the bad row's output be zero, and everything
else equal what the same call gives with that row as a padding row (slot -1)."""
import dataclasses
import functools

import pytest
import torch

import kdakit
from kdakit.compat import sglang

from helpers import RING_FORMS, assert_close, with_ring_form

BACKENDS = ["reference", "triton"]
SENTINEL = 1e30
EXTRA = 2  # poisoned rows before and after each view
H, HV, K, V, W = 1, 2, 16, 8, 4
SLOTS, SCRATCH = 5, 4


class Buffers:
    """Views into poisoned larger buffers, and the check that nothing outside them changed."""

    def __init__(self, seed, device="cpu"):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device
        self.bigs = []

    def rnd(self, *shape, s=0.5):
        return (torch.randn(*shape, generator=self.gen) * s).to(self.device)

    def idx(self, *rows):
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def view(self, *shape, s=0.5, fill=None, dim=0):
        """A random (or ``fill``) tensor of ``shape``: the middle of a buffer poisoned along ``dim``."""
        big_shape = list(shape)
        big_shape[dim] += 2 * EXTRA
        big = torch.full(big_shape, SENTINEL, device=self.device)
        view = big.narrow(dim, EXTRA, shape[dim])
        view.copy_(self.rnd(*shape, s=s) if fill is None else torch.full(shape, fill, device=self.device))
        self.bigs.append((big, dim, shape[dim]))
        return view

    def assert_outside_untouched(self):
        for big, dim, n in self.bigs:
            for part in (big.narrow(dim, 0, EXTRA), big.narrow(dim, EXTRA + n, EXTRA)):
                assert torch.equal(part, torch.full_like(part, SENTINEL)), "memory outside a view changed"


# ----------------------------------------------------------------------------
# One case per op: build(bufs) -> (call(indices, backend) -> output or None, indices, the
# bad (name, row, value), the output's batch dim, the views the call updates).
# ----------------------------------------------------------------------------
def case_packed_decode(b):
    B = 3
    inputs = dict(mixed_qkv=b.rnd(B, 2 * H * K + HV * V), a=b.rnd(B, HV * K), b=b.rnd(B, HV), A_log=b.rnd(HV),
                  dt_bias=b.rnd(HV * K))
    state = b.view(SLOTS, HV, V, K)

    def call(ix, backend, full_checks=None):
        return kdakit.packed_decode(*inputs.values(), state, ix["slots"], backend=backend, full_checks=full_checks)
    return call, dict(slots=b.idx(1, 0, 3)), ("slots", 1, SLOTS), [state]


def case_packed_decode_sglang(b):
    B = 3
    inputs = dict(mixed_qkv=b.rnd(B, 2 * H * K + HV * V), a=b.rnd(B, HV * K), b=b.rnd(B, HV), A_log=b.rnd(HV),
                  dt_bias=b.rnd(HV * K))
    state = b.view(SLOTS, HV, V, K)

    def call(ix, backend, full_checks=None):
        out = torch.empty(B, 1, HV, V, device=b.device)  # the drop-in takes no backend: KDAKIT_BACKEND picks it
        sglang.fused_recurrent_kda_packed_decode(*inputs.values(), K ** -0.5, state, out, ix["slots"],
                                                 use_qk_l2norm_in_kernel=True)
        return out
    return call, dict(slots=b.idx(1, 0, 3)), ("slots", 0, SLOTS + 1), [state]


def case_causal_conv1d_update(b):
    B, C = 3, 24
    x, weight = b.rnd(B, C), b.rnd(C, W)
    conv = b.view(SLOTS, C, W - 1)

    def call(ix, backend, full_checks=None):
        return kdakit.causal_conv1d_update(x, conv, weight, ix["slots"], backend=backend, full_checks=full_checks)
    return call, dict(slots=b.idx(4, 2, 0)), ("slots", 2, SLOTS), [conv]


def case_fused_decode(b):
    B, C = 3, 2 * H * K + HV * V
    inputs = dict(qkv=b.rnd(B, C), conv_weight=b.rnd(C, W))
    conv = b.view(SLOTS, C, W - 1)
    rest = dict(a=b.rnd(B, HV * K), b=b.rnd(B, HV), A_log=b.rnd(HV), dt_bias=b.rnd(HV * K))
    state = b.view(SLOTS, HV, V, K)
    norm = dict(norm_gate=b.rnd(B, HV * V), norm_weight=b.rnd(V).abs() + 0.5)

    def call(ix, backend, full_checks=None):
        return kdakit.fused_decode(*inputs.values(), conv, *rest.values(), state, ix["slots"], backend=backend,
                                   full_checks=full_checks, **norm)
    return call, dict(slots=b.idx(0, 3, 2)), ("slots", 1, SLOTS), [conv, state]


def _verify_case(b, *, mode, conv, bad):
    N, T = 3, 3
    tokens = dict(q=b.rnd(N, T, H, K), k=b.rnd(N, T, H, K), v=b.rnd(N, T, HV, V), a=b.rnd(N, T, HV, K),
                  b=b.rnd(N, T, HV), A_log=b.rnd(HV), dt_bias=b.rnd(HV * K))
    state = b.view(SLOTS, HV, V, K)
    kw, updated = {}, []
    if conv:
        channels = (H * K, H * K, HV * V)
        kw["conv_weights"] = tuple(b.rnd(c, W) for c in channels)
        kw["conv_states"] = tuple(b.view(SLOTS, c, W - 1) for c in channels)
        kw["intermediate_conv"] = tuple(b.view(SCRATCH, T, c, W - 1, fill=7.0) for c in channels)
        updated += list(kw["intermediate_conv"])
    if mode == "snapshot":
        kw["snapshots"] = b.view(SCRATCH, T, HV, V, K, fill=7.0)
        updated.append(kw["snapshots"])
    else:
        kw["rings"] = (b.view(SLOTS, H, T, K, fill=7.0), b.view(SLOTS, HV, T, V, fill=7.0),
                       b.view(SLOTS, HV, T, K, fill=7.0), b.view(SLOTS, HV, T, fill=7.0))
        updated += list(kw["rings"])

    def call(ix, backend, full_checks=None):
        return kdakit.mtp_verify(*tokens.values(), state, ix["slots"], ix["rows"], lower_bound=-2.0, backend=backend,
                                 full_checks=full_checks, **kw)
    bad_index = {"slot": ("slots", 1, SLOTS), "row": ("rows", 1, SCRATCH), "negative-row": ("rows", 2, -1)}[bad]
    return call, dict(slots=b.idx(3, 0, 1), rows=b.idx(2, 0, 3)), bad_index, [state] + updated


def case_commit_snapshots(b, bad):
    N, L, C = 3, 3, 24
    state = b.view(SLOTS, HV, V, K)
    snaps = b.view(SCRATCH, L, HV, V, K)
    conv = b.view(SLOTS, C, W - 1)
    inter = b.view(SCRATCH, L, C, W - 1)

    def call(ix, backend, full_checks=None):
        kdakit.commit_snapshots(state, snaps, ix["slots"], ix["rows"], ix["steps"], conv_states=(conv,),
                                intermediate_conv=(inter,), backend=backend, full_checks=full_checks)
    bad_index = {"slot": ("slots", 0, SLOTS), "row": ("rows", 2, SCRATCH), "negative-row": ("rows", 1, -1),
                 "step": ("steps", 1, L)}[bad]
    return call, dict(slots=b.idx(2, 4, 0), rows=b.idx(1, 3, 0), steps=b.idx(2, 0, 1)), bad_index, [state, conv]


def case_commit_ring(b, bad, layered=False):
    L = 3
    lead = (2,) if layered else ()  # two layers: the slot dim is dim 1, poisoned in every layer
    state = b.view(*lead, SLOTS, HV, V, K, dim=len(lead))
    rings = tuple(b.view(*lead, SLOTS, *shape, dim=len(lead))
                  for shape in ((H, L, K), (HV, L, V), (HV, L, K), (HV, L)))
    rings[2].copy_(-rings[2].abs())  # log-decays
    rings[3].copy_(torch.sigmoid(rings[3]))  # betas

    def call(ix, backend, full_checks=None):
        kdakit.commit_ring(state, *rings, ix["slots"], ix["accept"], track_slots=ix["track"],
                           track_steps=ix["track_steps"], backend=backend, full_checks=full_checks)
    ix = dict(slots=b.idx(1, 3, 0), accept=b.idx(2, 3, 1), track=b.idx(4, -1, 2), track_steps=b.idx(0, 1, 0))
    bad_index = {"slot": ("slots", 1, SLOTS), "track-slot": ("track", 0, SLOTS)}[bad]
    return call, ix, bad_index, [state]


def case_recurrent_forward(b, per_token=False):
    T, N = 5, 3
    cu = b.idx(0, 2, 3, 5)
    tokens = dict(q=b.rnd(1, T, H, K), k=b.rnd(1, T, H, K), v=b.rnd(1, T, HV, V), g=b.rnd(1, T, HV, K),
                  beta=b.rnd(1, T, HV))
    gate = dict(A_log=b.rnd(HV), dt_bias=b.rnd(HV * K))
    state = b.view(SLOTS, HV, V, K)

    def call(ix, backend, full_checks=None):
        return kdakit.recurrent_forward(*tokens.values(), state, ix["slots"], cu_seqlens=cu, beta_is_logit=True,
                                        backend=backend, full_checks=full_checks, **gate)
    if per_token:  # a slot written after token 1 of sequence 2 is past the pool
        return call, dict(slots=b.idx([0, 1], [4, -1], [3, 2])), ("slots", (2, 1), SLOTS), [state]
    return call, dict(slots=b.idx(2, 0, 4)), ("slots", 0, SLOTS), [state]


def case_causal_conv1d_varlen(b):
    T, C = 6, 136  # two channel blocks: the sequence is counted by one of them
    x, weight = b.rnd(T, C), b.rnd(C, W)
    cu = b.idx(0, 2, 3, 6)
    conv = b.view(SLOTS, C, W - 1)

    def call(ix, backend, full_checks=None):
        return kdakit.causal_conv1d_varlen(x, conv, weight, cu, ix["slots"], backend=backend, full_checks=full_checks)
    # a padding sequence's outputs are its conv from a zero window (not zero): no output row check
    return call, dict(slots=b.idx(4, 1, 2)), ("slots", 1, SLOTS), [conv]


def case_chunk_prefill(b, bad):
    T = 70  # sequence 1 holds 64 tokens: one prefix-cache boundary, its chunk_state_indices[1, 0]
    cu = b.idx(0, 3, 67, 70)
    tokens = dict(q=b.rnd(1, T, H, K), k=b.rnd(1, T, H, K), v=b.rnd(1, T, HV, V), g=b.rnd(1, T, HV, K),
                  beta=b.rnd(1, T, HV))
    gate = dict(A_log=b.rnd(HV), dt_bias=b.rnd(HV * K))
    state = b.view(SLOTS, HV, V, K)
    chunk_states = b.view(SCRATCH, HV, V, K, fill=7.0)

    def call(ix, backend, full_checks=None):
        return kdakit.chunk_prefill(*tokens.values(), state, ix["slots"], cu_seqlens=cu, beta_is_logit=True,
                                    chunk_states=chunk_states, chunk_state_indices=ix["rows"], backend=backend,
                                    full_checks=full_checks, **gate)
    ix = dict(slots=b.idx(2, 0, 4), rows=b.idx([1], [3], [0]))
    # a row past chunk_states is compared with the same call with that row -1 (not written)
    bad_index = {"slot": ("slots", 1, SLOTS), "chunk-state-row": ("rows", (1, 0), SCRATCH, -1)}[bad]
    return call, ix, bad_index, [state, chunk_states]


def _tree_verify_case(b, *, mode, conv, bad):
    N, T = 3, 3
    tokens = dict(q=b.rnd(N, T, H, K), k=b.rnd(N, T, H, K), v=b.rnd(N, T, HV, V), a=b.rnd(N, T, HV, K),
                  b=b.rnd(N, T, HV), A_log=b.rnd(HV), dt_bias=b.rnd(HV * K))
    state = b.view(SLOTS, HV, V, K)
    kw, updated = {}, []
    if conv:
        channels = (H * K, H * K, HV * V)
        kw["conv_weights"] = tuple(b.rnd(c, W) for c in channels)
        kw["conv_states"] = tuple(b.view(SLOTS, c, W - 1) for c in channels)
        kw["intermediate_conv"] = tuple(b.view(SCRATCH, T, c, W - 1, fill=7.0) for c in channels)
        updated += list(kw["intermediate_conv"])
    if mode == "snapshot":
        kw["snapshots"] = b.view(SCRATCH, T, HV, V, K, fill=7.0)
        updated.append(kw["snapshots"])
    else:
        kw["rings"] = (b.view(SLOTS, H, T, K, fill=7.0), b.view(SLOTS, HV, T, V, fill=7.0),
                       b.view(SLOTS, HV, T, K, fill=7.0), b.view(SLOTS, HV, T, fill=7.0))
        updated += list(kw["rings"])

    def call(ix, backend, full_checks=None):
        return kdakit.tree_verify(*tokens.values(), state, ix["slots"], ix["rows"], ix["parents"], lower_bound=-2.0,
                                  backend=backend, full_checks=full_checks, **kw)
    ix = dict(slots=b.idx(3, 0, 1), rows=b.idx(2, 0, 3), parents=b.idx([-1, 0, 0], [-1, 0, 0], [-1, -1, 1]))
    # an invalid parent is compared with the same call with that parent -1 (how it is treated)
    bad_index = {"slot": ("slots", 1, SLOTS), "row": ("rows", 1, SCRATCH), "negative-row": ("rows", 2, -1),
                 "parent": ("parents", (1, 2), 2, -1), "negative-parent": ("parents", (0, 1), -3, -1)}[bad]
    return call, ix, bad_index, [state] + updated


def case_commit_tree_ring(b, bad):
    L = 3
    state = b.view(SLOTS, HV, V, K)
    rings = tuple(b.view(SLOTS, *shape) for shape in ((H, L, K), (HV, L, V), (HV, L, K), (HV, L)))
    rings[2].copy_(-rings[2].abs())  # log-decays
    rings[3].copy_(torch.sigmoid(rings[3]))  # betas

    def call(ix, backend, full_checks=None):
        kdakit.commit_tree_ring(state, *rings, ix["slots"], ix["paths"], ix["accept"], backend=backend,
                                full_checks=full_checks)
    ix = dict(slots=b.idx(1, 3, 0), paths=b.idx([0, 1, 2], [0, 2, -1], [0, 1, -1]), accept=b.idx(3, 2, 1))
    # a path node outside the rings: the request is skipped, as a padding row (slot -1) is
    bad_index = {"slot": ("slots", 1, SLOTS), "node": ("paths", (1, 1), L),
                 "negative-node": ("paths", (0, 2), -2)}[bad]
    return call, ix, bad_index, [state]


CASES = [  # (op counted, case builder, the index of the bad row's outputs, or None: no output)
    pytest.param("packed_decode", case_packed_decode, 1, id="packed_decode-slot"),
    pytest.param("packed_decode", case_packed_decode_sglang, 0, id="sglang-packed-decode-slot"),
    pytest.param("causal_conv1d_update", case_causal_conv1d_update, 2, id="causal_conv1d_update-slot"),
    pytest.param("fused_decode", case_fused_decode, 1, id="fused_decode-slot"),
    pytest.param("fused_decode", case_fused_decode, 1, id="fused_decode-chain-slot"),
    *[pytest.param("mtp_verify", lambda b, m=mode, c=conv, x=bad: _verify_case(b, mode=m, conv=c, bad=x), 1 if
                   bad != "negative-row" else 2, id=f"mtp_verify-{mode}{'-conv' if conv else ''}-{bad}")
      for mode, conv, bad in (("snapshot", False, "slot"), ("snapshot", False, "row"),
                              ("snapshot", True, "negative-row"), ("ring-recurrent", False, "slot"),
                              ("ring-chunked", False, "slot"), ("ring-chunked", True, "row"),
                              ("ring-chunked-from-inputs", False, "slot"),
                              ("ring-recurrent", True, "negative-row"))],
    *[pytest.param("commit_snapshots", lambda b, x=bad: case_commit_snapshots(b, x), None,
                   id=f"commit_snapshots-{bad}") for bad in ("slot", "row", "negative-row", "step")],
    pytest.param("commit_ring", lambda b: case_commit_ring(b, "slot"), None, id="commit_ring-slot"),
    pytest.param("commit_ring", lambda b: case_commit_ring(b, "track-slot"), None, id="commit_ring-track-slot"),
    pytest.param("commit_ring", lambda b: case_commit_ring(b, "slot", layered=True), None,
                 id="commit_ring-layered-slot"),
    pytest.param("recurrent_forward", case_recurrent_forward, (0, slice(0, 2)), id="recurrent_forward-slot"),
    pytest.param("recurrent_forward", lambda b: case_recurrent_forward(b, per_token=True), (0, slice(3, 5)),
                 id="recurrent_forward-per-token-slot"),
    pytest.param("causal_conv1d_varlen", case_causal_conv1d_varlen, None, id="causal_conv1d_varlen-slot"),
    pytest.param("chunk_prefill", lambda b: case_chunk_prefill(b, "slot"), (0, slice(3, 67)), id="chunk_prefill-slot"),
    pytest.param("chunk_prefill", lambda b: case_chunk_prefill(b, "chunk-state-row"), None,
                 id="chunk_prefill-chunk-state-row"),
    *[pytest.param("tree_verify", lambda b, m=mode, c=conv, x=bad: _tree_verify_case(b, mode=m, conv=c, bad=x),
                   {"negative-row": 2, "parent": None, "negative-parent": None}.get(bad, 1),
                   id=f"tree_verify-{mode}{'-conv' if conv else ''}-{bad}")
      for mode, conv, bad in (("snapshot", False, "slot"), ("snapshot", True, "row"),
                              ("snapshot", True, "negative-row"), ("snapshot", False, "parent"),
                              ("ring", False, "slot"), ("ring", True, "row"), ("ring", False, "negative-parent"),
                              ("ring-chunked-from-inputs", False, "slot"), ("ring-chunked-from-inputs", True, "row"),
                              ("ring-chunked-from-inputs", False, "parent"))],
    *[pytest.param("commit_tree_ring", lambda b, x=bad: case_commit_tree_ring(b, x), None,
                   id=f"commit_tree_ring-{bad}") for bad in ("slot", "node", "negative-node")],
]


def _padding_instead(ix, bad):
    """The same indices with the bad row as a padding row (its slot -1), or, where the case
    gives a fourth entry, with the bad entry set to it (how the op treats that entry)."""
    name, row = bad[:2]
    ix = {key: t.clone() for key, t in ix.items()}
    if len(bad) == 4:
        ix[name][row] = bad[3]
        return ix
    ix["slots"][row[0] if isinstance(row, tuple) else row] = -1  # a 2-D row: its start slot too
    return ix


def _with_bad(ix, bad):
    name, row, value = bad[:3]
    ix = {key: t.clone() for key, t in ix.items()}
    ix[name][row] = value
    return ix


@pytest.fixture
def configure(monkeypatch, request):
    """Ring forms and the fused decode's chain, by case id."""
    from kdakit.ops import fused_decode as fused_module
    from kdakit.ops import mtp_verify as verify_module
    from kdakit.ops import tree_verify as tree_module
    name = request.node.callspec.id
    form = next((f for f in sorted(RING_FORMS, key=len, reverse=True) if f"ring-{f}-" in name), None)
    if form is not None:  # the longest form the id names ("chunked" is a prefix of another)
        for module, picker in ((verify_module, "mtp_verify_config"), (tree_module, "tree_verify_config")):
            monkeypatch.setattr(module, picker, lambda *a, pinned=getattr(module, picker), **kw:
                                with_ring_form(pinned(*a, **kw), form))
    if "chain" in name:
        monkeypatch.setattr(fused_module, "fused_decode_config",
                            functools.partial(fused_module.fused_decode_config, chain_above_pairs=0))
    monkeypatch.delenv("KDAKIT_CHECKS", raising=False)


def test_counters_are_the_registered_ops_that_count():
    """``kdakit.errors.OPS``: the registered ops declared with ``counts_errors=True``, sorted, one
    counter each in that order; the op that indexes no buffer counts nothing; a counting op
    registered once the counters are laid out is refused (its counter would not exist)."""
    from kdakit.ops.registry import OPS, kdakit_op
    counting = {name for name, op in OPS.items() if op.counts_errors}
    assert kdakit.errors.OPS == tuple(sorted(counting))
    assert kdakit.errors.INDEX == {name: i for i, name in enumerate(kdakit.errors.OPS)}
    assert set(OPS) - counting == {"gated_rmsnorm"}
    with pytest.raises(RuntimeError, match="after the counters were laid out"):
        kdakit_op("late_counting_op", mutates=(), counts_errors=True)(lambda x: None)
    assert "late_counting_op" not in OPS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op, build, out_row", CASES)
def test_index_outside_its_buffer_is_a_counted_padding_row(op, build, out_row, backend, configure, monkeypatch):
    if build is case_packed_decode_sglang:
        monkeypatch.setenv("KDAKIT_BACKEND", backend)
    kdakit.take_errors()
    # The expected result: the same call with that row as padding, on copies of the views.
    expect_bufs = Buffers(0)
    call, ix, bad, views = build(expect_bufs)
    expected_out = call(_padding_instead(ix, bad), "reference")
    expected = [v.clone() for v in views]
    assert kdakit.take_errors() == {}

    bufs = Buffers(0)
    call, ix, bad, views = build(bufs)
    out = call(_with_bad(ix, bad), backend)
    bufs.assert_outside_untouched()
    assert kdakit.take_errors() == {op: 1}
    assert kdakit.take_errors() == {}
    for got, want in zip(views, expected):
        assert_close(got, want, 1e-5, "updated buffer")
    if out is not None:
        if out_row is not None:
            assert torch.equal(out[out_row], torch.zeros_like(out[out_row])), "the bad row's output is not zero"
        assert_close(out, expected_out, 1e-5, "output")


@pytest.mark.parametrize("op, build, out_row", [c for c in CASES if "chain" not in c.id])
def test_full_checks_raise_before_launch(op, build, out_row, configure):
    if build is case_packed_decode_sglang:
        pytest.skip("the drop-in takes no full_checks argument (KDAKIT_CHECKS=full)")
    kdakit.take_errors()
    bufs = Buffers(0)
    call, ix, bad, views = build(bufs)
    before = [v.clone() for v in views]
    with pytest.raises(ValueError, match="out of range|past the|invalid parent|outside the rings"):
        call(_with_bad(ix, bad), "triton", full_checks=True)
    for got, want in zip(views, before):
        assert torch.equal(got, want)
    bufs.assert_outside_untouched()
    assert kdakit.take_errors() == {}


def test_take_errors_sums_ops_and_resets():
    kdakit.take_errors()
    bufs = Buffers(1)
    call, ix, bad, _ = case_packed_decode(bufs)
    for backend in BACKENDS:
        call(_with_bad(ix, bad), backend)
    call, ix, bad, _ = case_causal_conv1d_update(bufs)
    call(_with_bad(ix, bad), "triton")
    assert kdakit.take_errors() == {"packed_decode": 2, "causal_conv1d_update": 1}
    assert kdakit.take_errors() == {}


@pytest.mark.parametrize("mode", ["eager", "generated-triton-code"])
def test_helion_packed_decode(monkeypatch, mode):
    pytest.importorskip("helion")
    if mode == "eager":  # Helion's reference mode
        monkeypatch.setenv("HELION_INTERPRET", "1")
    else:  # the Triton code Helion generates, in Triton's interpreter (no libdevice there)
        import triton
        import triton.language as tl
        if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9):
            pytest.skip("Helion's generated code fails in Triton 3.9's interpreter before any of this "
                        "(too many indices for tensor of rank 0), as in test_packed_decode_helion.py")
        import triton.language.extra.libdevice as libdevice
        monkeypatch.delenv("HELION_INTERPRET", raising=False)
        monkeypatch.setattr(libdevice, "exp", lambda x: tl.exp(x), raising=False)
        from kdakit.ops import packed_decode as module
        from kdakit.ops.packed_decode_helion import packed_decode_helion
        select = module.select  # the public entry accepts the helion backend only with HELION_INTERPRET=1
        monkeypatch.setattr(module, "select", lambda op, device, backend=None: (
            ("helion", packed_decode_helion) if backend == "helion" else select(op, device, backend)))
    kdakit.take_errors()
    expect_bufs = Buffers(2)
    call, ix, bad, views = case_packed_decode(expect_bufs)
    expected_out = call(_padding_instead(ix, bad), "reference")
    bufs = Buffers(2)
    call, ix, bad, views = case_packed_decode(bufs)
    out = call(_with_bad(ix, bad), "helion")
    bufs.assert_outside_untouched()
    assert kdakit.take_errors() == {"packed_decode": 1}
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out, expected_out, 1e-5, "output")
    assert_close(views[0], expect_bufs.bigs[0][0][EXTRA:EXTRA + SLOTS], 1e-5, "state")
