"""Random inputs, poisoning and comparisons shared by the tests."""
from __future__ import annotations

import torch

POISON = 1e30


def sweep(values, keep=1, *, unpack=True):
    """A parametrize list whose first ``keep`` values (or those at the indices ``keep`` lists)
    run in the default suite and the rest only with ``--exhaustive`` (marked ``exhaustive``;
    see conftest.py). Ids stay as they were: a ``pytest.param`` keeps its id and marks, a plain
    value its generated id. A plain tuple is one value per argname (as ``parametrize`` reads
    it for several argnames); ``unpack=False`` for one argname whose values are tuples."""
    import pytest
    from _pytest.mark.structures import ParameterSet

    kept = range(keep) if isinstance(keep, int) else set(keep)
    out = []
    for i, v in enumerate(values):
        if i in kept:
            out.append(v)
        elif isinstance(v, ParameterSet):
            out.append(pytest.param(*v.values, marks=(*v.marks, pytest.mark.exhaustive), id=v.id))
        else:
            out.append(pytest.param(*(v if unpack and isinstance(v, tuple) else (v,)), marks=pytest.mark.exhaustive))
    return out


def nan_filled(make):
    """``make`` (``torch.empty`` or ``torch.empty_like``) whose floating tensors start as NaN: a
    kernel that reads a workspace entry nothing wrote turns its outputs non-finite."""
    def poisoned(*args, **kwargs):
        t = make(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return poisoned


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(out, ref, tol, what="output"):
    err = rel_err(out, ref)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.1e}"


def tol_for(*dtypes) -> float:
    """float32 everywhere lands far under 1e-5; any 16-bit tensor in the chain ~1e-3..1e-2."""
    return 1e-5 if all(d == torch.float32 for d in dtypes) else 2e-2


def random_pool(slots, HV, V, K, dtype, *, slot_stride=None, generator=None):
    """A state pool with random contents; ``slot_stride`` > HV*V*K gives an interleaved pool."""
    inner = HV * V * K
    stride = slot_stride or inner
    flat = torch.randn(slots * stride, generator=generator).mul_(0.5).to(dtype)
    return flat.as_strided((slots, HV, V, K), (stride, V * K, K, 1))


def pick_slots(num_slots, batch, num_padding=0, generator=None):
    """Distinct random slots, with ``num_padding`` rows set to -1 at random places."""
    slots = torch.randperm(num_slots, generator=generator)[:batch].to(torch.int32)
    if num_padding:
        pad_rows = torch.randperm(batch, generator=generator)[:num_padding]
        slots[pad_rows] = -1
    return slots


def untouched_slots(num_slots, slot_indices):
    used = set(int(s) for s in slot_indices if int(s) >= 0)
    return [s for s in range(num_slots) if s not in used]


def kda_params(HV, K, *, dtype=torch.float32, generator=None):
    A_log = torch.rand(HV, generator=generator).mul(2.0).sub(1.0).to(dtype)
    dt_bias = torch.randn(HV * K, generator=generator).mul(0.5).to(dtype)
    return A_log, dt_bias


def setter(name, fn):
    """A breaker for error-contract tables: replaces input ``name`` with ``fn(input)``."""
    def brk(t):
        t[name] = fn(t[name])
    return brk


def noncontig_last(x):
    """``x``'s values in a view whose last dim has stride 2."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]



# Ring mode's forms a test forces whatever the batch (tests use tiny batches): the recurrence,
# the chunk form, and the chunk form whose state kernel forms its products from the inputs.
RING_FORMS = ["chunked", "chunked-from-inputs", "recurrent"]


def with_ring_form(config, form: str):
    """A verify config (mtp_verify_config's or tree_verify_config's) with ring mode's ``form``."""
    import dataclasses
    return dataclasses.replace(config, ring_form="recurrent" if form == "recurrent" else "chunked",
                               ring=dataclasses.replace(config.ring, state_from_inputs=form == "chunked-from-inputs"))
