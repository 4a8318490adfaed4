"""The check primitives the ops' input contracts are built from.

Each op's contract (``check_<op>``) sits in its op module, ``kdakit/ops/<op>.py``, and
is made of these: each runs before anything is launched or written and raises
``ValueError`` with the exact texts of our public contract. Checks that
read tensor data (slot range, duplicate live slots, non-finite parameters) cost a
device sync, so they run only in full-check mode: ``KDAKIT_CHECKS=full`` or
``full_checks=True``. Shape-only checks never sync, so CUDA graphs and
``torch.compile`` stay clean.
"""
from __future__ import annotations

import os

import torch

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


# os.environ's own mapping (CPython: encoded keys to encoded values), read directly: a missing
# variable through os.environ.get raises and catches a KeyError inside the Mapping protocol,
# several µs a read on a slow host, and an eager call reads three or four.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS: dict[str, object] = {}


def env_flag(name: str) -> str:
    """An environment variable ("" when unset), read on every call: tests and users flip them
    at run time (``os.environ[...] = ...`` and ``monkeypatch.setenv`` write the mapping read here)."""
    if _ENV_DATA is None:
        return os.environ.get(name, "")
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    value = _ENV_DATA.get(key)
    return "" if value is None else os.environ.decodevalue(value)


def full_checks_enabled(full_checks: bool | None = None) -> bool:
    """Whether the data checks run. Under ``torch.compile`` tracing the tensors are fake
    (no values to read): an explicit ``full_checks=True`` raises, while the
    ``KDAKIT_CHECKS=full`` default is skipped (shape checks still run at trace time)."""
    if full_checks is not None:
        enabled = bool(full_checks)
    else:
        enabled = env_flag("KDAKIT_CHECKS").lower() == "full"
    if enabled and torch.compiler.is_compiling():
        if full_checks:
            raise ValueError("full_checks=True reads tensor values and cannot run under torch.compile tracing; "
                             "run the op eagerly for full checks, or leave full_checks unset (the "
                             "KDAKIT_CHECKS=full default is skipped while compiling).")
        return False
    return enabled


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


# ----------------------------------------------------------------------------
# Checks shared by the ops
# ----------------------------------------------------------------------------
def check_same_device(*tensors) -> None:
    first = tensors[0].device
    if not all(t.device == first for t in tensors if t is not None):
        raise ValueError("All inputs must be on the same device.")


def check_state_pool(state: torch.Tensor, name: str = "initial_state") -> None:
    """A pool ``[slots, HV, V, K]`` whose inner three dims are contiguous (any slot stride)."""
    if not (state.dim() == 4):
        raise ValueError(f"`{name}` must be a 4D tensor (got ndim={state.dim()}).")
    if not (state.stride(-1) == 1):
        raise ValueError(f"`{name}` must be contiguous in the last dim.")
    _, HV, V, K = state.shape
    if not (state.stride(2) == K and state.stride(1) == V * K and state.stride(0) >= HV * V * K):
        raise ValueError(f"`{name}` must have contiguous inner dims [HV, V, K] and a slot stride >= HV*V*K "
                     f"(got strides {tuple(state.stride())} for shape {_shape(state)}).")
    if not (state.dtype in STATE_DTYPES):
        raise ValueError(f"`{name}` must be float32, bfloat16 or float16 (got {state.dtype}).")


def check_head_dims(K: int, V: int) -> None:
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"KDA head dims must be in [1, {MAX_HEAD_DIM}] (got K={K}, V={V}).")


def check_float_dtype(name: str, t: torch.Tensor, allowed=ACTIVATION_DTYPES) -> None:
    if not (t.dtype in allowed):
        raise ValueError(f"`{name}` must have a floating dtype in "
                     f"{[str(d).replace('torch.', '') for d in allowed]} (got {t.dtype}).")


def check_float_dtypes(**tensors) -> None:
    for name, t in tensors.items():
        if t.dtype not in ACTIVATION_DTYPES:
            check_float_dtype(name, t)


def check_index_dtype(name: str, t: torch.Tensor) -> None:
    if not (t.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"`{name}` must be an int32 or int64 tensor (got {t.dtype}).")


def check_slot_values(name: str, slot_indices: torch.Tensor, num_slots: int, *, full_checks=None) -> None:
    """Data checks (one sync): live slots in range and distinct within the batch."""
    if not full_checks_enabled(full_checks):
        return
    live = slot_indices[slot_indices >= 0]
    if live.numel() == 0:
        return
    top = int(live.max())
    if not (top < num_slots):
        raise ValueError(f"`{name}` holds slot {top}, out of range for a pool of {num_slots} slots.")
    if not (torch.unique(live).numel() == live.numel()):
        raise ValueError(f"`{name}` holds the same live slot twice in one batch; each request needs its own slot.")


def check_rows_in_range(name: str, rows: torch.Tensor, num_rows: int, what: str) -> None:
    """Data check (one sync): every row index of live requests in ``[0, num_rows)``."""
    if rows.numel() == 0:
        return
    low, top = int(rows.min()), int(rows.max())
    if not (low >= 0 and top < num_rows):
        raise ValueError(f"`{name}` holds {what} {low if low < 0 else top} for a live request, out of range "
                         f"for buffers of {num_rows} {what}s.")


def check_finite(full_checks, **params) -> None:
    if not full_checks_enabled(full_checks):
        return
    for name, t in params.items():
        if t is not None:
            if not (bool(torch.isfinite(t).all())):
                raise ValueError(f"`{name}` holds non-finite values (NaN or inf).")


def check_lower_bound(lower_bound) -> None:
    if lower_bound is not None:
        if not (-5.0 <= float(lower_bound) < 0.0):
            raise ValueError(f"`lower_bound` must be in [-5, 0) for the safe gate (got {lower_bound}).")


def check_gate_inputs(a, b, A_log, dt_bias, B: int, HV: int, K: int) -> None:
    """Raw gate ``a [B, HV*K]``, raw beta ``b [B, HV]``, ``A_log [HV]``, ``dt_bias [HV*K]`` (SPEC texts)."""
    if not (_shape(a) == (B, HV * K)):
        raise ValueError(f"`a` must have shape [B, HV*K] with HV={HV}, K={K} (got a.shape={_shape(a)}).")
    if not (_shape(b) == (B, HV)):
        raise ValueError(f"`b` must have shape [B, HV] with HV={HV} (got b.shape={_shape(b)}).")
    if not (A_log.numel() == HV):
        raise ValueError(f"`A_log` must have {HV} elements (got {A_log.numel()}).")
    if not (dt_bias.numel() == HV * K):
        raise ValueError(f"`dt_bias` must have {HV * K} elements (got {dt_bias.numel()}).")


# ----------------------------------------------------------------------------
# Short conv windows and strided layouts
# ----------------------------------------------------------------------------
MAX_CONV_WIDTH = 8


def check_dim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if not (t.dim() == ndim):
        raise ValueError(f"`{name}` must be a {ndim}D tensor {layout} (got ndim={t.dim()}, shape={_shape(t)}).")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if not (t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1):
        raise ValueError(f"`{name}` must be contiguous in the last dim (got strides {tuple(t.stride())}).")


def check_shape(name: str, t: torch.Tensor, expected: tuple, layout: str) -> None:
    if not (_shape(t) == tuple(expected)):
        raise ValueError(f"`{name}` must have shape {layout} = {tuple(expected)} (got {_shape(t)}).")


def check_non_overlapping(name: str, t: torch.Tensor) -> None:
    """Every element at its own address (a kernel that writes ``t`` in place would race otherwise)."""
    dims = sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1)
    span = 1
    for stride, size in dims:
        if not (stride >= span):
            raise ValueError(f"`{name}` has overlapping elements (strides {tuple(t.stride())} for shape "
                             f"{_shape(t)}); it is written in place, so each element needs its own memory.")
        span = stride * size


def check_conv_weight(name: str, weight: torch.Tensor, channels: int) -> int:
    """``weight [C, W]`` float32 contiguous, ``2 <= W <= MAX_CONV_WIDTH``. Returns W."""
    check_dim(name, weight, 2, "[C, W]")
    if not (weight.shape[0] == channels):
        raise ValueError(f"`{name}` must have shape [C, W] with C={channels} channels (got {_shape(weight)}).")
    W = weight.shape[1]
    if not (2 <= W <= MAX_CONV_WIDTH):
        raise ValueError(f"`{name}` must have a conv width W in [2, {MAX_CONV_WIDTH}] (got W={W}).")
    if not (weight.dtype == torch.float32):
        raise ValueError(f"`{name}` must be float32 (got {weight.dtype}).")
    if not (weight.is_contiguous()):
        raise ValueError(f"`{name}` must be contiguous (got strides {tuple(weight.stride())}).")
    return W


def check_conv_bias(name: str, bias, channels: int) -> None:
    if bias is None:
        return
    if not (bias.dim() == 1 and bias.shape[0] == channels):
        raise ValueError(f"`{name}` must have shape [C] = ({channels},) (got {_shape(bias)}).")
    if not (bias.dtype == torch.float32):
        raise ValueError(f"`{name}` must be float32 (got {bias.dtype}).")
    if not (bias.is_contiguous()):
        raise ValueError(f"`{name}` must be contiguous.")


def check_conv_pool(name: str, conv_state: torch.Tensor, channels: int, width: int) -> None:
    """A window pool ``[slots, C, W-1]`` with any (non-overlapping) strides: a pool stored
    as ``[slots, W-1, C]`` and passed as ``.transpose(1, 2)`` is valid."""
    check_dim(name, conv_state, 3, "[slots, C, W-1]")
    if not (conv_state.shape[1:] == (channels, width - 1)):
        raise ValueError(f"`{name}` must have shape [slots, C, W-1] with C={channels}, W-1={width - 1} "
                         f"(got {_shape(conv_state)}).")
    if not (conv_state.dtype in STATE_DTYPES):
        raise ValueError(f"`{name}` must be float32, bfloat16 or float16 (got {conv_state.dtype}).")
    check_non_overlapping(name, conv_state)


def check_slot_indices(name: str, slot_indices: torch.Tensor, batch: int) -> None:
    if not (slot_indices.dim() == 1 and slot_indices.shape[0] == batch):
        raise ValueError(f"`{name}` must have shape [B] (got {_shape(slot_indices)}; expected ({batch},)).")
    check_index_dtype(name, slot_indices)
