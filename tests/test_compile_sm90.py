"""Every kernel variant the ops launch compiles for the H200 (sm_90), checked on a CPU.

The interpreter runs code the compiler rejects (a loop-carried variable changing type,
say), so interpreter tests alone can pass while the GPU build fails. Compile-only mode
(kdakit/ops/launch.py) builds each launch for sm_90 with Triton's own compiler and ptxas.

``EXPECTED`` holds every kernel an op module wraps in a ``CachedKernel``, so a new kernel
is expected here without an entry of its own.
"""
import importlib
import os
import pkgutil
import subprocess
import sys

EXPECTED = {"_packed_decode_kernel", "_fused_decode_kernel", "_causal_conv1d_update_kernel",
            "_causal_conv1d_varlen_kernel", "_gated_rmsnorm_kernel",
            "_mtp_verify_kernel", "_ring_verify_steps_kernel", "_ring_verify_state_kernel", "_verify_conv_kernel",
            "_commit_ring_kernel", "_gather_copy_kernel", "_recurrent_forward_kernel"}
EXPECTED |= {"_tree_verify_kernel", "_tree_conv_kernel", "_commit_tree_ring_kernel"}
EXPECTED |= {"_chunk_prep_kernel", "_chunk_state_kernel"}


def defined_kernels() -> set[str]:
    """The kernels of every ``CachedKernel`` at module level in ``kdakit.ops``."""
    import kdakit.ops
    from kdakit.ops.launch import CachedKernel
    names = set()
    for info in pkgutil.iter_modules(kdakit.ops.__path__):
        module = importlib.import_module(f"kdakit.ops.{info.name}")
        names |= {v.fn.__name__ for v in vars(module).values() if isinstance(v, CachedKernel)}
    return names


EXPECTED |= defined_kernels()


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KDAKIT_BACKEND")}
    env["KDAKIT_COMPILE_ONLY"] = "sm_90"
    script = os.path.join(os.path.dirname(__file__), "compile_sm90_script.py")
    run = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    compiled = run.stdout.strip().splitlines()[-1].split()
    assert EXPECTED <= set(compiled), f"not compiled: {EXPECTED - set(compiled)}"
