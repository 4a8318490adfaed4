"""Run the ring verify a few times at one size, for ncu:

    ncu --clock-control none --kernel-name regex:_ring_verify ... \\
        python benchmarks/profile_ring_verify.py N T [precision BVxW k_chunk stages]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mtp import make_layer, verify_call  # noqa: E402
from kdakit.ops import mtp_verify, ring_verify  # noqa: E402

N, T = int(sys.argv[1]), int(sys.argv[2])
mtp_verify.RING_CHUNK_FORM_ABOVE = 0  # the chunk form at any batch
if len(sys.argv) > 3:
    ring_verify.DOT_PRECISION = sys.argv[3]
    ring_verify.STATE_TILE = tuple(int(x) for x in sys.argv[4].split("x"))
    ring_verify.K_CHUNK, ring_verify.NUM_STAGES = int(sys.argv[5]), int(sys.argv[6])
L = make_layer(N, T, conv=False, mode="ring")
for _ in range(3):
    verify_call(L)()
torch.cuda.synchronize()
