"""Run the ring verify a few times at one size, for ncu:

    ncu --clock-control none --kernel-name regex:_ring_verify ... \\
        python benchmarks/profile_ring_verify.py N T [precision BVxW k_chunk stages]
"""
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mtp import SWEEP_CONFIGS, make_layer, verify_call  # noqa: E402
from kdakit.ops.mtp_verify import mtp_verify_config  # noqa: E402

N, T = int(sys.argv[1]), int(sys.argv[2])


def ring_config(ring):
    if len(sys.argv) <= 3:
        return ring
    block_v, warps = (int(x) for x in sys.argv[4].split("x"))
    return replace(ring, dot_precision=sys.argv[3], state_block_v=block_v, state_warps=warps,
                   k_chunk=int(sys.argv[5]), num_stages=int(sys.argv[6]))


# the chunk form at any batch, with the given state-kernel config
SWEEP_CONFIGS["verify"] = lambda *shapes: (lambda c: replace(c, ring_form="chunked", ring=ring_config(c.ring)))(
    mtp_verify_config(*shapes))
L = make_layer(N, T, conv=False, mode="ring")
for _ in range(3):
    verify_call(L)()
torch.cuda.synchronize()
