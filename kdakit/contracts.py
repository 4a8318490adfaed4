"""Input contracts of every op, in one place.

Each ``check_*`` runs before anything is launched or written and raises
``ValueError`` with the exact text of SPEC.md (our public contract). Checks that
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


def env_flag(name: str) -> str:
    """An environment variable, read on every call (tests and users flip them at run
    time) but through os.environ's own dict: ``os.environ.get`` costs ~1 µs a call,
    which the eager decode path cannot afford."""
    data = getattr(os.environ, "_data", None)
    if data is not None:
        raw = data.get(os.environ.encodekey(name))
        return "" if raw is None else os.environ.decodevalue(raw)
    return os.environ.get(name, "")


def full_checks_enabled(full_checks: bool | None = None) -> bool:
    if full_checks is not None:
        return full_checks
    return env_flag("KDAKIT_CHECKS").lower() == "full"


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


# ----------------------------------------------------------------------------
# Packed decode
# ----------------------------------------------------------------------------
def check_packed_decode(mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices, *,
                        lower_bound=None, helion=False, full_checks=None) -> int:
    """The sglang packed-decode contract, in its order. Returns H."""
    if not (mixed_qkv.dim() == 2):
        raise ValueError(f"`mixed_qkv` must be a 2D tensor (got ndim={mixed_qkv.dim()}).")
    if not (mixed_qkv.stride(-1) == 1):
        raise ValueError("`mixed_qkv` must be contiguous in the last dim.")
    if not (a.dim() == 2 and b.dim() == 2):
        raise ValueError(f"`a` and `b` must be 2D tensors (got a.ndim={a.dim()}, b.ndim={b.dim()}).")
    if not (a.stride(-1) == 1 and b.stride(-1) == 1):
        raise ValueError("`a`/`b` must be contiguous in the last dim.")
    if not (A_log.dim() == 1 and dt_bias.dim() == 1):
        raise ValueError("`A_log`/`dt_bias` must be 1D tensors.")
    if not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        raise ValueError("`A_log`/`dt_bias` must be contiguous.")
    if not (ssm_state_indices.dim() == 1):
        raise ValueError(f"`ssm_state_indices` must be 1D for packed decode (got ndim={ssm_state_indices.dim()}).")
    if not (out.is_contiguous()):
        raise ValueError("`out` must be contiguous.")
    check_same_device(mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices)
    B = mixed_qkv.shape[0]
    if not (a.shape[0] == B and b.shape[0] == B):
        raise ValueError(f"Mismatched batch sizes: mixed_qkv.shape[0]={B}, a.shape[0]={a.shape[0]}, b.shape[0]={b.shape[0]}.")
    if not (_shape(ssm_state_indices) == (B,)):
        raise ValueError(f"`ssm_state_indices` must have shape [B] (got {_shape(ssm_state_indices)}; expected ({B},)).")
    if not (initial_state.dim() == 4):
        raise ValueError(f"`initial_state` must be a 4D tensor (got ndim={initial_state.dim()}).")
    if not (initial_state.stride(-1) == 1):
        raise ValueError("`initial_state` must be contiguous in the last dim.")
    _, HV, V, K = initial_state.shape
    if helion:
        if not (K & (K - 1) == 0 and V & (V - 1) == 0):
            raise ValueError(f"Helion KDA decode requires power-of-two key and value head dimensions (got K={K}, V={V}).")
    if not (_shape(a) == (B, HV * K)):
        raise ValueError(f"`a` must have shape [B, HV*K] with HV={HV}, K={K} (got a.shape={_shape(a)}).")
    if not (_shape(b) == (B, HV)):
        raise ValueError(f"`b` must have shape [B, HV] with HV={HV} (got b.shape={_shape(b)}).")
    if not (A_log.numel() == HV):
        raise ValueError(f"`A_log` must have {HV} elements (got {A_log.numel()}).")
    if not (dt_bias.numel() == HV * K):
        raise ValueError(f"`dt_bias` must have {HV * K} elements (got {dt_bias.numel()}).")
    if not (_shape(out) == (B, 1, HV, V)):
        raise ValueError(f"`out` must have shape {(B, 1, HV, V)} (got out.shape={_shape(out)}).")
    qk_dim = mixed_qkv.shape[1] - HV * V
    if not (qk_dim > 0 and qk_dim % 2 == 0):
        raise ValueError(f"Invalid packed `mixed_qkv` last dim={mixed_qkv.shape[1]} for HV={HV}, V={V}.")
    q_dim = qk_dim // 2
    if not (q_dim % K == 0):
        raise ValueError(f"Invalid packed Q size {q_dim}: must be divisible by K={K}. KDA packed decode requires "
                     "num_q_heads == num_k_heads and head_q_dim == head_k_dim.")
    H = q_dim // K
    if not (H > 0 and HV % H == 0):
        raise ValueError(f"Invalid head config inferred from mixed_qkv: H={H}, HV={HV}.")
    # Beyond the sglang contract: what a kernel would otherwise silently get wrong.
    check_state_pool(initial_state)
    check_head_dims(K, V)
    check_float_dtypes(mixed_qkv=mixed_qkv, a=a, b=b, out=out, A_log=A_log, dt_bias=dt_bias)
    check_index_dtype("ssm_state_indices", ssm_state_indices)
    check_lower_bound(lower_bound)
    if full_checks_enabled(full_checks):
        check_slot_values("ssm_state_indices", ssm_state_indices, initial_state.shape[0], full_checks=True)
        check_finite(True, A_log=A_log, dt_bias=dt_bias)
    return H
