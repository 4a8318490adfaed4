"""kdakit.integrations.transformers: transformers 5.17-5.23's Kimi Linear on kdakit's kernels.
The reference is transformers' own PyTorch implementation of the four functions
(``torch_fallback()``: its fallback loops, whatever it bound at import), never kdakit."""
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
kt = pytest.importorskip("kdakit.integrations.transformers")
from kdakit.layer import KDALayer  # noqa: E402

kl = kt.kimi_linear_module()


@pytest.fixture(autouse=True)
def restore():
    saved = {name: getattr(kl, name) for name in kt.REPLACED}
    yield
    kt.disable()
    for name, fn in saved.items():
        setattr(kl, name, fn)


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", request.param)
    return request.param


def left_padded(prompts, pad=0):
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for n, p in enumerate(prompts):
        ids[n, T - len(p):] = torch.tensor(p)
        mask[n, T - len(p):] = 1
    return ids, mask


def generate(model, prompts, new_tokens):
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:].tolist(), torch.stack(out.logits, 1).float()


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_enable_disable_rebinds_and_restores():
    before = {name: getattr(kl, name) for name in kt.REPLACED}
    kt.enable()
    kt.enable()  # twice: still one saved set of originals
    assert kt.is_enabled()
    for name in kt.REPLACED:
        assert getattr(kl, name) is getattr(kt, name)
        assert kt.original(name) is before[name]
    kt.disable()
    assert not kt.is_enabled()
    assert {name: getattr(kl, name) for name in kt.REPLACED} == before
    with kt.enabled():
        assert kl.causal_conv1d_fn is kt.causal_conv1d_fn
    assert kl.causal_conv1d_fn is before["causal_conv1d_fn"]


# Stand-ins for KimiLinearDeltaAttention.forward, one per way of reading the cache (never run:
# the integration only reads which names a forward's code uses).
def forward_layers_form(self, hidden_states, cache_params=None, **kwargs):  # transformers 5.17-5.20
    if cache_params is not None and cache_params.has_previous_state(self.layer_idx):
        conv_state = cache_params.layers[self.layer_idx].conv_states[0]
        state = cache_params.layers[self.layer_idx].recurrent_states[0]
        causal_conv1d_update(hidden_states, conv_state)  # noqa: F821
        return recurrent_kimi_delta_attention(hidden_states, state)  # noqa: F821
    cache_params.update_conv_state(hidden_states, self.layer_idx)
    causal_conv1d_fn(hidden_states)  # noqa: F821
    cache_params.update_recurrent_state(chunk_kimi_delta_attention(hidden_states), self.layer_idx)  # noqa: F821


def forward_accessors_form(self, hidden_states, cache_params=None, **kwargs):  # transformers 5.21-5.23
    conv_state = cache_params.get_conv_state(self.layer_idx, state_idx=0)
    state = cache_params.get_recurrent_state(self.layer_idx, state_idx=0)
    if conv_state is not None:
        causal_conv1d_update(hidden_states, conv_state)  # noqa: F821
        return recurrent_kimi_delta_attention(hidden_states, state)  # noqa: F821
    cache_params.update_conv_state(hidden_states, self.layer_idx)
    causal_conv1d_fn(hidden_states)  # noqa: F821
    cache_params.update_recurrent_state(chunk_kimi_delta_attention(hidden_states), self.layer_idx)  # noqa: F821


def forward_unknown_form(self, hidden_states, cache_params=None, **kwargs):  # a cache read some other way
    state = cache_params.ssm_states[self.layer_idx]
    causal_conv1d_update(hidden_states, state)  # noqa: F821
    recurrent_kimi_delta_attention(hidden_states, state)  # noqa: F821
    cache_params.update_conv_state(hidden_states, self.layer_idx)
    causal_conv1d_fn(hidden_states)  # noqa: F821
    cache_params.update_recurrent_state(chunk_kimi_delta_attention(hidden_states), self.layer_idx)  # noqa: F821


def forward_no_state_write(self, hidden_states, cache_params=None, **kwargs):  # the state never copied back
    conv_state = cache_params.get_conv_state(self.layer_idx, state_idx=0)
    state = cache_params.get_recurrent_state(self.layer_idx, state_idx=0)
    causal_conv1d_update(hidden_states, conv_state)  # noqa: F821
    recurrent_kimi_delta_attention(hidden_states, state)  # noqa: F821
    cache_params.update_conv_state(hidden_states, self.layer_idx)
    causal_conv1d_fn(hidden_states)  # noqa: F821
    chunk_kimi_delta_attention(hidden_states)  # noqa: F821


def installed_release():
    return tuple(int(x) for x in transformers.__version__.split(".")[:2])


def test_installed_release_form():
    """The form read from each release's wheel: 5.17-5.20 read cache.layers[i] after
    has_previous_state, 5.21 on call get_conv_state / get_recurrent_state."""
    expected = "accessors" if installed_release() >= (5, 21) else "layers"
    assert kt.layer_form(kl) == expected
    assert kt.TESTED[0] <= installed_release() <= kt.TESTED[1]


@pytest.mark.parametrize("form", ["layers", "accessors"])
def test_each_known_form_is_accepted(form, monkeypatch):
    forward = {"layers": forward_layers_form, "accessors": forward_accessors_form}[form]
    monkeypatch.setattr(kl.KimiLinearDeltaAttention, "forward", forward)
    assert kt.layer_form(kl) == form
    kt.enable()
    assert kt.is_enabled() and kl.chunk_kimi_delta_attention is kt.chunk_kimi_delta_attention


@pytest.mark.parametrize("forward, missing", [
    (forward_unknown_form, ["has_previous_state", "conv_states", "get_conv_state", "get_recurrent_state"]),
    (forward_no_state_write, ["update_recurrent_state"]),
])
def test_unknown_forms_refused(forward, missing, monkeypatch):
    monkeypatch.setattr(kl.KimiLinearDeltaAttention, "forward", forward)
    with pytest.raises(kt.IntegrationError) as err:
        kt.enable()
    for name in missing:
        assert name in str(err.value)
    assert not kt.is_enabled()


def test_refuses_what_it_cannot_patch(monkeypatch):
    monkeypatch.delattr(kl, "recurrent_kimi_delta_attention")
    with pytest.raises(kt.IntegrationError, match="recurrent_kimi_delta_attention"):
        kt.enable()
    assert not kt.is_enabled()
    monkeypatch.undo()

    def no_decode_kernel(self, hidden_states, cache_params=None, **kwargs):
        cache_params.get_conv_state(0), cache_params.get_recurrent_state(0)
        cache_params.update_conv_state(hidden_states, 0), cache_params.update_recurrent_state(hidden_states, 0)
        causal_conv1d_fn(hidden_states), chunk_kimi_delta_attention(hidden_states)  # noqa: F821
    monkeypatch.setattr(kl.KimiLinearDeltaAttention, "forward", no_decode_kernel)
    with pytest.raises(kt.IntegrationError, match="recurrent_kimi_delta_attention, causal_conv1d_update"):
        kt.enable()
    assert not kt.is_enabled()
    with pytest.raises(ValueError, match="replaced names"):
        kt.original("l2norm")


def test_refuses_a_kernel_call_it_does_not_take(monkeypatch):
    """transformers' body of a name gains a parameter (so its forward may pass it): refused at
    enable(), naming it, rather than a ValueError mid-generate."""
    import functools
    body = kt.torch_functions()["chunk_kimi_delta_attention"]

    def newer(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        return body(query, key, value, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel)

    @functools.wraps(newer)
    def bound(*args, **kwargs):
        return newer(*args, **kwargs)
    monkeypatch.setattr(kl, "chunk_kimi_delta_attention", bound)
    with pytest.raises(kt.IntegrationError, match="cu_seqlens"):
        kt.enable()
    assert not kt.is_enabled()


def test_version_outside_the_tested_range_warns(monkeypatch):
    """No version gate: a release outside TESTED whose layer has a known form is plugged into
    with a RuntimeWarning (none with allow_untested_version=True); inside the range, silently."""
    for version in ("5.24.0", "5.16.1", "6.0.0.dev0"):
        monkeypatch.setattr(kt, "_transformers_version", lambda v=version: v)
        with pytest.warns(RuntimeWarning, match=version.replace(".", r"\.")):
            kt.enable()
        assert kt.is_enabled()
        kt.disable()
    for version, allow in (("5.24.0", True), ("5.17.0", False), ("5.20.2", False), ("5.23.0", False)):
        monkeypatch.setattr(kt, "_transformers_version", lambda v=version: v)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            kt.enable(allow_untested_version=allow)
        kt.disable()


def test_generate_float32_left_padded_matches_transformers():
    """Prompts of 70 and 75 tokens (more than one 64-token chunk) and a short one, left padded
    in one batch: same tokens as transformers' own implementation, logits within float32
    rounding; each padded row gives its unpadded prompt's tokens."""
    model = kt.tiny_model(seed=0)
    prompts = prompts_of([70, 75, 9])
    with kt.torch_fallback():
        ref_tokens, ref_logits = generate(model, prompts, 6)
    kt.enable()
    tokens, logits = generate(model, prompts, 6)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
    alone, _ = generate(model, prompts[2:], 6)
    assert alone[0] == tokens[2]


def test_generate_bf16_against_float32_transformers():
    """A bf16 model on kdakit against the same weights in float32 on transformers' PyTorch
    bodies (the function at higher precision; transformers' own bf16 path rounds its conv in
    bf16 and strays further: up to ~1 logit here on the 66-token row). Tokens agree up to the
    first step whose reference top-2 margin is within bf16 noise; logits up to there."""
    prompts = prompts_of([66, 12], seed=2)
    with kt.torch_fallback():
        ref_tokens, ref_logits = generate(kt.tiny_model(seed=1), prompts, 5)
    with kt.enabled():
        tokens, logits = generate(kt.tiny_model(seed=1, dtype=torch.bfloat16), prompts, 5)
    checked = 0
    for n in range(len(prompts)):
        for t in range(5):
            torch.testing.assert_close(logits[n, t], ref_logits[n, t], atol=0.15, rtol=0.05)
            top2 = ref_logits[n, t].topk(2).values
            if float(top2[0] - top2[1]) < 0.15:
                break  # a near-tie: the continuations may differ from here
            assert tokens[n][t] == ref_tokens[n][t], f"row {n}, step {t}"
            checked += 1
    assert checked >= 4, "too few decisive steps to mean anything"


def test_triton_interpreter_tiny(monkeypatch):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    # One KDA layer (and the MLA + MoE layer after it): the interpreter runs every program in Python.
    model = kt.tiny_model(seed=2, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                          mlp_layer_types=["dense", "sparse"])
    prompts = prompts_of([5], seed=3)
    with kt.torch_fallback():
        ref_tokens, ref_logits = generate(model, prompts, 2)
    with kt.enabled():
        tokens, logits = generate(model, prompts, 2)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)


def test_enable_does_not_depend_on_what_transformers_bound():
    """Whatever transformers bound (here: functions that fail, like fla's Triton kernels on a
    machine without a GPU), enable() replaces it."""
    def broken(*args, **kwargs):
        raise RuntimeError("0 active drivers ([]). There should only be one.")
    model = kt.tiny_model(seed=0)
    prompts = prompts_of([10])
    with kt.torch_fallback():
        ref_tokens, _ = generate(model, prompts, 3)
    for name in kt.REPLACED:
        setattr(kl, name, broken)
    with pytest.raises(RuntimeError, match="active drivers"):
        generate(model, prompts, 1)
    kt.enable()
    assert generate(model, prompts, 3)[0] == ref_tokens


SUBPROCESS = r"""
import sys, torch
if sys.argv[1] == "hide-fla":
    sys.modules["fla"] = None  # import fla -> ImportError: transformers binds its PyTorch bodies
import fla_probe
"""


@pytest.mark.parametrize("fla", ["hide-fla", "fla-if-installed"])
def test_with_and_without_fla_importable(fla, tmp_path):
    """A fresh interpreter: transformers binds fla's kernels when fla imports (fla-core 0.6.0 is
    in the test extra), its PyTorch bodies when it does not; enable() runs the model either way
    and gives the PyTorch bodies' tokens."""
    (tmp_path / "fla_probe.py").write_text(r'''
import importlib.util, inspect, torch
from kdakit.integrations import transformers as kt
kl = kt.kimi_linear_module()
bound = kl.chunk_kimi_delta_attention
torch_body = inspect.unwrap(bound)
print("fla-bound" if bound is not torch_body and importlib.util.find_spec("fla") and
      "fla" in str(getattr(bound, "__closure__", "")) else "torch-bound")
model = kt.tiny_model(seed=0)
ids = torch.tensor([[5, 9, 17, 33, 65, 129, 3]])
with kt.torch_fallback(), torch.no_grad():
    ref = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
kt.enable()
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
print("match" if torch.equal(out, ref) else "mismatch")
''')
    env_path = f"{tmp_path}:{':'.join(sys.path)}"
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS, fla], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "KDAKIT_BACKEND": "reference"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines[-1] == "match"
    if fla == "hide-fla":
        assert lines[-2] == "torch-bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_transformers_matches_the_layer(dtype):
    """KDALayer.from_transformers on a StatePool: a 70-token prefill (chunked) and 3 decode
    steps give the transformers layer's outputs (its PyTorch bodies, its DynamicCache)."""
    from transformers import DynamicCache
    from kdakit.state_pool import StatePool
    model = kt.tiny_model(seed=4, dtype=dtype)
    attn = model.model.layers[0].self_attn
    layer = KDALayer.from_transformers(attn)
    assert layer.q_proj.weight.dtype == dtype and layer.conv_weight.dtype == torch.float32
    pool = StatePool(1, 2, num_heads=layer.H, head_k_dim=layer.K, head_v_dim=layer.V, conv_width=layer.conv_width,
                     act_dtype=dtype)
    layer.attach(pool, 0)
    slot = pool.alloc()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 73, model.config.hidden_size, generator=g).to(dtype)
    cache = DynamicCache(config=model.config)
    with kt.torch_fallback(), torch.no_grad():
        ref_prefill = attn(x[:, :70], cache_params=cache)
        ref_steps = [attn(x[:, t:t + 1], cache_params=cache) for t in range(70, 73)]
    with torch.no_grad():
        ours_prefill = layer.prefill(x[0, :70], slot)
        ours_steps = [layer.decode(x[:, t], [slot]) for t in range(70, 73)]
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours_prefill.float(), ref_prefill[0].float(), **tol)
    for ours, ref in zip(ours_steps, ref_steps):
        torch.testing.assert_close(ours.float(), ref[:, 0].float(), **tol)
    # The recurrent state agrees too (kdakit's pool is V-major, transformers' K-major).
    torch.testing.assert_close(pool.state[0, slot].transpose(-1, -2), cache.layers[0].recurrent_states[0][0],
                               **(dict(atol=1e-4, rtol=1e-3) if dtype == torch.float32 else tol))


def test_from_transformers_refuses_other_modules():
    with pytest.raises(ValueError, match="KimiLinearDeltaAttention"):
        KDALayer.from_transformers(torch.nn.Linear(4, 4))


def test_packed_sequences_refused():
    kt.enable()
    x = torch.randn(1, 8, 5)
    with pytest.raises(ValueError, match="packed sequences"):
        kl.causal_conv1d_fn(x, torch.randn(8, 4), activation="silu", seq_idx=torch.zeros(1, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="activation"):
        kl.causal_conv1d_fn(x, torch.randn(8, 4), activation="gelu")


def test_the_extra_asks_for_the_tested_range():
    """pyproject's `transformers` extra is kt.REQUIREMENT, the range TESTED names."""
    tomllib = pytest.importorskip("tomllib")
    import pathlib
    pyproject = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["transformers"] == [kt.REQUIREMENT]
    (a, b), (c, d) = kt.TESTED
    assert kt.REQUIREMENT == f"transformers>={a}.{b},<{c}.{d + 1}"
