"""kdakit's sglang plugin kernel against sglang 0.5.23's own Triton KDA kernels, per call site:
same arguments, outputs and pools compared, then both timed from CUDA graphs.

    # once, on a machine with PyPI (writes ./.sglang-peer; git-ignored, never committed):
    python benchmarks/gpu_sglang_plugin_check.py --build-peer
    # on the GPU machine, with .sglang-peer carried there:
    PYTHONPATH=.sglang-peer:. python benchmarks/gpu_sglang_plugin_check.py [--quick] [--name sglang_plugin_h100]

sglang's kernels come from its wheel's kernel folders (``sglang/kernels/ops/attention/fla``,
``.../attention/linear``, ``sglang/kernels/ops/mamba``) under a minimal stand-in ``sglang`` package
(only the few helpers those files import; ``--build-peer`` writes it). sglang's packed decode
also has a CUDA JIT kernel (``kda_packed_decode.cuh``, tvm-ffi, from 8 requests with bf16
activations) that the peer does not build: its Triton packed kernel is compared and timed at
every size, and the JSON says so. ``PeerKernel`` below calls
them the way sglang's ``TritonKDAKernel`` (``sglang/srt/layers/attention/linear/kernels/kda_triton.py``)
does; kdakit's kernel is ``kdakit.integrations.sglang.make_kernel_class(PeerKernel)``, the class
the plugin installs in sglang, here on top of the peer.

Call sites (H = HV = 32, K = V = 128, bf16 activations, float32 pool, the argument patterns of
``sglang/srt/layers/attention/linear/kda_backend.py`` and ``kda_prefill_graph.py``):
- packed_decode, N = 1..512 (with one padded row, slot -1, in the checks);
- decode (the safe gate, q/k/v views), N = 1..512;
- extend: 1 x 8k and 8 x 2k, eager (no snapshot) and the prefill-graph pattern (padded tables,
  track_state snapshots; sglang gets its chunk tables as kda_prefill_graph.py passes them);
- target_verify: chains of num_spec 3 and top-2 trees of 8 nodes, N = 1..256.
Checks first (relative error of kdakit's against sglang's: live rows' outputs, live slots,
snapshots, track_state rows; the verify pool and the slots outside the batch bitwise unchanged),
timings only if all pass. JSON (GPU, date, command, copy
ceiling, checks, rows) to $OUT or benchmarks/results.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile

import torch

from kdakit.bench.inputs import top2_parents

H = HV = 32
K = V = 128
DEVICE = "cuda"
LOWER_BOUND = -5.0
STATE_BYTES = HV * V * K * 4
PEER_DIR = ".sglang-peer"
PEER_FOLDERS = ("sglang/kernels/ops/attention/fla/", "sglang/kernels/ops/attention/linear/",
                "sglang/kernels/ops/mamba/")

# The helpers the wheel's kernel folders import from sglang's runtime, written for a CUDA machine.
STANDIN = {
    "sglang/__init__.py": "",
    "sglang/kernels/__init__.py": "",
    "sglang/kernels/ops/__init__.py": "",
    "sglang/kernels/ops/attention/__init__.py": "",
    "sglang/kernels/jit/__init__.py": "",
    "sglang/kernels/jit/utils.py": '''import torch


class _Arch:
    def __init__(self):
        self.major, self.minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def get_jit_cuda_arch():
    return _Arch()


def is_arch_support_pdl():
    return get_jit_cuda_arch().major >= 9
''',
    # sglang's packed decode takes its CUDA JIT kernel (tvm-ffi, nvcc) from 8 requests with bf16
    # activations; that build is not part of this peer, so its Triton kernel runs at every size.
    "sglang/kernels/ops/attention/kda_packed_decode.py": '''def covered(*args, **kwargs):
    return False


def kda_packed_decode(*args, **kwargs):
    raise NotImplementedError("sglang's CUDA JIT packed decode is not part of this peer")
''',
    # the wheel's package file registers its CUDA JIT kernels with sglang's kernel registry; the
    # peer imports the Triton conv module directly
    "sglang/kernels/ops/mamba/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/utils/__init__.py": '''import contextlib

import torch


def _cap():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cpu_has_amx_support():
    return False


def is_cpu():
    return not torch.cuda.is_available()


def is_npu():
    return False


def is_xpu():
    return False


def is_hip():
    return torch.version.hip is not None


def is_cuda():
    return torch.cuda.is_available() and torch.version.hip is None


def get_device_sm():
    major, minor = _cap()
    return major * 10 + minor


def is_sm90_supported():
    return is_cuda() and _cap()[0] >= 9


def is_sm100_supported():
    return is_cuda() and _cap()[0] >= 10


def is_gfx95_supported():
    return False


def device_context(*args, **kwargs):
    return contextlib.nullcontext()
''',
    "sglang/srt/utils/common.py": '''import torch

torch_release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
''',
    "sglang/srt/batch_invariant_ops.py": '''def is_batch_invariant_mode_enabled():
    return False
''',
    "sglang/srt/model_executor/__init__.py": "",
    "sglang/srt/model_executor/cuda_graph_config.py": '''import enum


class Backend(enum.Enum):
    CUDA = "cuda"


class Phase(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


def check_cuda_graph_backend(*args, **kwargs):
    return False
''',
}


def build_peer(dest: str, wheel: str | None = None) -> str:
    """Writes ``dest``: the wheel's kernel folders under the stand-in package. ``wheel`` None:
    ``pip download --no-deps sglang==0.5.23`` into a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, "sglang==0.5.23"],
                           check=True)
            wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith(PEER_FOLDERS) and "__pycache__" not in m]
            if not members:
                raise ValueError(f"{wheel} holds none of {PEER_FOLDERS}")
            zf.extractall(dest, members)
    for rel, text in STANDIN.items():  # over any older stand-in: the linear kernels need more helpers
        path = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    for folder in ("sglang/kernels/ops/attention/fla", "sglang/kernels/ops/mamba"):
        init = os.path.join(dest, folder, "__init__.py")
        if not os.path.exists(init):
            open(init, "w").close()
    return dest


def peer_kernels():
    """The wheel's kernel functions (``.sglang-peer`` first on PYTHONPATH)."""
    from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_kda_packed_decode
    from sglang.kernels.ops.attention.fla.index import prepare_chunk_indices, prepare_chunk_offsets
    from sglang.kernels.ops.attention.fla.kda import chunk_kda
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update)
    return dict(packed=fused_recurrent_kda_packed_decode, chunk=chunk_kda, fsg=fused_sigmoid_gating_delta_rule_update,
                chunk_indices=prepare_chunk_indices, chunk_offsets=prepare_chunk_offsets)


def make_peer_class(fns):
    """sglang 0.5.23's TritonKDAKernel calls (kda_triton.py), on the peer's functions ``fns``."""

    class PeerKernel:
        supports_packed_decode = True
        supports_track_state_snapshot = True

        def packed_decode(self, mixed_qkv, a, b, *, A_log, dt_bias, scale, ssm_states, cache_indices, num_v_heads,
                          head_v_dim, lower_bound=None, **kwargs):
            B = mixed_qkv.shape[0]
            out = mixed_qkv.new_empty(B, 1, num_v_heads, head_v_dim)
            fns["packed"](mixed_qkv=mixed_qkv, a=a.reshape(B, -1), b=b.reshape(B, -1), A_log=A_log.reshape(-1),
                        dt_bias=dt_bias.reshape(-1), scale=scale, initial_state=ssm_states, out=out,
                        ssm_state_indices=cache_indices, use_qk_l2norm_in_kernel=True, lower_bound=lower_bound)
            return out.transpose(0, 1)

        def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
                   lower_bound=None, **kwargs):
            return fns["fsg"](A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=ssm_states,
                            initial_state_indices=cache_indices, cu_seqlens=query_start_loc,
                            use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=True,
                            lower_bound=lower_bound)

        def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                          intermediate_states_buffer, intermediate_state_indices, cache_steps, retrieve_parent_token,
                          lower_bound=None, **kwargs):
            return fns["fsg"](A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=ssm_states,
                            initial_state_indices=cache_indices, cu_seqlens=query_start_loc,
                            use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=True,
                            disable_state_update=True, intermediate_states_buffer=intermediate_states_buffer,
                            intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                            retrieve_parent_token=retrieve_parent_token, lower_bound=lower_bound)

        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log=None, dt_bias=None,
                   lower_bound=None, beta_is_raw=False, return_intermediate_states=False, **kwargs):
            return fns["chunk"](q=q, k=k, v=v, g=g, beta=beta, initial_state=ssm_states,
                              initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True,
                              cu_seqlens=query_start_loc, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                              beta_is_raw=beta_is_raw, output_intermediate_states=return_intermediate_states,
                              track_state=kwargs.get("track_state"), track_chunk_idx=kwargs.get("track_chunk_idx"),
                              chunk_indices=kwargs.get("chunk_indices"), chunk_offsets=kwargs.get("chunk_offsets"))

    return PeerKernel


# ---------------------------------------------------------------------------------------------
# Inputs in sglang's layouts
# ---------------------------------------------------------------------------------------------
def _rnd(gen, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).to(dtype)


def params(gen):
    A_log = (torch.rand(HV, device=DEVICE, generator=gen) * 2 - 1).view(1, 1, HV, 1)
    return A_log, torch.randn(HV * K, device=DEVICE, generator=gen) * 0.5


def pool_for(gen, slots):
    return torch.randn(slots, HV, V, K, device=DEVICE, generator=gen) * 0.1


def qkv_views(gen, T):
    qkv = _rnd(gen, T, 2 * H * K + HV * V)
    q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
    return qkv, q.unflatten(-1, (-1, K)).unsqueeze(0), k.unflatten(-1, (-1, K)).unsqueeze(0), \
        v.unflatten(-1, (-1, V)).unsqueeze(0)


def decode_case(N, seed, *, packed, padded):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    slots = torch.randperm(2 * N + 1, generator=torch.Generator().manual_seed(seed))[:N] + 1
    if padded and N > 1:
        slots[-1] = -1
    idx = slots.to(torch.int32).to(DEVICE)
    qkv, q, k, v = qkv_views(gen, N)
    a = _rnd(gen, N, HV * K + 64)[:, :HV * K]           # a slice of a fused projection
    b = _rnd(gen, 1, N, HV)
    A_log, dt_bias = params(gen)
    pool = pool_for(gen, 2 * N + 2)
    if packed:
        args = dict(mixed_qkv=qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5, ssm_states=pool,
                    cache_indices=idx, num_v_heads=HV, head_v_dim=V, lower_bound=None, replayssm_d=None,
                    replayssm_k=None, replayssm_g=None, replayssm_write_pos=None, replayssm_force_flush=None)
    else:
        args = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
                    query_start_loc=torch.arange(N + 1, dtype=torch.int32, device=DEVICE), lower_bound=LOWER_BOUND)
    return args, idx


def extend_case(seqlens, seed, *, graph):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    N, T = len(seqlens), sum(seqlens)
    max_seqs = N + 2 if graph else N
    slots = list(range(1, N + 1))
    idx = torch.tensor(slots + [-1] * (max_seqs - N), dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0] + [sum(seqlens[:i + 1]) for i in range(N)] + [T] * (max_seqs - N), dtype=torch.int32,
                      device=DEVICE)
    qkv, q, k, v = qkv_views(gen, T)
    a = _rnd(gen, T, HV * K).unsqueeze(0).unflatten(-1, (-1, K))
    b = _rnd(gen, 1, T, HV)
    A_log, dt_bias = params(gen)
    pool = pool_for(gen, max_seqs + 1)
    args = dict(q=q, k=k, v=v, g=a, beta=b, ssm_states=pool, cache_indices=idx, query_start_loc=cu, A_log=A_log,
                dt_bias=dt_bias, lower_bound=None)
    if graph:
        # kda_prefill_graph.py flags a 4-D gate's beta as activated (beta_is_raw=False): give it β.
        args["beta"] = torch.sigmoid(b.float()).to(b.dtype)
        track = torch.zeros(max_seqs, HV, V, K, device=DEVICE)
        chunk_idx = torch.tensor([n // 64 - 1 if n >= 128 else -1 for n in seqlens] + [-1] * (max_seqs - N),
                                 dtype=torch.int32, device=DEVICE)
        args.update(beta_is_raw=False, extend_seq_lens_cpu=None, is_spec_decode=False, return_intermediate_states=False,
                    track_state=track, track_chunk_idx=chunk_idx)
    else:
        args.update(beta_is_raw=True, extend_seq_lens_cpu=list(seqlens), extend_prefix_lens=None, layer_id=0,
                    is_spec_decode=False, return_intermediate_states=False, track_ssm_h_src=None, track_state=None,
                    track_chunk_idx=None, state_checkpoint_cu_starts=None, num_state_checkpoints=0,
                    state_checkpoint_every_n_tokens=0, state_checkpoint_indices=None, track_ssm_h_batch_src=None)
    return args, idx


def verify_case(N, draft, seed, *, tree, padded):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    T = N * draft
    slots = torch.arange(1, N + 1, dtype=torch.int32)
    if padded and N > 1:
        slots[-1] = -1
    idx = slots.to(DEVICE)
    qkv, q, k, v = qkv_views(gen, T)
    A_log, dt_bias = params(gen)
    snaps = torch.zeros(N + 1, draft, HV, V, K, device=DEVICE)
    args = dict(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=_rnd(gen, T, HV * K), b=_rnd(gen, 1, T, HV),
                ssm_states=pool_for(gen, N + 1), cache_indices=idx,
                query_start_loc=torch.arange(0, T + 1, draft, dtype=torch.int32, device=DEVICE),
                intermediate_states_buffer=snaps,
                intermediate_state_indices=torch.arange(N + 1, dtype=torch.int32, device=DEVICE).clamp_max(N),
                cache_steps=draft,
                retrieve_parent_token=(torch.tensor([top2_parents(draft)] * N, dtype=torch.int32, device=DEVICE)
                                       if tree else None),
                lower_bound=None)
    return args, idx


# ---------------------------------------------------------------------------------------------
# Checks and timings
# ---------------------------------------------------------------------------------------------
MUTATED = ("ssm_states", "intermediate_states_buffer", "track_state")


def clone_args(args):
    return {n: (t.clone() if n in MUTATED and t is not None else t) for n, t in args.items()}


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(name, method, peer, ours, args, live_rows, tol, results):
    """One call each on copies of the mutated buffers; outputs of live rows, pools, snapshots."""
    pa, oa = clone_args(args), clone_args(args)
    po, oo = getattr(peer, method)(**pa), getattr(ours, method)(**oa)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    errs = {"out": rel(oo[:, live_rows], po[:, live_rows])}
    live_slots = args["cache_indices"][args["cache_indices"] >= 0].long()
    if method != "target_verify":
        errs["pool"] = rel(oa["ssm_states"][live_slots], pa["ssm_states"][live_slots])
        others = torch.ones(args["ssm_states"].shape[0], dtype=torch.bool, device=DEVICE)
        others[live_slots] = False
        errs["other_slots_changed"] = 0.0 if torch.equal(oa["ssm_states"][others], args["ssm_states"][others]) else 1.0
    else:
        errs["pool_unchanged"] = 0.0 if torch.equal(oa["ssm_states"], args["ssm_states"]) else 1.0
        rows = args["intermediate_state_indices"][:live_slots.numel()].long()
        errs["snapshots"] = rel(oa["intermediate_states_buffer"][rows], pa["intermediate_states_buffer"][rows])
    if args.get("track_state") is not None:
        tracked = (args["track_chunk_idx"] >= 0).nonzero().flatten()
        if tracked.numel():
            errs["track_state"] = rel(oa["track_state"][tracked], pa["track_state"][tracked])
    ok = all(e <= tol for e in errs.values())
    results["checks"].append({"case": name, "ok": ok, **{k: round(v, 7) for k, v in errs.items()}})
    print(f"{'ok  ' if ok else 'FAIL'} {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    return ok


def time_both(name, method, peer, ours, make, bytes_per_call, results, harness, extra=None):
    """Graph-replayed µs per call over L independent layers (own pool and inputs each)."""
    L = harness.layers_for(bytes_per_call)
    ceiling = results["copy_ceiling_GBps"]
    layers = [make(seed) for seed in range(L)]
    for label, kernel in (("sglang", peer), ("kdakit", ours)):
        calls = [(lambda a=a: getattr(kernel, method)(**a)) for a, _ in layers]
        us = harness.graph_time_us(calls)
        results["rows"].append(harness.row(f"{name} {label}", us, bytes_per_call, ceiling, layers=L, **(extra or {})))
        print(f"{name:32s} {label:7s} {us:9.2f} us", flush=True)


def run_checks(k, peer, ours, results, decode_ns, verify_ns, extends, packed_kinds=(True, False)) -> bool:
    """Every call site once per size, kdakit's kernel against sglang's on the same arguments."""
    ok = True
    for N in decode_ns:
        for packed in packed_kinds:
            method = "packed_decode" if packed else "decode"
            a, idx = decode_case(N, 1, packed=packed, padded=True)
            live = (idx >= 0).nonzero().flatten().cpu()
            ok &= compare(f"{method} N={N}", method, peer, ours, a, live, 2e-2, results)
    for label, lens in extends:
        for graph in (False, True):
            a, _ = extend_case(lens, 2, graph=graph)
            if graph:
                cu = a["query_start_loc"][:len(lens) + 1]
                a.update(chunk_indices=k["chunk_indices"](cu, 64), chunk_offsets=k["chunk_offsets"](cu, 64))
            T = sum(lens)
            ok &= compare(f"extend {label} {'graph' if graph else 'eager'}", "extend", peer, ours, a,
                          torch.arange(T), 2e-2, results)
    for N in verify_ns:
        for tree, draft in ((False, 4), (True, 8)):
            a, idx = verify_case(N, draft, 3, tree=tree, padded=True)
            live_req = (idx >= 0).nonzero().flatten().cpu()
            live = (live_req[:, None] * draft + torch.arange(draft)).flatten()
            ok &= compare(f"target_verify {'tree8' if tree else 'chain4'} N={N}", "target_verify", peer, ours, a,
                          live, 2e-2, results)
    return ok


def cpu_interpret_checks() -> int:
    """The decode and verify checks on CPU tensors at tiny sizes, both sides' Triton kernels in
    Triton's interpreter: this script's argument patterns run where no GPU is. (sglang's packed
    decode and chunked extend kernels do not run in the interpreter of Triton 3.9.)"""
    global H, HV, K, V, STATE_BYTES, DEVICE
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--cpu-interpret needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return 2
    os.environ.setdefault("KDAKIT_BACKEND", "triton")
    H = HV = 2
    K = V = 16
    STATE_BYTES, DEVICE = HV * V * K * 4, "cpu"
    from kdakit.integrations.sglang import make_kernel_class
    k = peer_kernels()
    Peer = make_peer_class(k)
    results = {"checks": []}
    import triton
    from triton.runtime.errors import InterpreterError
    try:
        ok = run_checks(k, Peer(), make_kernel_class(Peer)(), results, [1, 3], [3], [], packed_kinds=(False,))
    except InterpreterError as err:
        print(f"sglang's Triton kernel does not run in Triton {triton.__version__}'s interpreter ({err})",
              file=sys.stderr)
        return 3
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-peer", action="store_true", help=f"write ./{PEER_DIR} from sglang 0.5.23's wheel and exit")
    ap.add_argument("--wheel", help="with --build-peer: a downloaded sglang 0.5.23 wheel (default: pip download)")
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes")
    ap.add_argument("--name", default="sglang_plugin_check")
    ap.add_argument("--cpu-interpret", action="store_true",
                    help="the checks only, at tiny sizes on the CPU (TRITON_INTERPRET=1 set before the run)")
    args = ap.parse_args(argv)
    if args.build_peer:
        print("built", build_peer(os.path.abspath(PEER_DIR), args.wheel))
        return 0
    if args.cpu_interpret:
        return cpu_interpret_checks()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from kdakit.bench import harness
    from kdakit.integrations.sglang import make_kernel_class
    try:
        k = peer_kernels()
    except ImportError as err:
        print(f"sglang's kernels do not import ({err}): run --build-peer and put {PEER_DIR} first on PYTHONPATH",
              file=sys.stderr)
        return 2
    Peer = make_peer_class(k)
    peer, ours = Peer(), make_kernel_class(Peer)()
    results = harness.new_results(sglang="0.5.23 (wheel kernels)", H=H, HV=HV, K=K, V=V,
                                  note="sglang's packed_decode timed on its Triton kernel; its CUDA JIT kernel "
                                       "(B >= 8, bf16) is not built in the peer")
    decode_ns = [1, 8, 64, 512] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    verify_ns = [8, 64] if args.quick else [1, 8, 64, 256]
    extends = [("1x8k", [8192]), ("8x2k", [2048] * 8)]

    ok = run_checks(k, peer, ours, results, decode_ns, verify_ns, extends)
    results["all_checks_ok"] = bool(ok)
    if not ok:
        print("checks failed: no timings", flush=True)
    else:
        for N in decode_ns:
            for packed in (True, False):
                method = "packed_decode" if packed else "decode"
                time_both(f"{method} N={N}", method, peer, ours,
                          lambda s, N=N, packed=packed: decode_case(N, s, packed=packed, padded=False),
                          2 * N * STATE_BYTES, results, harness, extra={"N": N})
        for label, lens in extends:
            def make(s, lens=lens):
                a, _ = extend_case(lens, s, graph=True)
                cu = a["query_start_loc"][:len(lens) + 1]
                a.update(chunk_indices=k["chunk_indices"](cu, 64), chunk_offsets=k["chunk_offsets"](cu, 64))
                return a, None
            T = sum(lens)
            time_both(f"extend {label}", "extend", peer, ours, make,
                      T * (2 * H * K + HV * V + HV * K) * 2 + 2 * len(lens) * STATE_BYTES, results, harness,
                      extra={"tokens": T})
        for N in verify_ns:
            for tree, draft in ((False, 4), (True, 8)):
                time_both(f"target_verify {'tree8' if tree else 'chain4'} N={N}", "target_verify", peer, ours,
                          lambda s, N=N, draft=draft, tree=tree: verify_case(N, draft, s, tree=tree, padded=False),
                          (1 + draft) * N * STATE_BYTES, results, harness, extra={"N": N, "nodes": draft})
    harness.close_results(results)
    print("wrote", harness.save(results, args.name, harness.results_folder(__file__)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
