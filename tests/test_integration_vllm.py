"""kdakit as vLLM 0.33.0's Kimi Linear KDA layer (kdakit/integrations/vllm.py), on vLLM's own code:
the plugin loaded through vLLM's ``load_general_plugins`` (this package's entry point), vLLM's
``PluggableLayer.__new__`` found building kdakit's subclass, then the subclass's ``_forward``
driven by hand-built ``GDNAttentionMetadata`` on page-strided pools and compared with vLLM's own
``KimiGatedDeltaNetAttention._forward`` whose kernels (the module globals ``causal_conv1d_fn``,
``causal_conv1d_update``, ``gather_initial_states`` and the functions it imports from
``vllm.models.kimi_k3.nvidia.ops.third_party.kda``) are replaced by float64 versions written here
from vLLM's kernel semantics: outputs and every pool slot.

Needs vLLM 0.33.0's wheel installed without its dependencies plus the packages its import chain
needs (``VLLM_PACKAGES``; .ci/run installs them); skipped, saying so, when vLLM does not import.
The output norm ``o_norm`` (vLLM's CustomOp, which needs a device-bound vLLM config to build) is
replaced on both sides by the same float64 gated RMSNorm: both ``_forward``s call ``self.o_norm``.
"""
from __future__ import annotations

import logging
import os
import sys
import types

import pytest
import torch

import kdakit.reference as ref

F64 = torch.float64
VLLM_PACKAGES = ("psutil", "pyzmq", "cbor2", "transformers==5.17.0", "msgspec", "uvloop", "prometheus_client",
                 "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "fastapi", "starlette", "annotated_doc",
                 "opentelemetry-api", "partial-json-parser", "llguidance", "cachetools", "pybase64", "openai",
                 "openai_harmony", "pillow", "aiohttp", "pydantic", "regex", "requests", "pyyaml", "cloudpickle",
                 "py-cpuinfo")
NK = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
H, D, W = 2, 16, 4
P = H * D
LOWER_BOUND = -5.0


# ---------------------------------------------------------------------------------------------
# vLLM, imported once per worker, the plugin loaded through vLLM's own loader
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vl():
    try:
        import vllm.plugins as plugins
        from vllm.model_executor import custom_op
        from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn as kg
        from vllm.v1.attention.backends import gdn_attn
    except ImportError as err:
        pytest.skip(f"vLLM 0.33.0's KDA layer does not import here ({err}); pip install --no-deps vllm==0.33.0 "
                    f"{' '.join(repr(p) for p in VLLM_PACKAGES)}")
    from kdakit.integrations import vllm as integ
    mp = pytest.MonkeyPatch()
    mp.setattr(integ, "_platform_is_cuda", lambda: True)      # a CPU machine stands in for CUDA
    mp.setenv("VLLM_PLUGINS", "kdakit")
    mp.delenv("KDAKIT_VLLM", raising=False)
    mp.setattr(plugins, "plugins_loaded", False)
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: records.append(f"{r.levelname} {r.name}: {r.getMessage()}")
    logging.getLogger(integ.__name__).addHandler(handler)
    logging.getLogger(integ.__name__).setLevel(logging.INFO)
    original = kg.KimiGatedDeltaNetAttention._forward
    try:
        plugins.load_general_plugins()
    finally:
        logging.getLogger(integ.__name__).removeHandler(handler)
    yield types.SimpleNamespace(kg=kg, gdn=gdn_attn, custom_op=custom_op, plugins=plugins, integ=integ,
                                base=kg.KimiGatedDeltaNetAttention, original=original, log=records, mp=mp)
    mp.undo()


def test_load_general_plugins_registers_kdakits_layer(vl):
    cls = vl.custom_op.op_registry_oot["KimiGatedDeltaNetAttention"]
    assert issubclass(cls, vl.base) and cls is not vl.base and cls.__module__ == "kdakit.integrations.vllm"
    assert vl.base._forward is vl.original                       # vLLM's class itself is untouched
    # vLLM's PluggableLayer.__new__ builds kdakit's class when vLLM builds its own
    assert type(vl.base.__new__(vl.base)) is cls
    assert set(vars(cls)) - {"__module__", "__qualname__", "__doc__", "name", "__abstractmethods__", "_abc_impl"} == {
        "_forward", "_kdakit_plan", "_kdakit_dim_first", "_kdakit_prefill", "_kdakit_decode", "kdakit_routes"}
    assert cls._forward.__wrapped__ is not None                  # eager_break_during_capture kept
    line = "\n".join(vl.log)
    assert "kdakit vLLM plugin active (vLLM 0.33.0)" in line and "speculative verify" in line
    assert len([r for r in vl.log if "plugin active" in r]) == 1
    assert vl.integ.register() is cls                            # idempotent


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_switch_off_leaves_vllm_unchanged(vl, monkeypatch, caplog, value):
    monkeypatch.setattr(vl.integ, "_registered", {})
    monkeypatch.delitem(vl.custom_op.op_registry_oot, "KimiGatedDeltaNetAttention")
    monkeypatch.setenv("KDAKIT_VLLM", value)
    with caplog.at_level(logging.WARNING):
        assert vl.integ.register() is None
    assert "KimiGatedDeltaNetAttention" not in vl.custom_op.op_registry_oot
    assert "switched off by KDAKIT_VLLM" in caplog.text


@pytest.mark.parametrize("failure", ["version", "signature", "raises", "not_cuda", "taken"])
def test_refusals_and_failures_leave_vllm_unchanged(vl, monkeypatch, caplog, failure):
    monkeypatch.setattr(vl.integ, "_registered", {})
    monkeypatch.delitem(vl.custom_op.op_registry_oot, "KimiGatedDeltaNetAttention")
    if failure == "version":
        monkeypatch.setattr(vl.integ, "installed_vllm_version", lambda: "0.34.0")
    elif failure == "signature":
        monkeypatch.setattr(vl.integ, "FORWARD_PARAMETERS", ("self", "hidden_states"))
    elif failure == "raises":
        monkeypatch.setattr(vl.integ, "make_layer_class", lambda *a: 1 / 0)
    elif failure == "not_cuda":
        monkeypatch.setattr(vl.integ, "_platform_is_cuda", lambda: False)
    else:
        other = type("Other", (vl.base,), {})
        monkeypatch.setitem(vl.custom_op.op_registry_oot, "KimiGatedDeltaNetAttention", other)
    before = dict(vl.custom_op.op_registry_oot)
    with caplog.at_level(logging.WARNING):
        assert vl.integ.register() is None                       # never raises
    assert vl.custom_op.op_registry_oot == before
    assert "kdakit vLLM plugin NOT active" in caplog.text
    assert vl.base._forward is vl.original


# ---------------------------------------------------------------------------------------------
# vLLM's kernels, float64, from their semantics (the vLLM side of every comparison)
# ---------------------------------------------------------------------------------------------
class Calls(list):
    pass


def make_vllm_kernels(calls):
    def conv_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                activation="silu", pad_slot_id=-1, null_block_id=0, metadata=None, validate_data=False):
        calls.append("causal_conv1d_fn")
        xt = x.transpose(0, 1)                                   # [T, C]
        out = torch.zeros_like(xt)
        bounds = query_start_loc.tolist()
        for n, slot in enumerate(cache_indices.tolist()):
            if slot == null_block_id:
                continue
            win = conv_states[slot, :, :W - 1].to(F64) if bool(has_initial_state[n]) else \
                torch.zeros(xt.shape[1], W - 1, dtype=F64)
            for t in range(bounds[n], bounds[n + 1]):
                y, win = ref.conv_step(xt[t].to(F64), win, weight.to(F64), activation_dtype=xt.dtype)
                out[t] = y.to(out.dtype)
            if bounds[n + 1] > bounds[n]:
                conv_states[slot, :, :W - 1] = win.to(conv_states.dtype)
        return out.transpose(0, 1)

    def conv_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                    num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, null_block_id=0,
                    validate_data=False, out=None):
        calls.append("causal_conv1d_update" + ("_spec" if num_accepted_tokens is not None else ""))
        if num_accepted_tokens is not None:                      # speculative: recorded, a fixed output
            out.fill_(0.25)
            return out
        for n, slot in enumerate(conv_state_indices.tolist()):
            if slot == null_block_id:
                continue
            win = conv_state[slot, :, :W - 1].to(F64)
            y, win = ref.conv_step(x[n].to(F64), win, weight.to(F64), activation_dtype=x.dtype)
            conv_state[slot, :, :W - 1] = win.to(conv_state.dtype)
            out[n] = y.to(out.dtype)
        return out

    def gather(state, indices, has_initial_state):
        calls.append("gather_initial_states")
        g = state[indices.long()].clone()
        g[~has_initial_state] = 0
        return g

    def chunk_kda_with_fused_gate(q, k, v, raw_g, raw_beta, A_log, g_bias, scale=None, initial_state=None,
                                  output_final_state=False, lower_bound=None, use_qk_l2norm_in_kernel=False,
                                  cu_seqlens=None, out=None, **kwargs):
        calls.append("chunk_kda_with_fused_gate")
        assert scale is None and output_final_state and use_qk_l2norm_in_kernel
        N = cu_seqlens.shape[0] - 1
        pool = initial_state.to(F64).clone()
        o = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=F64)
        ref.recurrent_forward(q, k, v, raw_g, raw_beta, pool, torch.arange(N), o, cu_seqlens=cu_seqlens,
                              A_log=A_log, dt_bias=g_bias, lower_bound=lower_bound, beta_is_logit=True,
                              compute_dtype=F64)
        return o.to(q.dtype), pool.float()

    def packed_decode(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, state_indices,
                      scale=None, out=None):
        calls.append("fused_recurrent_kda_packed_decode")
        B = mixed_qkv.shape[0]
        o = torch.zeros(B, 1, H, D, dtype=F64)
        slots = torch.where(state_indices > 0, state_indices, -1)     # vLLM's kernel skips idx <= 0
        ref.packed_decode(mixed_qkv, raw_g[0].reshape(B, -1), raw_beta[0], A_log, dt_bias, initial_state, slots, o,
                          lower_bound=lower_bound, compute_dtype=F64)
        return o.transpose(0, 1).to(mixed_qkv.dtype), initial_state

    def fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                            ssm_state_indices, num_accepted_tokens=None, out=None, fuse_gate=None):
        calls.append("fused_recurrent_kda")                      # speculative: recorded, a fixed output
        o = torch.full(q.shape[:3] + (v.shape[-1],), 0.5, dtype=q.dtype) if out is None else out.fill_(0.5)
        return o, initial_state

    nk = types.ModuleType(NK)
    nk.chunk_kda_with_fused_gate = chunk_kda_with_fused_gate
    nk.fused_recurrent_kda = fused_recurrent_kda
    nk.fused_recurrent_kda_packed_decode = packed_decode
    return dict(causal_conv1d_fn=conv_fn, causal_conv1d_update=conv_update, gather_initial_states=gather), nk


class GatedNorm(torch.nn.Module):
    """vLLM's o_norm (FusedRMSNormGated, sigmoid, eps 1e-5), float64, on both sides."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x, g):
        o = x.to(F64)
        y = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + 1e-5) * self.weight.to(F64) * torch.sigmoid(g.to(F64))
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# A layer (parameters, page-strided pools) and a batch
# ---------------------------------------------------------------------------------------------
def make_pages(gen, slots, num_spec, conv_dtype, state_dtype):
    """int8 pages [conv | recurrent | pad], viewed per state as vLLM's bind_kv_cache does."""
    L = W - 1 + num_spec
    conv_bytes = L * 3 * P * torch.tensor([], dtype=conv_dtype).element_size()
    rec_bytes = H * D * D * torch.tensor([], dtype=state_dtype).element_size()
    page = conv_bytes + rec_bytes + 64
    pages = torch.zeros(slots, page, dtype=torch.int8)
    conv = pages[:, :conv_bytes].view(conv_dtype).view(slots, L, 3 * P)
    rec = pages[:, conv_bytes:conv_bytes + rec_bytes].view(state_dtype).view(slots, H, D, D)
    conv.copy_(torch.randn(conv.shape, generator=gen))
    rec.copy_(torch.randn(rec.shape, generator=gen) * 0.3)
    return pages, (conv_bytes, rec_bytes, L, conv_dtype, state_dtype)


def bind(pages, layout):
    conv_bytes, rec_bytes, L, conv_dtype, state_dtype = layout
    slots = pages.shape[0]
    return (pages[:, :conv_bytes].view(conv_dtype).view(slots, L, 3 * P),
            pages[:, conv_bytes:conv_bytes + rec_bytes].view(state_dtype).view(slots, H, D, D))


def make_layer(cls, gen, lower_bound, prefix="model.layers.0.self_attn"):
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.prefix = prefix
    layer.local_num_heads, layer.head_dim, layer.local_projection_size, layer.conv_size = H, D, P, W
    layer.conv1d = torch.nn.Module()
    layer.conv1d.weight = torch.nn.Parameter(torch.randn(3 * P, 1, W, generator=gen) * 0.5)
    layer.conv1d.bias = None
    layer.A_log = torch.nn.Parameter(torch.randn(H, generator=gen) * 0.5)
    layer.dt_bias = torch.nn.Parameter(torch.randn(P, generator=gen) * 0.5)
    layer.gate_lower_bound = lower_bound
    layer.o_norm = GatedNorm(torch.rand(D, generator=gen) + 0.5)
    return layer


def copy_params(dst, src):
    for name in ("prefix", "local_num_heads", "head_dim", "local_projection_size", "conv_size", "gate_lower_bound"):
        setattr(dst, name, getattr(src, name))
    dst.conv1d, dst.A_log, dst.dt_bias, dst.o_norm = src.conv1d, src.A_log, src.dt_bias, src.o_norm


def make_inputs(gen, T_pad, dtype):
    proj = torch.randn(T_pad, 3 * P + H + 8, generator=gen).to(dtype)    # q|k|v, beta, more: row-strided
    mixed_qkv, beta = proj[:, :3 * P], proj[:, 3 * P:3 * P + H].unsqueeze(0)
    g1 = torch.randn(1, T_pad, H, D, generator=gen).to(dtype)
    g2 = torch.randn(T_pad, H, D, generator=gen).to(dtype)
    return dict(mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta)


def metadata(vl, *, decode_slots=(), prefills=(), pad_rows=0, T_pad=None, spec=None):
    """decodes first (vLLM reorders them so), then prefills ``(slot, length, has_initial_state)``;
    ``pad_rows`` decode rows of slot 0 (CUDA-graph padding)."""
    i32 = torch.int32
    if spec is not None:
        return spec
    lens = [1] * len(decode_slots) + [n for _, n, _ in prefills]
    slots = list(decode_slots) + [s for s, _, _ in prefills]
    his = [True] * len(decode_slots) + [h for _, _, h in prefills]
    if prefills:
        qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=i32)
        T = int(qsl[-1])
        return vl.gdn.GDNAttentionMetadata(
            num_prefills=len(prefills), num_prefill_tokens=sum(n for _, n, _ in prefills),
            num_decodes=len(decode_slots), num_decode_tokens=len(decode_slots), num_spec_decodes=0,
            num_spec_decode_tokens=0, num_actual_tokens=T, has_initial_state=torch.tensor(his),
            non_spec_query_start_loc=qsl, non_spec_state_indices_tensor=torch.tensor(slots, dtype=i32))
    slots = slots + [0] * pad_rows
    N = len(slots)
    return vl.gdn.GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=N, num_decode_tokens=N, num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=N, has_initial_state=torch.ones(N, dtype=torch.bool),
        non_spec_query_start_loc=torch.arange(N + 1, dtype=i32),
        non_spec_state_indices_tensor=torch.tensor(slots + [0, 0], dtype=i32))   # tables run past the batch


def run_both(vl, monkeypatch, m, *, T_pad, dtype=torch.float32, conv_dtype=None, state_dtype=torch.float32,
             num_spec=0, lower_bound=None, slots=10, seed=0, dim_first=False):
    """vLLM's _forward (float64 kernels) and the plugin's on the same layer and pool copies."""
    gen = torch.Generator().manual_seed(seed)
    conv_dtype = conv_dtype or dtype
    pages, layout = make_pages(gen, slots, num_spec, conv_dtype, state_dtype)
    cls = vl.custom_op.op_registry_oot["KimiGatedDeltaNetAttention"]
    plugin = vl.base.__new__(vl.base)                           # vLLM's __new__: kdakit's class
    assert type(plugin) is cls
    torch.nn.Module.__init__(plugin)
    stock = make_layer(vl.base, gen, lower_bound)
    copy_params(plugin, stock)
    inputs = make_inputs(gen, T_pad, dtype)
    calls = Calls()
    kernels, nk = make_vllm_kernels(calls)
    for name, fn in kernels.items():
        monkeypatch.setattr(vl.kg, name, fn)
    monkeypatch.setitem(sys.modules, NK, nk)
    ctx = types.SimpleNamespace(attn_metadata={stock.prefix: m})
    monkeypatch.setattr(vl.kg, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(vl.kg, "is_conv_state_dim_first", lambda: dim_first)
    results = {}
    for name, layer in (("vllm", stock), ("kdakit", plugin)):
        p = pages.clone()
        conv, rec = bind(p, layout)
        layer.kv_cache = (conv.transpose(-1, -2) if dim_first else conv, rec)
        out = torch.full((1, T_pad, H, D), float("nan"), dtype=dtype)
        before = len(calls)
        with torch.no_grad():
            if name == "vllm":
                vl.original(layer, core_attn_out=out, **inputs)
            else:
                layer._forward(core_attn_out=out, **inputs)
        results[name] = dict(out=out, conv=conv.clone(), rec=rec.clone(), calls=list(calls[before:]))
    return results


def assert_same(res, T, *, atol=2e-4, skip_slot0=False):
    a, b = res["vllm"], res["kdakit"]
    torch.testing.assert_close(b["out"][:, :T].double(), a["out"][:, :T].double(), atol=atol, rtol=atol)
    s = 1 if skip_slot0 else 0
    torch.testing.assert_close(b["conv"][s:].double(), a["conv"][s:].double(), atol=atol, rtol=0)
    torch.testing.assert_close(b["rec"][s:].double(), a["rec"][s:].double(), atol=atol, rtol=atol)


# ---------------------------------------------------------------------------------------------
# _forward, batch by batch
# ---------------------------------------------------------------------------------------------
@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("lower_bound", [None, LOWER_BOUND])
def test_pure_decode_with_graph_padding(vl, monkeypatch, backend, lower_bound):
    m = metadata(vl, decode_slots=(5, 2, 7), pad_rows=2)
    res = run_both(vl, monkeypatch, m, T_pad=5, lower_bound=lower_bound)
    assert "fused_recurrent_kda_packed_decode" in res["vllm"]["calls"] and res["kdakit"]["calls"] == []
    assert_same(res, 5)                                         # slot 0 (the null block) included
    assert torch.isfinite(res["kdakit"]["out"]).all()


def test_decode_bf16_activations_fp32_conv_weights_spec_sized_pool(vl, monkeypatch):
    """bf16 activations beside fp32 conv weights, a conv pool sized for speculation (L = W-1+2,
    its extra columns left alone) in the DS layout, a bf16 recurrent pool."""
    m = metadata(vl, decode_slots=(3, 1), pad_rows=1)
    res = run_both(vl, monkeypatch, m, T_pad=3, dtype=torch.bfloat16, state_dtype=torch.bfloat16, num_spec=2,
                   dim_first=True)
    assert res["kdakit"]["calls"] == []
    assert_same(res, 3, atol=3e-2)


@pytest.mark.parametrize("backend_name, lower_bound", [
    ("reference", None), ("reference", LOWER_BOUND), ("triton", None),
    pytest.param("triton", LOWER_BOUND, marks=pytest.mark.exhaustive)])   # ~20 s each in the interpreter
def test_mixed_prefill_and_decode(vl, monkeypatch, backend_name, lower_bound):
    monkeypatch.setenv("KDAKIT_BACKEND", backend_name)
    # two decodes, a continued prefill, a first prefill (no initial state), token padding past them
    m = metadata(vl, decode_slots=(4, 9), prefills=((2, 5, True), (6, 3, False)))
    res = run_both(vl, monkeypatch, m, T_pad=12, lower_bound=lower_bound, num_spec=0)
    assert "chunk_kda_with_fused_gate" in res["vllm"]["calls"] and res["kdakit"]["calls"] == []
    assert_same(res, 10)


def test_prefill_with_spec_sized_conv_pool(vl, monkeypatch):
    m = metadata(vl, prefills=((3, 6, True), (8, 2, True)))
    res = run_both(vl, monkeypatch, m, T_pad=8, num_spec=3)
    assert res["kdakit"]["calls"] == []
    assert_same(res, 8)


def spec_metadata(vl, mixed):
    i32 = torch.int32
    # num_spec 2: 3 tokens per verified request
    acc = torch.tensor([1, 3], dtype=i32)
    spec_idx = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=i32)
    if not mixed:
        return vl.gdn.GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=2,
            num_spec_decode_tokens=6, num_actual_tokens=6, spec_query_start_loc=torch.tensor([0, 3, 6], dtype=i32),
            spec_state_indices_tensor=spec_idx, spec_sequence_masks=torch.ones(2, dtype=torch.bool),
            num_accepted_tokens=acc)
    return vl.gdn.GDNAttentionMetadata(
        num_prefills=1, num_prefill_tokens=4, num_decodes=0, num_decode_tokens=0, num_spec_decodes=2,
        num_spec_decode_tokens=6, num_actual_tokens=10, has_initial_state=torch.tensor([True]),
        spec_query_start_loc=torch.tensor([0, 3, 6], dtype=i32), spec_state_indices_tensor=spec_idx,
        spec_sequence_masks=torch.tensor([True, True, False]), non_spec_query_start_loc=torch.tensor([0, 4], dtype=i32),
        non_spec_state_indices_tensor=torch.tensor([8], dtype=i32),
        spec_token_indx=torch.arange(6), non_spec_token_indx=torch.arange(6, 10),
        num_accepted_tokens=acc)


@pytest.mark.parametrize("mixed", [False, True])
def test_speculative_batches_run_vllms_kernels(vl, monkeypatch, mixed):
    m = spec_metadata(vl, mixed)
    res = run_both(vl, monkeypatch, m, T_pad=m.num_actual_tokens, num_spec=2)
    assert "fused_recurrent_kda" in res["kdakit"]["calls"] and "causal_conv1d_update_spec" in res["kdakit"]["calls"]
    assert res["kdakit"]["calls"] == res["vllm"]["calls"]
    assert_same(res, m.num_actual_tokens, atol=0)


def test_no_metadata_for_the_layer_returns_like_vllm(vl, monkeypatch):
    cls = vl.custom_op.op_registry_oot["KimiGatedDeltaNetAttention"]
    layer = vl.base.__new__(vl.base)
    torch.nn.Module.__init__(layer)
    layer.prefix = "x"
    monkeypatch.setitem(sys.modules, NK, make_vllm_kernels(Calls())[1])
    for md in (None, {"other": object()}):
        ctx = types.SimpleNamespace(attn_metadata=md)
        monkeypatch.setattr(vl.kg, "get_forward_context", lambda: ctx)
        out = torch.zeros(1, 2, H, D)
        assert type(layer) is cls and layer._forward(torch.zeros(2, 3 * P), torch.zeros(1, 2, H, D),
                                                     torch.zeros(2, H, D), torch.zeros(1, 2, H), out) is None
        assert (out == 0).all()


def test_outside_what_kdakit_checked_falls_back(vl, monkeypatch, caplog):
    """A float16 conv pool beside bf16 activations (vLLM rounds the inputs to the pool's dtype
    first): vLLM's kernels for that call, and a warning."""
    m = metadata(vl, decode_slots=(5, 2))
    with caplog.at_level(logging.WARNING):
        res = run_both(vl, monkeypatch, m, T_pad=2, dtype=torch.bfloat16, conv_dtype=torch.float16)
    assert res["kdakit"]["calls"] == res["vllm"]["calls"] and res["kdakit"]["calls"]
    assert "conv pool with torch.bfloat16 activations; this call runs vLLM's own KDA kernels" in caplog.text


# ---------------------------------------------------------------------------------------------
# Deliberate plugin bugs are caught
# ---------------------------------------------------------------------------------------------
def test_unmapped_padding_slot_is_caught(vl, monkeypatch):
    monkeypatch.setattr(vl.integ, "_null_to_padding", lambda idx: idx)
    m = metadata(vl, decode_slots=(5, 2), pad_rows=2)
    res = run_both(vl, monkeypatch, m, T_pad=4)
    with pytest.raises(AssertionError):
        assert_same(res, 4)


def test_wrong_conv_window_columns_are_caught(vl, monkeypatch):
    """With a speculation-sized conv pool, the window is the first W-1 columns: the last ones are wrong."""
    real = vl.integ.conv_window
    monkeypatch.setattr(vl.integ, "conv_window", lambda conv_state, w: real(conv_state, w + 2)[..., 2:])
    m = metadata(vl, decode_slots=(5, 2))
    res = run_both(vl, monkeypatch, m, T_pad=2, num_spec=2)
    with pytest.raises(AssertionError):
        assert_same(res, 2)


# ---------------------------------------------------------------------------------------------
# benchmarks/gpu_vllm_plugin_check.py on the CPU: its PeerLayer against vLLM's own _forward, its
# checks catching plugin bugs, its --build-peer layout and --cpu-interpret run
# ---------------------------------------------------------------------------------------------
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def script(vl, monkeypatch):
    sys.path.insert(0, BENCH)
    try:
        import gpu_vllm_plugin_check as s
    finally:
        sys.path.remove(BENCH)
    for name, value in (("H", H), ("D", D), ("DEVICE", "cpu"), ("STATE_BYTES", H * D * D * 4)):
        monkeypatch.setattr(s, name, value)
    assert s.W == W
    return s


def _recording(log, name, fn):
    """``fn``, logging its name and arguments (tensors as shape, strides, dtype and a copy of the
    values; vLLM's metadata object as a marker) at each call."""
    def norm(x, values=True):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.detach().clone() if values else None)
        if hasattr(x, "num_actual_tokens"):
            return ("metadata",)
        return x

    def call(*args, **kwargs):
        if isinstance(kwargs.get("out"), torch.Tensor):
            kwargs["out"].fill_(0)        # torch.empty on both sides: rows a kernel skips, made alike
        log.append((name, [norm(a) for a in args],        # ``out`` buffers: torch.empty, their values not compared
                    {k: norm(v, k != "out") for k, v in sorted(kwargs.items())}))
        return fn(*args, **kwargs)
    return call


def _same(a, b):
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return isinstance(b, tuple) and a[:4] == b[:4] and (
            a[4] is b[4] is None or (a[4] is not None and b[4] is not None and torch.equal(a[4], b[4])))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_gpu_check_script_peer_layer_is_vllms_forward(vl, script, monkeypatch):
    """The script's PeerLayer._forward against vLLM 0.33.0's own KimiGatedDeltaNetAttention._forward
    (the installed one), both on the same recording float64 kernels, for every batch kind of the
    script's CPU run: the same kernel calls in the same order with the same arguments (shapes,
    strides, dtypes, values), and the same outputs and pools, bitwise."""
    log = []
    kernels, nk = make_vllm_kernels(Calls())
    kernels.update(chunk_kda_with_fused_gate=nk.chunk_kda_with_fused_gate, fused_recurrent_kda=nk.fused_recurrent_kda,
                   fused_recurrent_kda_packed_decode=nk.fused_recurrent_kda_packed_decode)
    rec = {name: _recording(log, name, fn) for name, fn in kernels.items()}
    for name in ("causal_conv1d_fn", "causal_conv1d_update", "gather_initial_states"):
        monkeypatch.setattr(vl.kg, name, rec[name])
    nk_rec = types.ModuleType(NK)
    for name in ("chunk_kda_with_fused_gate", "fused_recurrent_kda", "fused_recurrent_kda_packed_decode"):
        setattr(nk_rec, name, rec[name])
    monkeypatch.setitem(sys.modules, NK, nk_rec)
    monkeypatch.setattr(vl.kg, "get_forward_context", lambda: script.FORWARD_CONTEXT)
    monkeypatch.setattr(vl.kg, "is_conv_state_dim_first", lambda: False)
    peer = script.make_peer_class(rec)
    stock = type("Stock", (peer,), {"_forward": vl.original})       # vLLM's own _forward, on the same layer
    for lower_bound in (None, LOWER_BOUND):
        params = script.make_params(0, lower_bound)
        for case in script.check_cases(True, cpu=True):
            pages = script.make_pages(1, case.slots, case.num_spec)
            inputs = script.make_inputs(2, case.T_pad)
            runs = {}
            for name, cls in (("vllm", stock), ("peer", peer)):
                start = len(log)
                runs[name] = script.run_side(cls, params, case, pages, inputs, vl.gdn.GDNAttentionMetadata)
                runs[name]["log"] = log[start:]
            a, b = runs["vllm"], runs["peer"]
            assert [c[0] for c in a["log"]] == [c[0] for c in b["log"]] and a["log"], case.name
            for ca, cb in zip(a["log"], b["log"]):
                assert _same(ca, cb), (case.name, ca[0])
            for key in ("out", "pre_norm", "conv", "rec"):
                assert torch.equal(a[key].nan_to_num(7.0), b[key].nan_to_num(7.0)), (case.name, key)


@pytest.mark.parametrize("bug", ["padding slot 0 not mapped", "wrong conv window columns", "none"])
def test_gpu_check_script_catches_plugin_bugs(vl, script, monkeypatch, bug):
    """The script's comparison fails on deliberate plugin bugs (float64 kernels for vLLM's side,
    kdakit's reference backend for speed)."""
    monkeypatch.setenv("KDAKIT_BACKEND", "reference")
    kernels, nk = make_vllm_kernels(Calls())
    kernels.update(chunk_kda_with_fused_gate=nk.chunk_kda_with_fused_gate, fused_recurrent_kda=nk.fused_recurrent_kda,
                   fused_recurrent_kda_packed_decode=nk.fused_recurrent_kda_packed_decode)
    if bug == "padding slot 0 not mapped":
        monkeypatch.setattr(vl.integ, "_null_to_padding", lambda idx: idx)
    elif bug == "wrong conv window columns":
        real = vl.integ.conv_window
        monkeypatch.setattr(vl.integ, "conv_window", lambda conv_state, w: real(conv_state, w + 2)[..., 2:])
    peer_cls, ours_cls = script.make_layer_classes(kernels)
    results = {"checks": []}
    case = script.decode_case(3, 2, 1, num_spec=script.NUM_SPEC)      # padding rows, a spec-sized conv pool
    ok = script.compare(case, peer_cls, ours_cls, script.make_params(0), results)
    assert ok is (bug == "none"), results["checks"]


def _peer_from_installed_vllm(script, tmp_path):
    """The script's --build-peer layout from the installed vLLM's files (zipped as the wheel holds them)."""
    import zipfile
    import vllm
    site = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
    wheel = tmp_path / "vllm-0.33.0-kernels.zip"
    with zipfile.ZipFile(wheel, "w") as zf:
        for entry in script.PEER_FILES:
            path = os.path.join(site, entry)
            files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f.endswith(".py")] \
                if entry.endswith("/") else [path]
            for f in files:
                zf.write(f, os.path.relpath(f, site))
    return script.build_peer(str(tmp_path / "peer"), str(wheel))


@pytest.mark.parametrize("quick", [True, pytest.param(False, marks=pytest.mark.exhaustive)])
def test_gpu_check_script_cpu_interpret(vl, script, tmp_path, quick):
    """--build-peer's stand-in package from vLLM's own kernel files, then --cpu-interpret in a fresh
    process (the stand-in package first on the path): every batch kind checked, none failing."""
    import subprocess
    peer = _peer_from_installed_vllm(script, tmp_path)
    assert not os.path.exists(os.path.join(peer, "vllm", "models", "kimi_k3", "nvidia", "model.py"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([peer, os.path.dirname(BENCH)]), "TRITON_INTERPRET": "1",
           "KDAKIT_BACKEND": "triton"}
    run = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_vllm_plugin_check.py"), "--cpu-interpret"]
                         + (["--quick"] if quick else []), env=env, capture_output=True, text=True, timeout=600,
                         cwd=str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "kernels from the wheel's kernel files under kdakit's stand-in package" in run.stdout, run.stdout
    for case in ("decode N=3+2 pad", "decode N=2+1 pad spec-sized pool (L=6)", "prefill 2 seqs (first + continued)",
                 "mixed prefill + decode", "spec-only accepted 1..4 +1 pad", "mixed spec + prefill"):
        assert run.stdout.count(f"ok   {case}:") == (1 if quick else 2), run.stdout
    assert "FAIL" not in run.stdout
