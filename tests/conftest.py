import os

# Kernels are jitted at import: the interpreter must be chosen before kdakit loads.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """``KDAKIT_TEST_NAN_EMPTY=1``: every floating tensor ``torch.empty`` / ``torch.empty_like``
    makes starts as NaN (the ops' workspaces and scratch included), so a kernel that reads an
    entry nothing wrote turns its outputs non-finite and the test fails. Off by default: it
    costs a fill per allocation."""
    if os.environ.get("KDAKIT_TEST_NAN_EMPTY") != "1":
        return
    import torch
    from helpers import nan_filled
    torch.empty, torch.empty_like = nan_filled(torch.empty), nan_filled(torch.empty_like)
