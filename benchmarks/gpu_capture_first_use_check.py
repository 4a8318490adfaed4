"""GPU check: device buffers that kdakit caches (the fla drop-in's identity slots, the
arrival counters of the one-kernel fused step) first needed while a CUDA graph is captured.

    python benchmarks/gpu_capture_first_use_check.py

What a buffer's fill kernel does during a capture is only recorded, so a buffer made then
must not be kept for later calls. For each op, with the caches emptied: capture the call in
two graphs (the buffer first needed in the first), run it eagerly (before any replay), replay
the second graph, then the first: each must equal the same call made with buffers built
outside any capture, bitwise. Exits 1 when a check fails. Needs CUDA.
"""
from __future__ import annotations

import sys

import torch

from kdakit.compat.fla import fused_recurrent_kda
from kdakit import buffers
from kdakit.ops.fused_decode import FusedDecodeConfig, fused_decode_triton

DEV = "cuda"


def recurrent_forward_case():
    g = torch.Generator(device=DEV).manual_seed(0)
    N, H, K, V = 8, 32, 128, 128
    rnd = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    q, k = rnd(1, N, H, K).bfloat16(), rnd(1, N, H, K).bfloat16()
    v, gate, beta = rnd(1, N, H, V).bfloat16(), rnd(1, N, H, K).bfloat16(), rnd(1, N, H).bfloat16()
    A_log, dt_bias = torch.rand(H, device=DEV, generator=g), rnd(H * K) * 0.5
    h0 = rnd(N, H, K, V) * 0.5
    cu = torch.arange(N + 1, device=DEV)
    kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    def call(**extra):
        o, ht = fused_recurrent_kda(q, k, v, gate, beta, **kw, **extra)
        return [o, ht]
    # the same call with its slots given (no cached buffer): what every run must equal
    expected = [t.clone() for t in call(ssm_state_indices=torch.arange(N, device=DEV, dtype=torch.int32))]
    return call, expected, lambda: buffers._KEPT.clear()


def fused_step_case():
    g = torch.Generator(device=DEV).manual_seed(1)
    B, H, K, V, W = 2, 32, 128, 128, 4
    C = 2 * H * K + H * V
    rnd = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    qkv, a, b = rnd(B, C).bfloat16(), rnd(B, H * K).bfloat16(), rnd(B, H).bfloat16()
    conv_weight, A_log, dt_bias = rnd(C, W) * 0.5, torch.rand(H, device=DEV, generator=g), rnd(H * K) * 0.5
    conv0, state0 = rnd(4, C, W - 1).bfloat16(), rnd(4, H, V, K) * 0.5
    idx = torch.tensor([2, 0], device=DEV, dtype=torch.int32)
    gate, weight = rnd(B, H * V).bfloat16(), torch.rand(V, device=DEV, generator=g) + 0.5
    conv, state, out = conv0.clone(), state0.clone(), torch.empty(B, 1, H, V, device=DEV, dtype=torch.bfloat16)

    def call():
        conv.copy_(conv0)
        state.copy_(state0)
        # V over several programs per head: the arrival counters are used
        fused_decode_triton(qkv, conv_weight, conv, a, b, A_log, dt_bias, state, idx, out, conv_bias=None,
                            scale=K ** -0.5, lower_bound=None, norm_gate=gate, norm_weight=weight, norm_eps=1e-6,
                            config=FusedDecodeConfig(block_v=16, v_tiles=1, num_warps=1), pdl=False)
        return [out, state, conv]
    expected = [t.clone() for t in call()]
    return call, expected, lambda: buffers._KEPT.clear()


def run(name, case) -> bool:
    call, expected, empty_cache = case()
    torch.cuda.synchronize()
    empty_cache()
    # The caches are kept per (device, stream): the captures and the eager call share one stream.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs, captured = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    for graph in graphs:  # the buffer first needed in the first
        with torch.cuda.graph(graph, stream=stream):
            captured.append(call())
    with torch.cuda.stream(stream):
        results = {"eager-after-captures": [t.clone() for t in call()]}  # before any replay
    torch.cuda.synchronize()
    for i in (1, 0):  # the second graph replayed before the first ever was
        graphs[i].replay()
        torch.cuda.synchronize()
        results[f"replay-graph-{i}"] = [t.clone() for t in captured[i]]
    ok = True
    for what, got in results.items():
        same = all(torch.equal(x, y) for x, y in zip(got, expected))
        ok &= same
        print(f"{name:<22} {what:<22} {'ok' if same else 'DIFFERS'}")
    return ok


def main() -> int:
    ok = run("fla drop-in", recurrent_forward_case) & run("one-kernel fused step", fused_step_case)
    print("all checks ok" if ok else "CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
