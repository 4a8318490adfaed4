import os

# Kernels are jitted at import: the interpreter must be chosen before kdakit loads.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="run every test: the default suite plus the sweeps marked `exhaustive` (what CI runs)")


def pytest_collection_modifyitems(config, items):
    """The default suite leaves out the tests marked ``exhaustive`` (the long tails of the
    parameter sweeps: helpers.sweep marks all but a sweep's first values, and whole tests
    carry the mark). ``--exhaustive`` runs everything; so does a ``-m`` expression that
    names the marker (``-m exhaustive`` runs only the sweeps' tails); a test named on the
    command line by its whole id (``file.py::test[params]``) runs too."""
    if config.getoption("--exhaustive") or "exhaustive" in (config.getoption("markexpr") or ""):
        return
    named = {(os.path.abspath(path), rest) for path, _, rest in (a.partition("::") for a in config.args) if rest}
    keep, drop = [], []
    for item in items:
        whole_id = (str(item.path), item.nodeid.partition("::")[2])
        (drop if item.get_closest_marker("exhaustive") and whole_id not in named else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
