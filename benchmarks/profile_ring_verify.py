"""Run the ring verify a few times at one size, for ncu:

    ncu --clock-control none --kernel-name regex:_ring_verify ... \\
        python benchmarks/profile_ring_verify.py N T ['field=value,...']

The chunk form at any batch; the optional third argument: RingVerifyConfig fields changed
from the op's pick (harness.parse_configs syntax, one config), e.g.
``'state_block_v=32,state_warps=2,k_chunk=128,num_stages=1'``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mtp import SWEEP_CONFIGS, make_layer, sweep_groups, verify_call, verify_with  # noqa: E402
from kdakit.ops.ring_verify import RingVerifyConfig  # noqa: E402

N, T = int(sys.argv[1]), int(sys.argv[2])
groups = sweep_groups(sys.argv[3] if len(sys.argv) > 3 else None, RingVerifyConfig)
if len(groups) > 1:
    sys.exit("one config at a time")
SWEEP_CONFIGS["verify"] = verify_with(ring=groups[0] if groups else None, form="chunked")
L = make_layer(N, T, conv=False, mode="ring")
for _ in range(3):
    verify_call(L)()
torch.cuda.synchronize()
