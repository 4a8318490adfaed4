"""Run one verify a few times at one size, for ncu (the conv prologue, the recurrence):

    ncu --clock-control none --kernel-name regex:_verify_conv ... \\
        python benchmarks/profile_verify.py N T {ring,snapshot} {0,1: the short conv}
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mtp import make_layer, verify_call  # noqa: E402

N, T, mode, conv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], bool(int(sys.argv[4]))
L = make_layer(N, T, conv=conv, mode=mode)
for _ in range(3):
    verify_call(L)()
torch.cuda.synchronize()
