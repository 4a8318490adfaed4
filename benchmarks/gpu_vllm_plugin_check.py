"""kdakit's vLLM plugin layer against vLLM 0.33.0's own KDA ``_forward`` with vLLM's own kernels,
per batch kind: outputs and every pool slot compared, then both timed.

    # once, on a machine with PyPI (writes ./.vllm-peer, git-ignored, never committed):
    python benchmarks/gpu_vllm_plugin_check.py --build-peer
    # on the GPU machine, with .vllm-peer carried there (or with vLLM 0.33.0 installed):
    PYTHONPATH=.vllm-peer:. python benchmarks/gpu_vllm_plugin_check.py [--quick] [--name vllm_plugin_h100]
    # on a CPU: the same checks at tiny sizes through Triton's interpreter (CI runs this)
    TRITON_INTERPRET=1 PYTHONPATH=.vllm-peer:. python benchmarks/gpu_vllm_plugin_check.py --cpu-interpret

The vLLM side. vLLM's layer module (``vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py``,
KG below) imports vLLM's config, distributed state, forward context, custom-op registry, linear
layers, model loader and transformers configs (KG:12-40): far more than the GPU machine (no vLLM,
no network) has, and more than a stand-in package should fake. So the script does not import it:
``PeerLayer._forward`` re-implements KG:379-646 call for call (the same kernel functions, the same
arguments and views, in the same order; each step names its KG line), on the wheel's own kernel
functions imported by their vLLM module paths: from an installed vLLM 0.33.0, or from
``.vllm-peer``, the wheel's kernel files (``vllm/models/kimi_k3/nvidia/ops/third_party/kda``, the
mamba ``causal_conv1d.py`` and ``gather_initial_states.py``, the few vendored fla files they import)
under a minimal stand-in ``vllm`` package written by ``--build-peer``. What the peer leaves out of
KG's ``_forward``: the ROCm branch of the kernel import (KG:404-409) and the isinstance assert on
the metadata (KG:422; the peer's metadata is a dataclass with GDNAttentionMetadata's field names).
tests/test_integration_vllm.py runs ``PeerLayer._forward`` beside vLLM's own ``_forward`` (when
vLLM 0.33.0 is installed) on recording kernels and checks the same calls with the same arguments.

kdakit's side is ``kdakit.integrations.vllm.make_layer_class(PeerLayer, PEER_MODULE)``: the very
subclass the plugin registers in vLLM, here on top of the peer, so its fallbacks
(``super()._forward``; every speculative batch, which the plugin leaves on vLLM's kernels) run the
peer's ``_forward`` with vLLM's kernels.

Batch kinds (GPU: H = 32 heads per rank, K = V = 128, W = 4, bf16 activations, bf16 conv pool,
fp32 conv weights, float32 recurrent pool, page-strided pools as vLLM binds them, 3 drafted
tokens): pure decode with CUDA-graph padding rows (slot 0, vLLM's null block), the same on a
speculation-sized conv pool, prefill (first chunks and continued ones), mixed prefill + decode
with token padding, spec-only with padded rows and num_accepted 1..4, mixed spec + prefill.
Each side gets its own fresh copy of the inputs and pools. Compared: ``core_attn_out`` before and
after the output norm (the norm module is the same float32 gated RMSNorm on both sides), the conv
and recurrent pools on every slot the batch owns (relative error, tolerance 2e-2), every other
slot bitwise unchanged. Timings only when every check passes: decode N = 1, 8, 64, 512 and verify
(3 drafted tokens) N = 1, 8, 64, 256 from CUDA-graph replays (vLLM captures those in FULL
graphs), prefill 1 x 8192 and 8 x 2048 eagerly (CUDA events; vLLM never captures prefill), each
over enough independent layers to stream the state from HBM; the output norm is a pass-through
while timing (the same on both sides). JSON (GPU, date, command, copy ceiling, checks, rows) to
$OUT or benchmarks/results.

``--cpu-interpret``: the same checks at H = 2, K = V = 16 on CPU tensors, kdakit's kernels in
Triton's interpreter. vLLM's kernels mostly do not run there: ``gather_initial_states`` asserts a
CUDA tensor (gather_initial_states.py:55), and of the Triton ones only the decode form of
``causal_conv1d_update`` ran in Triton 3.6's interpreter, none in 3.9's (2026-12). The script
tries each kernel form once on copies of its arguments and, where it raises, runs the float64
version of tests/test_integration_vllm.py instead, printing which ran what: on the CPU the run
checks the script's own logic (batches, metadata, pools, comparisons) and kdakit's side against
float64, not vLLM's kernels.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import zipfile
import zlib

import torch

H, D, W = 32, 128, 4
NUM_SPEC = 3                       # drafted tokens: verify runs NUM_SPEC + 1 tokens a request
DEVICE = "cuda"
ACT = torch.bfloat16
TOL = 2e-2
VLLM_VERSION = "0.33.0"
PEER_DIR = ".vllm-peer"
PREFIX = "model.layers.0.self_attn"
NK = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
FLA = "vllm/third_party/flash_linear_attention/ops/"
# The wheel's files the peer needs (a folder ends with "/"): the KDA kernels, the two mamba ops,
# the vendored fla files the KDA chunk kernel imports, and vLLM's pure-Python math helpers.
PEER_FILES = ("vllm/models/kimi_k3/nvidia/ops/third_party/kda/",
              "vllm/model_executor/layers/mamba/ops/causal_conv1d.py",
              "vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
              FLA + "chunk_delta_h.py", FLA + "cumsum.py", FLA + "index.py", FLA + "l2norm.py", FLA + "op.py",
              FLA + "utils.py", "vllm/utils/math_utils.py")

_PLATFORM = '''"""Stand-in for vllm.platforms (kdakit's gpu_vllm_plugin_check.py): a CUDA platform, as far as
the wheel's KDA and conv kernel files ask."""
import torch


class _CudaPlatform:
    def is_cuda(self):
        return torch.version.hip is None

    def is_cuda_alike(self):
        return True

    def is_rocm(self):
        return torch.version.hip is not None

    def is_cpu(self):  # False even under TRITON_INTERPRET=1: the Triton kernels, not vLLM's CPU ops
        return False

    def is_xpu(self):
        return False

    def _capability(self, device_id=None):
        if not torch.cuda.is_available():
            return (0, 0)
        return torch.cuda.get_device_capability(torch.cuda.current_device() if device_id is None else device_id)

    def has_device_capability(self, capability, device_id=None):
        major, minor = self._capability(device_id)
        if isinstance(capability, tuple):
            return (major, minor) >= tuple(capability)
        return major * 10 + minor >= capability

    def is_device_capability_family(self, capability, device_id=None):
        major, minor = self._capability(device_id)
        return (major * 10 + minor) // 10 == capability // 10

    def is_arch_support_pdl(self):  # as vLLM's CudaPlatform: Hopper and newer
        return torch.cuda.is_available() and self._capability()[0] >= 9


current_platform = _CudaPlatform()
'''

STANDIN = {
    "vllm/__init__.py": f'"""Stand-in package: vLLM {VLLM_VERSION}\'s KDA kernel files only (kdakit\'s '
                        f'benchmarks/gpu_vllm_plugin_check.py --build-peer)."""\n'
                        f'__version__ = "{VLLM_VERSION}"\nKDAKIT_PEER = True\n',
    "vllm/platforms/__init__.py": _PLATFORM,
    "vllm/triton_utils/__init__.py": '''import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice

HAS_TRITON = True
''',
    "vllm/utils/__init__.py": "",
    "vllm/utils/gpu_sync_debug.py": '''import contextlib


def gpu_sync_allowed():
    return contextlib.nullcontext()
''',
    "vllm/utils/torch_utils.py": '''import numpy as np
import torch


def async_tensor_h2d(data, device=None, dtype=None, out=None):
    if dtype is None and out is not None:
        dtype = out.dtype
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else torch.as_tensor(data)
    t = t.to(device=device, dtype=dtype, non_blocking=True)
    return out.copy_(t) if out is not None else t
''',
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/utils.py": "PAD_SLOT_ID = -1\nNULL_BLOCK_ID = 0\n",
    "vllm/models/__init__.py": "",
    "vllm/models/kimi_k3/__init__.py": "",          # the real one imports the whole model
    "vllm/models/kimi_k3/nvidia/__init__.py": "",
    "vllm/models/kimi_k3/nvidia/ops/__init__.py": "",
    "vllm/models/kimi_k3/nvidia/ops/third_party/__init__.py": "",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/mamba/__init__.py": "",
    "vllm/model_executor/layers/mamba/ops/__init__.py": "",
    "vllm/third_party/__init__.py": "",
    "vllm/third_party/flash_linear_attention/__init__.py": "",
    "vllm/third_party/flash_linear_attention/ops/__init__.py": "",   # the real one imports every fla op
}


def build_peer(dest: str, wheel: str | None = None) -> str:
    """Writes ``dest``: the wheel's kernel files under the stand-in package. ``wheel`` None:
    ``pip download --no-deps vllm==0.33.0`` into a temporary folder. Adds ``dest`` to
    .git/info/exclude when it lies inside this git checkout."""
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                            f"vllm=={VLLM_VERSION}"], check=True)
            wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.endswith(".py") and "__pycache__" not in m
                       and any(m == p or (p.endswith("/") and m.startswith(p)) for p in PEER_FILES)]
            missing = [p for p in PEER_FILES if not any(m == p or m.startswith(p) for m in members)]
            if missing:
                raise ValueError(f"{wheel} lacks {', '.join(missing)}")
            zf.extractall(dest, members)
    for rel, text in STANDIN.items():
        path = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    _exclude_from_git(dest)
    return dest


def _exclude_from_git(dest: str) -> None:
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(dest)), timeout=10).stdout.strip()
        common = subprocess.run(["git", "rev-parse", "--git-common-dir"], capture_output=True, text=True,
                                cwd=top, timeout=10).stdout.strip() if top else ""
    except (OSError, subprocess.SubprocessError):
        return
    rel = os.path.relpath(os.path.abspath(dest), top) if top else ""
    if not top or not common or rel.startswith(".."):
        return
    exclude = os.path.join(top, common, "info", "exclude") if not os.path.isabs(common) else \
        os.path.join(common, "info", "exclude")
    line = "/" + rel.replace(os.sep, "/") + "/"
    os.makedirs(os.path.dirname(exclude), exist_ok=True)
    existing = open(exclude).read().splitlines() if os.path.exists(exclude) else []
    if line not in existing:
        with open(exclude, "a") as f:
            f.write(line + "\n")


def peer_kernels() -> dict:
    """vLLM's kernel functions, imported as KG imports them (KG:40-41, KG:411-415)."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from vllm.model_executor.layers.mamba.ops.gather_initial_states import gather_initial_states
    nk = importlib.import_module(NK)
    return dict(causal_conv1d_fn=causal_conv1d_fn, causal_conv1d_update=causal_conv1d_update,
                gather_initial_states=gather_initial_states, chunk_kda_with_fused_gate=nk.chunk_kda_with_fused_gate,
                fused_recurrent_kda=nk.fused_recurrent_kda,
                fused_recurrent_kda_packed_decode=nk.fused_recurrent_kda_packed_decode)


def peer_source() -> str:
    import vllm
    root = os.path.dirname(os.path.abspath(vllm.__file__))
    kind = "the wheel's kernel files under kdakit's stand-in package" if getattr(vllm, "KDAKIT_PEER", False) \
        else "an installed vLLM"
    return f"vLLM {getattr(vllm, '__version__', '?')} kernels from {kind} ({root})"


# ---------------------------------------------------------------------------------------------
# The peer: vLLM 0.33.0's KimiGatedDeltaNetAttention._forward, call for call
# ---------------------------------------------------------------------------------------------
FORWARD_CONTEXT = types.SimpleNamespace(attn_metadata=None)     # vllm.forward_context's, for one layer


def _identity_decorator(fn):
    """Stands in for eager_break_during_capture: the script captures decode graphs itself."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


# What make_layer_class reads from vLLM's layer module.
PEER_MODULE = types.SimpleNamespace(eager_break_during_capture=_identity_decorator,
                                    get_forward_context=lambda: FORWARD_CONTEXT,
                                    is_conv_state_dim_first=lambda: False)   # vLLM's default SD layout


@dataclasses.dataclass
class PeerMetadata:
    """GDNAttentionMetadata's fields (vllm/v1/attention/backends/gdn_attn.py:88-131) that the
    layer's _forward and causal_conv1d_fn read."""
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_spec_decodes: int
    num_spec_decode_tokens: int
    num_actual_tokens: int
    has_initial_state: torch.Tensor | None = None
    spec_query_start_loc: torch.Tensor | None = None
    non_spec_query_start_loc: torch.Tensor | None = None
    spec_state_indices_tensor: torch.Tensor | None = None
    non_spec_state_indices_tensor: torch.Tensor | None = None
    spec_sequence_masks: torch.Tensor | None = None
    spec_token_indx: torch.Tensor | None = None
    non_spec_token_indx: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None
    nums_dict: dict | None = None
    batch_ptr: torch.Tensor | None = None
    token_chunk_offset_ptr: torch.Tensor | None = None


def make_peer_class(kernels: dict, module=PEER_MODULE):
    """A layer with vLLM's attributes whose ``_forward`` is KG:379-646 on ``kernels``."""

    class PeerLayer(torch.nn.Module):
        peer_kernels = kernels

        @module.eager_break_during_capture
        def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
            kn = self.peer_kernels
            attn_metadata_raw = module.get_forward_context().attn_metadata           # KG:388-389
            if attn_metadata_raw is None:                                            # KG:391-392
                return
            m = attn_metadata_raw.get(self.prefix)                                   # KG:418
            if m is None:                                                            # KG:419-421
                return
            has_initial_state = m.has_initial_state                                  # KG:424-433
            non_spec_query_start_loc = m.non_spec_query_start_loc
            non_spec_state_indices_tensor = m.non_spec_state_indices_tensor
            spec_sequence_masks = m.spec_sequence_masks
            spec_token_indx = m.spec_token_indx
            non_spec_token_indx = m.non_spec_token_indx
            spec_state_indices_tensor = m.spec_state_indices_tensor
            spec_query_start_loc = m.spec_query_start_loc
            num_accepted_tokens = m.num_accepted_tokens
            num_actual_tokens = m.num_actual_tokens
            mixed_qkv = mixed_qkv[:num_actual_tokens]                                # KG:434-436
            g1 = g1[:, :num_actual_tokens]
            beta = beta[:, :num_actual_tokens]
            conv_state, recurrent_state = self.kv_cache                              # KG:438-440
            if not module.is_conv_state_dim_first():                                 # KG:443-444
                conv_state = conv_state.transpose(-1, -2)
            conv_weights = self.conv1d.weight.view(self.conv1d.weight.size(0),       # KG:446-448
                                                   self.conv1d.weight.size(2))
            q_conv_weight, k_conv_weight, v_conv_weight = conv_weights.split(         # KG:449-451
                self.local_projection_size, dim=0)
            q_conv_state, k_conv_state, v_conv_state = conv_state.split(              # KG:452-454
                self.local_projection_size, dim=-2)

            if spec_sequence_masks is not None:                                      # KG:458-472
                if m.num_prefills == 0 and m.num_decodes == 0:
                    mixed_qkv_spec, g1_spec, beta_spec = mixed_qkv, g1, beta
                    mixed_qkv_ns = g1_ns = beta_ns = None
                else:
                    mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
                    g1_spec = g1.index_select(1, spec_token_indx)
                    beta_spec = beta.index_select(1, spec_token_indx)
                    mixed_qkv_ns = mixed_qkv.index_select(0, non_spec_token_indx)
                    g1_ns = g1.index_select(1, non_spec_token_indx)
                    beta_ns = beta.index_select(1, non_spec_token_indx)
            else:
                mixed_qkv_spec = g1_spec = beta_spec = None
                mixed_qkv_ns, g1_ns, beta_ns = mixed_qkv, g1, beta

            # einops' rearrange(x, "n (h d) -> 1 n h d") is a reshape: a view where one exists
            def heads(x):
                return x.reshape(1, x.shape[0], -1, self.head_dim)

            core_attn_out_spec = None
            if spec_sequence_masks is not None:                                      # KG:476-527
                spec_conv_indices = spec_state_indices_tensor[:, 0][: m.num_spec_decodes]
                spec_max_query_len = spec_state_indices_tensor.size(-1)
                spec_conv_out = torch.empty(mixed_qkv_spec.shape, dtype=mixed_qkv_spec.dtype,
                                            device=mixed_qkv_spec.device)           # KG:484-488
                mixed_qkv_spec = kn["causal_conv1d_update"](                         # KG:489-501
                    mixed_qkv_spec, conv_state, conv_weights, self.conv1d.bias, activation="silu",
                    conv_state_indices=spec_conv_indices, num_accepted_tokens=num_accepted_tokens,
                    query_start_loc=spec_query_start_loc, max_query_len=spec_max_query_len,
                    validate_data=False, out=spec_conv_out)
                q_spec, k_spec, v_spec = (heads(x) for x in                          # KG:502-505
                                          mixed_qkv_spec.split(self.local_projection_size, dim=-1))
                spec_cu_seqlens = spec_query_start_loc[: m.num_spec_decodes + 1]    # KG:506
                spec_out = (core_attn_out[:, : q_spec.shape[1]]                      # KG:508-512
                            if m.num_prefills == 0 and m.num_decodes == 0 else None)
                core_attn_out_spec, _ = kn["fused_recurrent_kda"](                   # KG:513-527
                    q=q_spec, k=k_spec, v=v_spec, raw_g=g1_spec, raw_beta=beta_spec, A_log=self.A_log,
                    dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound, initial_state=recurrent_state,
                    cu_seqlens=spec_cu_seqlens, ssm_state_indices=spec_state_indices_tensor,
                    num_accepted_tokens=num_accepted_tokens, out=spec_out)

            core_attn_out_non_spec = None
            if mixed_qkv_ns is not None:                                             # KG:531-627
                if m.num_prefills > 0:
                    q_ns, k_ns, v_ns = mixed_qkv_ns.split(self.local_projection_size, dim=-1)   # KG:534-536

                    def _prefill_conv(x, state, weight):                             # KG:543-558
                        return kn["causal_conv1d_fn"](
                            x.transpose(0, 1), weight, None, activation="silu", conv_states=state,
                            has_initial_state=has_initial_state, cache_indices=non_spec_state_indices_tensor,
                            query_start_loc=non_spec_query_start_loc, metadata=m).transpose(0, 1)

                    q_ns = _prefill_conv(q_ns, q_conv_state, q_conv_weight)          # KG:560-562
                    k_ns = _prefill_conv(k_ns, k_conv_state, k_conv_weight)
                    v_ns = _prefill_conv(v_ns, v_conv_state, v_conv_weight)
                    q_ns, k_ns, v_ns = (heads(x) for x in (q_ns, k_ns, v_ns))        # KG:563-566
                    initial_state = kn["gather_initial_states"](                     # KG:570-574
                        recurrent_state, non_spec_state_indices_tensor, has_initial_state)
                    core_attn_out_non_spec, last_recurrent_state = kn["chunk_kda_with_fused_gate"](   # KG:575-591
                        q=q_ns, k=k_ns, v=v_ns, raw_g=g1_ns, raw_beta=beta_ns, A_log=self.A_log,
                        g_bias=self.dt_bias, lower_bound=self.gate_lower_bound, initial_state=initial_state,
                        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=non_spec_query_start_loc)
                    recurrent_state[non_spec_state_indices_tensor] = last_recurrent_state        # KG:593
                else:
                    decode_conv_indices = non_spec_state_indices_tensor[: mixed_qkv_ns.size(0)]  # KG:598-600
                    packed_conv_out = torch.empty(mixed_qkv_ns.shape, dtype=mixed_qkv_ns.dtype,
                                                  device=mixed_qkv_ns.device)       # KG:603-607
                    mixed_qkv_ns = kn["causal_conv1d_update"](                       # KG:608-617
                        mixed_qkv_ns, conv_state, conv_weights, self.conv1d.bias, activation="silu",
                        conv_state_indices=decode_conv_indices, validate_data=True, out=packed_conv_out)
                    core_attn_out_non_spec, _ = kn["fused_recurrent_kda_packed_decode"](   # KG:618-627
                        mixed_qkv=mixed_qkv_ns, raw_g=g1_ns, raw_beta=beta_ns, A_log=self.A_log,
                        dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound, initial_state=recurrent_state,
                        state_indices=decode_conv_indices)

            if core_attn_out_spec is not None and core_attn_out_non_spec is not None:   # KG:630-639
                merged = torch.empty((1, num_actual_tokens, *core_attn_out_spec.shape[2:]),
                                     dtype=core_attn_out_spec.dtype, device=core_attn_out_spec.device)
                merged.index_copy_(1, spec_token_indx, core_attn_out_spec)
                merged.index_copy_(1, non_spec_token_indx, core_attn_out_non_spec)
                core_attn_out[0, :num_actual_tokens] = merged[0, :num_actual_tokens]
            elif core_attn_out_non_spec is not None:                                # KG:640-643
                core_attn_out[0, :num_actual_tokens] = core_attn_out_non_spec[0, :num_actual_tokens]
            else:
                assert core_attn_out_spec is not None                               # KG:644-645
            core_attn_out.copy_(self.o_norm(core_attn_out, g2))                       # KG:646

    return PeerLayer


def make_layer_classes(kernels: dict):
    """(vLLM's layer on ``kernels``, kdakit's plugin subclass of it)."""
    from kdakit.integrations.vllm import make_layer_class
    peer = make_peer_class(kernels)
    return peer, make_layer_class(peer, PEER_MODULE)


class GatedNorm(torch.nn.Module):
    """The output norm on both sides: vLLM's o_norm (FusedRMSNormGated(D, activation="sigmoid"),
    eps 1e-5, KG:304) in float32 torch. Records its input (the kernels' output) when asked;
    ``passthrough`` (timings) returns its input."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.record = None
        self.passthrough = False

    def forward(self, x, g):
        if self.record is not None:
            self.record.append(x.clone())
        if self.passthrough:
            return x
        o = x.float()
        y = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + 1e-5) * self.weight.float() * torch.sigmoid(g.float())
        return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Parameters, pools and batches in vLLM's layouts
# ---------------------------------------------------------------------------------------------
def make_params(seed: int, lower_bound=None) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    P = H * D
    return dict(weight=(torch.randn(3 * P, 1, W, generator=gen) * 0.5).to(DEVICE),        # fp32 [3P,1,W]
                A_log=(torch.rand(H, generator=gen) * 2 - 1).to(DEVICE),
                dt_bias=(torch.randn(P, generator=gen) * 0.5).to(DEVICE),
                norm=(torch.rand(D, generator=gen) + 0.5).to(DEVICE), lower_bound=lower_bound)


def build_layer(cls, params):
    """A layer of ``cls`` with vLLM's attributes (KG:180-326), built without vLLM's __init__."""
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.prefix = PREFIX
    layer.local_num_heads, layer.head_dim, layer.local_projection_size, layer.conv_size = H, D, H * D, W
    layer.conv1d = torch.nn.Module()
    layer.conv1d.weight = torch.nn.Parameter(params["weight"], requires_grad=False)
    layer.conv1d.bias = None
    layer.A_log = torch.nn.Parameter(params["A_log"], requires_grad=False)
    layer.dt_bias = torch.nn.Parameter(params["dt_bias"], requires_grad=False)
    layer.gate_lower_bound = params["lower_bound"]
    layer.o_norm = GatedNorm(params["norm"])
    return layer


@dataclasses.dataclass
class Pages:
    """int8 pages ``[slots, conv | recurrent | pad]``, viewed per state as MambaBase.bind_kv_cache
    does (mamba/abstract.py:28-42): both states slot-strided by the page."""
    pages: torch.Tensor
    L: int

    def views(self, pages=None):
        pages = self.pages if pages is None else pages
        slots, P = pages.shape[0], H * D
        conv_bytes = self.L * 3 * P * ACT.itemsize
        rec_bytes = H * D * D * 4
        conv = pages[:, :conv_bytes].view(ACT).view(slots, self.L, 3 * P)            # SD: [slots, L, 3P]
        rec = pages[:, conv_bytes:conv_bytes + rec_bytes].view(torch.float32).view(slots, H, D, D)
        return conv, rec


def make_pages(seed: int, slots: int, num_spec: int) -> Pages:
    L = W - 1 + num_spec
    P = H * D
    page = L * 3 * P * ACT.itemsize + H * D * D * 4 + 256
    p = Pages(torch.zeros(slots, page, dtype=torch.int8, device=DEVICE), L)
    conv, rec = p.views()
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for s in range(0, slots, 64):                       # in pieces: no pool-sized float32 temporary
        e = min(slots, s + 64)
        conv[s:e].copy_(torch.randn(conv[s:e].shape, device=DEVICE, generator=gen))
        rec[s:e].copy_(torch.randn(rec[s:e].shape, device=DEVICE, generator=gen) * 0.1)
    return p


def make_inputs(seed: int, T_pad: int) -> dict:
    """The projections as KG:328-377 hands them over: q|k|v and beta slices of one row of
    ``in_proj_qkvgfab`` (``[3P | H | D]``, KG:346-355; beta row-strided), g1 ``[1,T,H,D]``,
    g2 ``[T,H,D]``."""
    P = H * D
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    proj = torch.randn(T_pad, 3 * P + H + D, device=DEVICE, generator=gen).to(ACT)
    return dict(mixed_qkv=proj[:, :3 * P], beta=proj[:, 3 * P:3 * P + H].unsqueeze(0),
                g1=torch.randn(1, T_pad, H, D, device=DEVICE, generator=gen).to(ACT),
                g2=torch.randn(T_pad, H, D, device=DEVICE, generator=gen).to(ACT))


def clone_inputs(inputs: dict) -> dict:
    proj = inputs["mixed_qkv"].as_strided((inputs["mixed_qkv"].shape[0], inputs["mixed_qkv"].stride(0)),
                                          (inputs["mixed_qkv"].stride(0), 1)).clone()
    P = H * D
    return dict(mixed_qkv=proj[:, :3 * P], beta=proj[:, 3 * P:3 * P + H].unsqueeze(0), g1=inputs["g1"].clone(),
                g2=inputs["g2"].clone())


def conv1d_metadata(qsl_cpu: torch.Tensor):
    """causal_conv1d_fn's launch plan, as vLLM's builder makes it from the CPU query_start_loc
    (compute_causal_conv1d_metadata, v1/attention/backends/utils.py:1117-1164): BLOCK_M = 8."""
    BLOCK_M = 8
    seqlens = qsl_cpu.diff().long()
    nums = -(-seqlens // BLOCK_M)
    mlist = torch.repeat_interleave(torch.arange(len(nums)), nums)
    offsets = torch.cat([torch.arange(int(n)) for n in nums]).to(torch.int32) if len(nums) else \
        torch.zeros(0, dtype=torch.int32)
    size = max(1024, len(mlist)) * 2
    batch_ptr = torch.full((size,), -1, dtype=torch.int32, device=DEVICE)
    chunk_ptr = torch.full((size,), -1, dtype=torch.int32, device=DEVICE)
    batch_ptr[:len(mlist)] = mlist.to(torch.int32).to(DEVICE)
    chunk_ptr[:len(mlist)] = offsets.to(DEVICE)
    nums_dict = {BLOCK_M: dict(nums=nums, tot=int(nums.sum()), mlist=mlist, mlist_len=len(mlist), offsetlist=offsets,
                               batch_ptr=batch_ptr, token_chunk_offset_ptr=chunk_ptr)}
    return dict(nums_dict=nums_dict, batch_ptr=batch_ptr, token_chunk_offset_ptr=chunk_ptr)


@dataclasses.dataclass
class Case:
    name: str
    fields: dict          # GDNAttentionMetadata's fields
    T: int                # real tokens (num_actual_tokens may be token-padded beyond it)
    T_pad: int            # rows of the inputs
    live_tokens: torch.Tensor
    conv_slots: list
    rec_slots: list
    slots: int
    num_spec: int


def _i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEVICE)


def _slot_perm(seed, count, slots):
    """``count`` distinct live slots in 1..slots-1 (slot 0 is vLLM's null block)."""
    return (torch.randperm(slots - 1, generator=torch.Generator().manual_seed(seed))[:count] + 1).tolist()


def decode_case(N: int, pad: int, seed: int, *, num_spec: int = 0) -> Case:
    """Pure decode as a FULL-graph replay sees it (gdn_attn.py:655-671): N live rows, then ``pad``
    rows of slot 0 (NULL_BLOCK_ID), num_actual_tokens token-padded over them."""
    slots = 2 * N + 2
    live = _slot_perm(seed, N, slots)
    T = N + pad
    qsl = list(range(N + 1)) + [N] * pad
    fields = dict(num_prefills=0, num_prefill_tokens=0, num_decodes=N, num_decode_tokens=N, num_spec_decodes=0,
                  num_spec_decode_tokens=0, num_actual_tokens=T, non_spec_query_start_loc=_i32(qsl),
                  non_spec_state_indices_tensor=_i32(live + [0] * pad))
    return Case(f"decode N={N}+{pad} pad" + (f" spec-sized pool (L={W - 1 + num_spec})" if num_spec else ""),
                fields, T, T, torch.arange(N), live, live, slots, num_spec)


def prefill_case(name: str, lens, his, seed: int, *, decodes: int = 0, token_pad: int = 0, num_spec: int = 0) -> Case:
    """``decodes`` one-token rows first (vLLM orders decodes first; in a batch with prefills they
    take the chunked path, KG:533), then prefills of ``lens`` with ``his`` (has_initial_state)."""
    lens = [1] * decodes + list(lens)
    his = [True] * decodes + list(his)
    B = len(lens)
    slots = 2 * B + 2
    live = _slot_perm(seed, B, slots)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    fields = dict(num_prefills=B - decodes, num_prefill_tokens=T - decodes, num_decodes=decodes,
                  num_decode_tokens=decodes, num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=T,
                  has_initial_state=torch.tensor(his, dtype=torch.bool, device=DEVICE),
                  non_spec_query_start_loc=_i32(qsl), non_spec_state_indices_tensor=_i32(live),
                  **conv1d_metadata(torch.tensor(qsl, dtype=torch.int32)))
    return Case(name, fields, T, T + token_pad, torch.arange(T), live, live, slots, num_spec)


def spec_case(name: str, accepted, seed: int, *, pad: int = 0, prefill_lens=(), prefill_his=()) -> Case:
    """Speculative verify, NUM_SPEC drafted tokens (NUM_SPEC + 1 tokens a request, each with its own
    state slot per token, spec_state_indices_tensor [B, NUM_SPEC + 1]). Spec-only: ``pad`` padded
    requests as a FULL-graph replay sees them (gdn_attn.py:615-653: slots 0, query_start_loc
    repeating its last value, num_accepted 1). With ``prefill_lens``: a mixed batch, spec tokens
    first, then the prefills (vLLM turns plain decodes into prefills beside spec rows)."""
    S1 = NUM_SPEC + 1
    Bs, Bp = len(accepted), len(prefill_lens)
    slots = (Bs + pad) * S1 + 2 * Bp + 2
    perm = _slot_perm(seed, Bs * S1 + Bp, slots)
    spec_idx = [perm[n * S1:(n + 1) * S1] for n in range(Bs)] + [[0] * S1] * pad
    ns_slots = perm[Bs * S1:]
    Ts = Bs * S1
    sqsl = list(range(0, Ts + 1, S1)) + [Ts] * pad
    acc = list(accepted) + [1] * pad
    fields = dict(num_spec_decodes=Bs, num_spec_decode_tokens=Ts, spec_query_start_loc=_i32(sqsl),
                  spec_state_indices_tensor=_i32(spec_idx), num_accepted_tokens=_i32(acc))
    conv_slots = [row[0] for row in spec_idx[:Bs]]
    rec_slots = [s for row in spec_idx[:Bs] for s in row]
    if not Bp:
        T = (Bs + pad) * S1
        fields.update(num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
                      num_actual_tokens=T, spec_sequence_masks=torch.tensor([True] * Bs + [False] * pad,
                                                                            device=DEVICE))
        return Case(name, fields, Ts, T, torch.arange(Ts), conv_slots, rec_slots, slots, NUM_SPEC)
    qsl = [0]
    for n in prefill_lens:
        qsl.append(qsl[-1] + n)
    T = Ts + qsl[-1]
    fields.update(num_prefills=Bp, num_prefill_tokens=qsl[-1], num_decodes=0, num_decode_tokens=0, num_actual_tokens=T,
                  has_initial_state=torch.tensor(list(prefill_his), dtype=torch.bool, device=DEVICE),
                  non_spec_query_start_loc=_i32(qsl), non_spec_state_indices_tensor=_i32(ns_slots),
                  spec_sequence_masks=torch.tensor([True] * Bs + [False] * Bp, device=DEVICE),
                  spec_token_indx=torch.arange(Ts, device=DEVICE), non_spec_token_indx=torch.arange(Ts, T, device=DEVICE),
                  **conv1d_metadata(torch.tensor(qsl, dtype=torch.int32)))
    return Case(name, fields, T, T, torch.arange(T), conv_slots + ns_slots, rec_slots + ns_slots, slots, NUM_SPEC)


def metadata_for(case: Case, cls=None):
    return (cls or PeerMetadata)(**case.fields)


# ---------------------------------------------------------------------------------------------
# Checks and timings
# ---------------------------------------------------------------------------------------------
def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_side(cls, params, case: Case, pages: Pages, inputs: dict, metadata_cls=None) -> dict:
    """One ``_forward`` on a fresh copy of the pools and inputs."""
    layer = build_layer(cls, params)
    p = pages.pages.clone()
    conv, rec = pages.views(p)
    layer.kv_cache = (conv, rec)
    x = clone_inputs(inputs)
    out = torch.full((1, case.T_pad, H, D), float("nan"), dtype=ACT, device=DEVICE)
    layer.o_norm.record = []
    FORWARD_CONTEXT.attn_metadata = {PREFIX: metadata_for(case, metadata_cls)}
    try:
        with torch.no_grad():
            layer._forward(core_attn_out=out, **x)
    finally:
        FORWARD_CONTEXT.attn_metadata = None
    sync()
    return dict(out=out, pre_norm=layer.o_norm.record[0], conv=conv, rec=rec)


def compare(case: Case, peer_cls, ours_cls, params, results, *, tol=TOL) -> bool:
    pages = make_pages(zlib.crc32(case.name.encode()) % 1000, case.slots, case.num_spec)
    inputs = make_inputs(7, case.T_pad)
    a = run_side(peer_cls, params, case, pages, inputs)
    b = run_side(ours_cls, params, case, pages, inputs)
    conv0, rec0 = pages.views()
    tok = case.live_tokens.to(DEVICE)
    cs = torch.tensor(sorted(set(case.conv_slots)), dtype=torch.long, device=DEVICE)
    rs = torch.tensor(sorted(set(case.rec_slots)), dtype=torch.long, device=DEVICE)
    errs = {"out": rel(b["pre_norm"][:, tok], a["pre_norm"][:, tok]),
            "out_normed": rel(b["out"][:, tok], a["out"][:, tok]),
            "conv_slots": rel(b["conv"][cs], a["conv"][cs]),
            "rec_slots": rel(b["rec"][rs], a["rec"][rs])}
    finite = bool(torch.isfinite(b["out"][:, tok]).all())
    flags = {}
    for side, r in (("kdakit", b), ("vllm", a)):
        for pool, now, before, live in (("conv", r["conv"], conv0, cs), ("rec", r["rec"], rec0, rs)):
            other = torch.ones(now.shape[0], dtype=torch.bool, device=DEVICE)
            other[live] = False
            flags[f"{side}_other_{pool}_slots_unchanged"] = bool(torch.equal(now[other], before[other]))
    ok = finite and all(e <= tol for e in errs.values()) and \
        flags["kdakit_other_conv_slots_unchanged"] and flags["kdakit_other_rec_slots_unchanged"]
    results["checks"].append({"case": case.name, "ok": ok, "finite": finite,
                              **{k: round(v, 7) for k, v in errs.items()}, **flags})
    unchanged = "other slots unchanged" if all(flags.values()) else \
        "CHANGED: " + ", ".join(k for k, v in flags.items() if not v)
    print(f"{'ok  ' if ok else 'FAIL'} {case.name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
          + f"; {unchanged}", flush=True)
    return ok


def check_cases(quick: bool, *, cpu: bool = False) -> list:
    """Every batch kind. GPU: Kimi Linear's sizes; CPU: tiny."""
    if cpu:
        return [decode_case(3, 2, 1), decode_case(2, 1, 2, num_spec=NUM_SPEC),
                prefill_case("prefill 2 seqs (first + continued)", [5, 3], [False, True], 3),
                prefill_case("mixed prefill + decode", [6, 3], [True, False], 4, decodes=2, token_pad=3),
                spec_case("spec-only accepted 1..4 +1 pad", [1, 2, 3, 4], 5, pad=1),
                spec_case("mixed spec + prefill", [4, 1], 6, prefill_lens=[1, 5], prefill_his=[True, False])]
    decode_ns = [1, 8, 64, 512] if not quick else [1, 64]
    cases = [decode_case(N, max(1, N // 8), 10 + N) for N in decode_ns]
    cases.append(decode_case(8, 2, 3, num_spec=NUM_SPEC))
    cases.append(prefill_case("prefill 1x8192 (first chunk)", [8192], [False], 4))
    cases.append(prefill_case("prefill 8x2048 (4 first, 4 continued)", [2048] * 8, [False, True] * 4, 5))
    cases.append(prefill_case("mixed prefill + decode (4 decodes, 1000 + 37 + 300)", [1000, 37, 300],
                              [True, False, True], 6, decodes=4, token_pad=13))
    cases.append(spec_case("spec-only N=8 accepted 1..4 + 2 pad", [1, 2, 3, 4, 4, 3, 2, 1], 7, pad=2))
    if not quick:
        cases.append(spec_case("spec-only N=64 accepted 1..4", [1 + n % 4 for n in range(64)], 8))
    cases.append(spec_case("mixed spec (4) + prefill (1-token, 200, 1500)", [1, 4, 2, 3], 9,
                           prefill_lens=[1, 200, 1500], prefill_his=[True, True, False]))
    return cases


STATE_BYTES = H * D * D * 4


def time_rows(peer_cls, ours_cls, params, results, harness, quick: bool) -> None:
    """Decode and verify from CUDA-graph replays, prefill eagerly (CUDA events), each over enough
    independent layers (own pools, own inputs) to stream the state from HBM."""
    ceiling = results["copy_ceiling_GBps"]
    P = H * D

    def layers_of(cls, case, L):
        made = []
        for i in range(L):
            layer = build_layer(cls, params)
            layer.o_norm.passthrough = True
            pages = make_pages(100 + i, case.slots, case.num_spec)
            layer.kv_cache = pages.views()
            inputs = make_inputs(200 + i, case.T_pad)
            out = torch.empty((1, case.T_pad, H, D), dtype=ACT, device=DEVICE)
            made.append((layer, inputs, out, pages))
        return made

    def run(name, case, bytes_per_call, graph, extra):
        L = harness.layers_for(bytes_per_call)
        FORWARD_CONTEXT.attn_metadata = {PREFIX: metadata_for(case)}
        try:
            for label, cls in (("vllm", peer_cls), ("kdakit", ours_cls)):
                made = layers_of(cls, case, L)
                calls = [(lambda ly=ly, x=x, o=o: ly._forward(core_attn_out=o, **x)) for ly, x, o, _ in made]
                with torch.no_grad():
                    us = harness.graph_time_us(calls) if graph else harness.eager_time_us(calls)
                results["rows"].append(harness.row(f"{name} {label}", us, bytes_per_call, ceiling, layers=L,
                                                   timing="cuda_graph" if graph else "eager_events", **extra))
                print(f"{name:28s} {label:7s} {us:9.2f} us ({'graph' if graph else 'eager'}, {L} layers)", flush=True)
                del made, calls
                torch.cuda.empty_cache()
        finally:
            FORWARD_CONTEXT.attn_metadata = None

    decode_ns = [1, 8, 64, 512] if not quick else [8, 512]
    for N in decode_ns:
        case = decode_case(N, 0, 20 + N)
        case.slots = N + 1
        case.fields["non_spec_state_indices_tensor"] = _i32(list(range(1, N + 1)))
        run(f"decode N={N}", case, 2 * N * STATE_BYTES + N * 3 * P * 2, True, {"N": N})
    for label, lens in ([("1x8192", [8192]), ("8x2048", [2048] * 8)] if not quick else [("8x2048", [2048] * 8)]):
        case = prefill_case(label, lens, [True] * len(lens), 30)
        T = sum(lens)
        run(f"prefill {label}", case, T * (3 * P + 3 * P + 2 * P) * 2 + 2 * len(lens) * STATE_BYTES, False,
            {"tokens": T})
    for N in ([1, 8, 64, 256] if not quick else [8]):
        case = spec_case(f"verify N={N}", [1 + n % (NUM_SPEC + 1) for n in range(N)], 40 + N)
        run(f"verify N={N} draft {NUM_SPEC}", case, (1 + NUM_SPEC + 1) * N * STATE_BYTES, True,
            {"N": N, "drafted": NUM_SPEC})


# ---------------------------------------------------------------------------------------------
# The CPU run
# ---------------------------------------------------------------------------------------------
def use_cpu_sizes() -> None:
    """H = 2, K = V = 16 on CPU tensors (the sizes of tests/test_integration_vllm.py's stand-ins)."""
    global H, D, DEVICE, STATE_BYTES
    H, D, DEVICE = 2, 16, "cpu"
    STATE_BYTES = H * D * D * 4


def _test_stand_ins(calls=None):
    """tests/test_integration_vllm.py's float64 versions of vLLM's kernels (H = 2, D = 16, W = 4),
    by name; ``calls`` (a list) records their names."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                        "test_integration_vllm.py")
    spec = importlib.util.spec_from_file_location("_vllm_test_stand_ins", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (mod.H, mod.D, mod.W) == (H, D, W), "the test's stand-ins are written for other sizes"
    kernels, nk = mod.make_vllm_kernels([] if calls is None else calls)
    kernels.update(chunk_kda_with_fused_gate=nk.chunk_kda_with_fused_gate, fused_recurrent_kda=nk.fused_recurrent_kda,
                   fused_recurrent_kda_packed_decode=nk.fused_recurrent_kda_packed_decode)
    return kernels


def _strided_copy(x):
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device).copy_(x)


class InterpreterProbe:
    """vLLM's kernel ``name`` where it runs on CPU tensors in Triton's interpreter, else the float64
    stand-in. The first call of each form (the arguments given, not None: decode and speculative
    conv updates differ) runs vLLM's kernel on copies of the arguments (strides kept); if that
    raises, this and every later call of that form go to the stand-in (reported in ``fallbacks``)."""

    def __init__(self, name, kernel, stand_in, fallbacks):
        self.name, self.kernel, self.stand_in, self.fallbacks = name, kernel, stand_in, fallbacks
        self.works = {}

    def form(self, args, kwargs):
        given = sorted(k for k, v in kwargs.items() if v is not None and k in ("num_accepted_tokens", "out"))
        return self.name + (f"({', '.join(given)})" if given else "")

    def __call__(self, *args, **kwargs):
        form = self.form(args, kwargs)
        if form not in self.works:
            try:
                self.kernel(*(_strided_copy(a) for a in args), **{k: _strided_copy(v) for k, v in kwargs.items()})
                self.works[form] = True
            except Exception as err:  # noqa: BLE001 - reported; the stand-in takes over
                self.works[form] = False
                text = str(err).strip().splitlines()
                self.fallbacks[form] = f"{type(err).__name__}: {text[-1][:200] if text else ''}"
        return (self.kernel if self.works[form] else self.stand_in)(*args, **kwargs)


def importable_peer_kernels() -> dict | None:
    """``peer_kernels()``, or None after saying how to get them."""
    try:
        return peer_kernels()
    except ImportError as err:
        print(f"vLLM's kernels do not import ({err}): run --build-peer and put {PEER_DIR} first on PYTHONPATH",
              file=sys.stderr)
        return None


def cpu_interpret_checks(quick: bool) -> int:
    """The checks at tiny sizes on CPU tensors: kdakit's kernels and vLLM's Triton kernels in
    Triton's interpreter; where one of vLLM's cannot run there, the float64 version of
    tests/test_integration_vllm.py (printed)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--cpu-interpret needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return 2
    os.environ.setdefault("KDAKIT_BACKEND", "triton")
    use_cpu_sizes()
    kernels = importable_peer_kernels()
    if kernels is None:
        return 2
    print(peer_source())
    stand_ins = _test_stand_ins()
    fallbacks = {}
    kernels = {name: InterpreterProbe(name, fn, stand_ins[name], fallbacks) for name, fn in kernels.items()}
    peer_cls, ours_cls = make_layer_classes(kernels)
    results = {"checks": []}
    ok = True
    for lower_bound in ((None,) if quick else (None, -5.0)):
        params = make_params(0, lower_bound)
        print(f"-- gate lower_bound {lower_bound}")
        for case in check_cases(quick, cpu=True):
            ok &= compare(case, peer_cls, ours_cls, params, results)
    ran = [form for k in kernels.values() for form, works in k.works.items() if works]
    print("vLLM's Triton kernels run in the interpreter: " + (", ".join(ran) or "none"))
    for name, why in fallbacks.items():
        print(f"vLLM's {name} does not run on CPU tensors in the interpreter ({why}): "
              f"the float64 stand-in of tests/test_integration_vllm.py ran for it")
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-peer", action="store_true", help=f"write ./{PEER_DIR} from vLLM {VLLM_VERSION}'s wheel")
    ap.add_argument("--wheel", help=f"with --build-peer: a downloaded vLLM {VLLM_VERSION} wheel (default: pip download)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--name", default="vllm_plugin_check")
    ap.add_argument("--cpu-interpret", action="store_true",
                    help="the checks only, at tiny sizes on the CPU (TRITON_INTERPRET=1 set before the run)")
    args = ap.parse_args(argv)
    if args.build_peer:
        print("built", build_peer(os.path.abspath(PEER_DIR), args.wheel))
        return 0
    if args.cpu_interpret:
        return cpu_interpret_checks(args.quick)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    kernels = importable_peer_kernels()
    if kernels is None:
        return 2
    from kdakit.bench import harness
    source = peer_source()
    print(source, flush=True)
    peer_cls, ours_cls = make_layer_classes(kernels)
    results = harness.new_results(
        vllm=source, H=H, K=D, V=D, W=W, num_spec=NUM_SPEC, activations="bfloat16", conv_pool="bfloat16",
        conv_weights="float32", recurrent_pool="float32",
        vllm_side="PeerLayer: vLLM 0.33.0's KimiGatedDeltaNetAttention._forward (KG:379-646) call for call on "
                  "vLLM's kernels; kdakit's side: kdakit.integrations.vllm.make_layer_class(PeerLayer)",
        note="output norm: the same float32 gated RMSNorm on both sides in the checks, a pass-through in the "
             "timings; speculative batches run vLLM's kernels on both sides (the plugin leaves them to vLLM)")
    ok = True
    for lower_bound in (None, -5.0):
        params = make_params(0, lower_bound)
        print(f"-- gate lower_bound {lower_bound}", flush=True)
        for case in check_cases(args.quick or lower_bound is not None):
            case.name += f" (lower_bound {lower_bound})" if lower_bound is not None else ""
            ok &= compare(case, peer_cls, ours_cls, params, results)
            torch.cuda.empty_cache()
    results["all_checks_ok"] = bool(ok)
    if not ok:
        print("checks failed: no timings", flush=True)
    else:
        time_rows(peer_cls, ours_cls, make_params(0), results, harness, args.quick)
    harness.close_results(results)
    print("wrote", harness.save(results, args.name, harness.results_folder(__file__)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
