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
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t
    torch.empty = lambda *args, **kwargs: poisoned(empty(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: poisoned(empty_like(*args, **kwargs))
