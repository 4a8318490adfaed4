"""Input contracts of every op, in one place.

Each ``check_*`` runs before anything is launched or written and raises
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


def fail(message: str):
    """Raise the contract's ValueError (one place, so every op raises alike)."""
    raise ValueError(message)


def env_flag(name: str) -> str:
    """An environment variable, read on every call: tests and users flip them at run time
    (about 0.7 µs a read; an eager call reads two or three)."""
    return os.environ.get(name, "")


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
    check_gate_inputs(a, b, A_log, dt_bias, B, HV, K)
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


# ----------------------------------------------------------------------------
# Varlen recurrent forward
# ----------------------------------------------------------------------------
def _check_strided_states(name, t, shape, layout) -> None:
    """An output of per-token or per-sequence states: shape ``shape``, a state dtype."""
    if not (_shape(t) == tuple(shape)):
        raise ValueError(f"`{name}` must have shape {tuple(shape)} ({layout}) (got {_shape(t)}).")
    if not (t.dtype in STATE_DTYPES):
        raise ValueError(f"`{name}` must be float32, bfloat16 or float16 (got {t.dtype}).")


def check_recurrent_forward(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens=None, A_log=None,
                            dt_bias=None, lower_bound=None, num_accepted_tokens=None, token_states=None,
                            final_states=None, state_name="state", k_major=False, full_checks=None) -> int:
    """The varlen recurrent-forward contract. Returns N, the number of sequences.

    ``state`` is the pool as the caller passed it: ``[slots, HV, V, K]`` (V-major), or
    ``[slots, HV, K, V]`` when ``k_major`` (fla's default layout); ``token_states`` and
    ``final_states`` are in the same layout. The two varlen texts are fla's, exactly.
    """
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if not (t.dim() == nd):
            raise ValueError(f"`{name}` must be a {nd}D tensor (got ndim={t.dim()}).")
    B = q.shape[0]
    if cu_seqlens is not None:
        if not (B == 1):
            raise ValueError(f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`."
                             f"Please flatten variable-length inputs before processing.")
        if not (cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1):
            raise ValueError(f"`cu_seqlens` must be a 1D tensor of N+1 offsets (got shape {_shape(cu_seqlens)}).")
        check_index_dtype("cu_seqlens", cu_seqlens)
        N = cu_seqlens.numel() - 1
    else:
        if not (B == 1):
            raise ValueError(f"recurrent_forward takes one flattened batch [1, T, ...] (got batch size {B}). "
                             f"Reshape the inputs to [1, B*T, ...] and pass cu_seqlens = arange(0, B*T+1, T).")
        N = 1
    if not (slot_indices.dim() in (1, 2)):
        raise ValueError(f"`slot_indices` must be 1D [N] or 2D [N, T_max] (got ndim={slot_indices.dim()}).")
    if not (slot_indices.shape[0] == N):
        raise ValueError(f"The number of initial states is expected to be equal to the number of input sequences, "
                         f"i.e., {N} rather than {slot_indices.shape[0]}.")
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if not (_shape(k) == _shape(q)):
        raise ValueError(f"`k` must have the shape of `q` {_shape(q)} (got {_shape(k)}).")
    if not (v.shape[:2] == (1, T)):
        raise ValueError(f"`v` must have shape [1, T={T}, HV, V] (got {_shape(v)}).")
    if not (H > 0 and HV % H == 0):
        raise ValueError(f"The number of value heads must be a multiple of the key heads (got H={H}, HV={HV}).")
    if not (_shape(g) == (1, T, HV, K)):
        raise ValueError(f"`g` must have shape {(1, T, HV, K)} [1, T, HV, K] (got {_shape(g)}).")
    if not (_shape(beta) == (1, T, HV)):
        raise ValueError(f"`beta` must have shape {(1, T, HV)} [1, T, HV] (got {_shape(beta)}); "
                         "a per-value-channel (headwise) beta is not supported.")
    if not (_shape(out) == _shape(v)):
        raise ValueError(f"`out` must have the shape of `v` {_shape(v)} (got {_shape(out)}).")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("out", out)):
        if not (t.stride(-1) == 1):
            raise ValueError(f"`{name}` must be contiguous in the last dim.")
    check_head_dims(K, V)
    # The pool, in the caller's layout.
    layout = "[slots, HV, K, V]" if k_major else "[slots, HV, V, K]"
    if not (state.dim() == 4):
        raise ValueError(f"`{state_name}` must be a 4D tensor {layout} (got ndim={state.dim()}).")
    inner = (HV, K, V) if k_major else (HV, V, K)
    if not (tuple(state.shape[1:]) == inner):
        other = "state_v_first=True for a V-major pool" if k_major else "a V-major pool (transpose a K-major one)"
        raise ValueError(f"`{state_name}` must have shape {layout} with HV={HV}, "
                         f"{'K' if k_major else 'V'}={inner[1]}, {'V' if k_major else 'K'}={inner[2]} "
                         f"(got {_shape(state)}); pass {other}.")
    if not (state.stride(-1) == 1 and state.stride(2) == inner[2] and state.stride(1) == inner[1] * inner[2]
            and (state.shape[0] <= 1 or state.stride(0) >= HV * K * V)):
        raise ValueError(f"`{state_name}` must have contiguous inner dims [{layout[8:]} and a slot stride >= "
                         f"HV*K*V (got strides {tuple(state.stride())} for shape {_shape(state)}).")
    if not (state.dtype in STATE_DTYPES):
        raise ValueError(f"`{state_name}` must be float32, bfloat16 or float16 (got {state.dtype}).")
    if slot_indices.dim() == 2 and not (slot_indices.shape[1] >= 1):
        raise ValueError(f"2D `slot_indices` must have at least one column (got {_shape(slot_indices)}).")
    if num_accepted_tokens is not None:
        if not (slot_indices.dim() == 2):
            raise ValueError("`num_accepted_tokens` needs 2D `slot_indices` [N, T_max] (one slot per token); "
                             "with 1D indices each sequence starts from its own slot.")
        if not (_shape(num_accepted_tokens) == (N,)):
            raise ValueError(f"`num_accepted_tokens` must have shape ({N},) (got {_shape(num_accepted_tokens)}).")
        check_index_dtype("num_accepted_tokens", num_accepted_tokens)
    state_layout = (HV, K, V) if k_major else (HV, V, K)
    if token_states is not None:
        _check_strided_states("token_states", token_states, (T, *state_layout), layout.replace("slots", "T"))
    if final_states is not None:
        _check_strided_states("final_states", final_states, (N, *state_layout), layout.replace("slots", "N"))
    if A_log is not None:
        if dt_bias is None:
            raise ValueError("The gate in kernel (`A_log` given) needs `dt_bias` [HV*K] too.")
        if not (A_log.dim() == 1 and A_log.numel() == HV):
            raise ValueError(f"`A_log` must be a 1D tensor of {HV} elements (got shape {_shape(A_log)}).")
        if not (dt_bias.numel() == HV * K and dt_bias.is_contiguous()):
            raise ValueError(f"`dt_bias` must be a contiguous tensor of HV*K={HV * K} elements "
                             f"(got shape {_shape(dt_bias)}).")
        if not (A_log.is_contiguous()):
            raise ValueError("`A_log`/`dt_bias` must be contiguous.")
    elif dt_bias is not None or lower_bound is not None:
        raise ValueError("`dt_bias` and `lower_bound` belong to the gate in kernel: pass `A_log` (and the raw gate "
                         "as `g`), or pass the log-decay as `g` without them.")
    check_lower_bound(lower_bound)
    check_float_dtypes(q=q, k=k, v=v, g=g, beta=beta, out=out)
    if A_log is not None:
        check_float_dtypes(A_log=A_log, dt_bias=dt_bias)
    check_index_dtype("slot_indices", slot_indices)
    check_same_device(q, k, v, g, beta, state, slot_indices, out, cu_seqlens, A_log, dt_bias,
                      num_accepted_tokens, token_states, final_states)
    if full_checks_enabled(full_checks):
        _check_recurrent_forward_values(slot_indices, num_accepted_tokens, cu_seqlens, T, state.shape[0])
        check_finite(True, A_log=A_log, dt_bias=dt_bias)
    return N


def _check_recurrent_forward_values(slot_indices, num_accepted_tokens, cu_seqlens, T, num_slots) -> None:
    """Data checks (syncs): offsets, accepted counts, and the slots each sequence touches."""
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, T]
    if not (bounds[0] == 0 and all(a <= b for a, b in zip(bounds, bounds[1:])) and bounds[-1] <= T):
        raise ValueError(f"`cu_seqlens` must rise from 0 to at most T={T} (got {bounds}).")
    if slot_indices.dim() == 1:
        check_slot_values("slot_indices", slot_indices, num_slots, full_checks=True)
        return
    T_max = slot_indices.shape[1]
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    if not (max(lens, default=0) <= T_max):
        raise ValueError(f"2D `slot_indices` has {T_max} columns but a sequence has {max(lens)} tokens.")
    starts = [0] * len(lens)
    if num_accepted_tokens is not None:
        starts = [int(a) - 1 for a in num_accepted_tokens.tolist()]
        if not all(0 <= s < T_max for s in starts):
            raise ValueError(f"`num_accepted_tokens` must be in [1, {T_max}] (got {[s + 1 for s in starts]}).")
    rows = slot_indices.tolist()
    touched = []
    for row, start, n_tok in zip(rows, starts, lens):
        used = set(row[:n_tok]) | {row[start]}
        touched.extend(s for s in used if s >= 0)
    if touched and not (max(touched) < num_slots):
        raise ValueError(f"`slot_indices` holds slot {max(touched)}, out of range for a pool of {num_slots} slots.")
    if not (len(set(touched)) == len(touched)):
        raise ValueError("`slot_indices` holds the same live slot in two sequences of one batch; "
                         "each sequence needs its own slots.")


# ----------------------------------------------------------------------------
# Short conv, gated RMSNorm, fused decode (issue 5)
# ----------------------------------------------------------------------------
MAX_CONV_WIDTH = 8
MAX_NORM_DIM = 16384


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


def check_causal_conv1d_update(x, conv_state, weight, slot_indices, out, *, bias=None, full_checks=None) -> int:
    """``x [B, C]``, ``conv_state [slots, C, W-1]``, ``weight [C, W]``, ``out [B, C]`` (x's dtype). Returns W."""
    check_dim("x", x, 2, "[B, C]")
    check_last_dim_contiguous("x", x)
    check_float_dtype("x", x)
    check_same_device(x, conv_state, weight, slot_indices, out, bias)
    B, C = x.shape
    W = check_conv_weight("weight", weight, C)
    check_conv_bias("bias", bias, C)
    check_conv_pool("conv_state", conv_state, C, W)
    check_slot_indices("slot_indices", slot_indices, B)
    check_shape("out", out, (B, C), "[B, C]")
    check_last_dim_contiguous("out", out)
    if not (out.dtype == x.dtype):
        raise ValueError(f"`out` must have x's dtype {x.dtype}: post-conv values are rounded to the activation "
                         f"dtype (got {out.dtype}).")
    if full_checks_enabled(full_checks):
        check_slot_values("slot_indices", slot_indices, conv_state.shape[0], full_checks=True)
        check_finite(True, weight=weight, bias=bias)
    return W


def row_groups(shape: tuple, *tensors) -> tuple:
    """Rows of ``[..., D]`` tensors as ``(n_outer, n_inner, [(stride_outer, stride_inner) per tensor])``.

    The leading dims of every tensor must collapse into at most two strided groups at
    the same place (a contiguous ``[B, 1, HV, V]`` output and a gate sliced from a wider
    ``[B, HV*V + ...]`` projection both do). Returns None when they do not.
    """
    if any(n == 0 for n in shape[:-1]):
        return 0, 1, [(0, 0) for _ in tensors]
    lead = [d for d in range(len(shape) - 1) if shape[d] > 1]
    breaks = set()
    for t in tensors:
        for i in range(len(lead) - 1):
            outer, inner = lead[i], lead[i + 1]
            if t.stride(outer) != t.stride(inner) * t.shape[inner]:
                breaks.add(i)
    if len(breaks) > 1:
        return None
    if not lead:
        return 1, 1, [(0, 0) for _ in tensors]
    if breaks:
        cut = breaks.pop()
        outer_dims, inner_dims = lead[:cut + 1], lead[cut + 1:]
    else:
        outer_dims, inner_dims = [], lead
    n_outer = 1
    for d in outer_dims:
        n_outer *= shape[d]
    n_inner = 1
    for d in inner_dims:
        n_inner *= shape[d]
    strides = [(t.stride(outer_dims[-1]) if outer_dims else 0, t.stride(inner_dims[-1])) for t in tensors]
    return n_outer, n_inner, strides


def check_gated_rmsnorm(x, gate, weight, out, *, eps=1e-6, full_checks=None) -> tuple:
    """``x, gate, out [..., V]``, ``weight [V]`` float32. Returns ``row_groups`` of (x, gate, out)."""
    if not (x.dim() >= 1):
        raise ValueError(f"`x` must have at least 1 dim [..., V] (got ndim={x.dim()}).")
    V = x.shape[-1]
    for name, t in (("x", x), ("gate", gate), ("out", out)):
        check_float_dtype(name, t)
    check_same_device(x, gate, weight, out)
    if not (_shape(gate) == _shape(x)):
        raise ValueError(f"`gate` must have x's shape {_shape(x)} (got {_shape(gate)}).")
    if not (_shape(out) == _shape(x)):
        raise ValueError(f"`out` must have x's shape {_shape(x)} (got {_shape(out)}).")
    if not (weight.dim() == 1 and weight.shape[0] == V):
        raise ValueError(f"`weight` must have shape [V] = ({V},) (got {_shape(weight)}).")
    if not (weight.dtype == torch.float32):
        raise ValueError(f"`weight` must be float32 (got {weight.dtype}).")
    if not (weight.is_contiguous()):
        raise ValueError("`weight` must be contiguous.")
    if not (1 <= V <= MAX_NORM_DIM):
        raise ValueError(f"gated RMSNorm dim V must be in [1, {MAX_NORM_DIM}] (got V={V}).")
    for name, t in (("x", x), ("gate", gate), ("out", out)):
        check_last_dim_contiguous(name, t)
    check_non_overlapping("out", out)
    if not (float(eps) > 0.0):
        raise ValueError(f"`eps` must be > 0 (got {eps}).")
    groups = row_groups(_shape(x), x, gate, out)
    if groups is None:
        raise ValueError(f"the leading dims of `x`, `gate` and `out` (shape {_shape(x)}, strides "
                         f"{tuple(x.stride())}, {tuple(gate.stride())}, {tuple(out.stride())}) must collapse into "
                         "at most two strided row groups; pass .contiguous() copies of x and gate.")
    if full_checks_enabled(full_checks):
        check_finite(True, weight=weight)
    return groups


def check_fused_decode(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out, *,
                       conv_bias=None, lower_bound=None, norm_gate=None, norm_weight=None, norm_eps=1e-6,
                       full_checks=None) -> tuple:
    """The fused decode step. Returns ``(H, W)``."""
    check_dim("qkv", qkv, 2, "[B, 2*H*K + HV*V]")
    check_last_dim_contiguous("qkv", qkv)
    check_dim("a", a, 2, "[B, HV*K]")
    check_dim("b", b, 2, "[B, HV]")
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("b", b)
    if not (A_log.dim() == 1 and dt_bias.dim() == 1):
        raise ValueError(f"`A_log`/`dt_bias` must be 1D tensors (got A_log.ndim={A_log.dim()}, "
                         f"dt_bias.ndim={dt_bias.dim()}).")
    if not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        raise ValueError("`A_log`/`dt_bias` must be contiguous.")
    if (norm_gate is None) != (norm_weight is None):
        raise ValueError("the fused output norm needs both `norm_gate` and `norm_weight` "
                         f"(got norm_gate={'a tensor' if norm_gate is not None else None}, "
                         f"norm_weight={'a tensor' if norm_weight is not None else None}).")
    check_same_device(qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slot_indices, out,
                      conv_bias, norm_gate, norm_weight)
    B, D = qkv.shape
    if not (a.shape[0] == B and b.shape[0] == B):
        raise ValueError(f"Mismatched batch sizes: qkv.shape[0]={B}, a.shape[0]={a.shape[0]}, b.shape[0]={b.shape[0]}.")
    check_slot_indices("slot_indices", slot_indices, B)
    check_state_pool(state, "state")
    _, HV, V, K = state.shape
    check_head_dims(K, V)
    check_gate_inputs(a, b, A_log, dt_bias, B, HV, K)
    qk_dim = D - HV * V
    if not (qk_dim > 0 and qk_dim % 2 == 0):
        raise ValueError(f"Invalid packed `qkv` last dim={D} for HV={HV}, V={V}; expected 2*H*K + HV*V.")
    if not ((qk_dim // 2) % K == 0):
        raise ValueError(f"Invalid packed Q size {qk_dim // 2} in `qkv` (last dim={D}): must be divisible by K={K}.")
    H = qk_dim // 2 // K
    if not (HV % H == 0):
        raise ValueError(f"Invalid head config inferred from qkv: H={H}, HV={HV}.")
    W = check_conv_weight("conv_weight", conv_weight, D)
    check_conv_bias("conv_bias", conv_bias, D)
    check_conv_pool("conv_state", conv_state, D, W)
    if not (_shape(out) == (B, 1, HV, V)):
        raise ValueError(f"`out` must have shape {(B, 1, HV, V)} (got out.shape={_shape(out)}).")
    if not (out.is_contiguous()):
        raise ValueError("`out` must be contiguous.")
    if norm_gate is not None:
        if not (_shape(norm_gate) == (B, HV * V)):
            raise ValueError(f"`norm_gate` must have shape [B, HV*V] = ({B}, {HV * V}) (got {_shape(norm_gate)}).")
        check_last_dim_contiguous("norm_gate", norm_gate)
        check_float_dtype("norm_gate", norm_gate)
        if not (_shape(norm_weight) == (V,)):
            raise ValueError(f"`norm_weight` must have shape [V] = ({V},) (got {_shape(norm_weight)}).")
        if not (norm_weight.dtype == torch.float32):
            raise ValueError(f"`norm_weight` must be float32 (got {norm_weight.dtype}).")
        if not (norm_weight.is_contiguous()):
            raise ValueError("`norm_weight` must be contiguous.")
        if not (float(norm_eps) > 0.0):
            raise ValueError(f"`norm_eps` must be > 0 (got {norm_eps}).")
    check_float_dtypes(qkv=qkv, a=a, b=b, out=out, A_log=A_log, dt_bias=dt_bias)
    check_lower_bound(lower_bound)
    if full_checks_enabled(full_checks):
        check_slot_values("slot_indices", slot_indices, min(state.shape[0], conv_state.shape[0]), full_checks=True)
        check_finite(True, A_log=A_log, dt_bias=dt_bias, conv_weight=conv_weight, conv_bias=conv_bias,
                     norm_weight=norm_weight)
    return H, W


# ----------------------------------------------------------------------------
# Varlen short conv (the extend path)
# ----------------------------------------------------------------------------
CONV_ACTIVATIONS = ("silu", "swish", None)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two plain eager tensors share bytes (a conservative span test; False while
    tracing, where fake tensors have no memory)."""
    if torch.compiler.is_compiling() or type(a) is not torch.Tensor or type(b) is not torch.Tensor:
        return False
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        lo = t.storage_offset() * t.element_size()
        hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        return lo, hi
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_causal_conv1d_varlen(x, conv_state, weight, cu_seqlens, slot_indices, out, *, has_initial_state=None,
                               bias=None, activation="silu", full_checks=None) -> int:
    """``x [T, C]`` (any strides), ``conv_state [slots, C, W-1]`` (any non-overlapping strides),
    ``weight [C, W]`` float32, ``cu_seqlens [N+1]``, ``slot_indices [N]``, ``has_initial_state [N]``
    bool, ``bias [C]`` float32, ``out [T, C]`` in x's dtype (any non-overlapping strides, not
    sharing memory with x). Returns W.

    The values of ``cu_seqlens`` (0 first, never decreasing, T last) and the slot range are data:
    reading them is a device sync, so they are checked in full-check mode only (by default a
    slot outside the pool is padding, and the kernel never reads outside the offsets' buffers).
    """
    check_dim("x", x, 2, "[T, C]")
    check_float_dtype("x", x)
    check_same_device(x, conv_state, weight, cu_seqlens, slot_indices, out, has_initial_state, bias)
    T, C = x.shape
    W = check_conv_weight("weight", weight, C)
    check_conv_bias("bias", bias, C)
    check_conv_pool("conv_state", conv_state, C, W)
    if not (cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1):
        raise ValueError(f"`cu_seqlens` must be a 1D tensor of N+1 offsets [0, .., T] (got shape "
                         f"{_shape(cu_seqlens)}).")
    check_index_dtype("cu_seqlens", cu_seqlens)
    N = cu_seqlens.numel() - 1
    if not (T == 0 or N >= 1):
        raise ValueError(f"`cu_seqlens` must hold at least 2 offsets [0, .., T] for T={T} tokens (got shape "
                         f"{_shape(cu_seqlens)}).")
    if not (slot_indices.dim() == 1 and slot_indices.shape[0] == N):
        raise ValueError(f"`slot_indices` must have shape [N] = ({N},), one slot per sequence of `cu_seqlens` "
                         f"(got {_shape(slot_indices)}).")
    check_index_dtype("slot_indices", slot_indices)
    if has_initial_state is not None:
        if not (has_initial_state.dim() == 1 and has_initial_state.shape[0] == N):
            raise ValueError(f"`has_initial_state` must have shape [N] = ({N},), one flag per sequence (got "
                             f"{_shape(has_initial_state)}).")
        if not (has_initial_state.dtype == torch.bool):
            raise ValueError(f"`has_initial_state` must be a bool tensor (got {has_initial_state.dtype}); "
                             "pass has_initial_state.bool().")
    check_shape("out", out, (T, C), "[T, C]")
    if not (out.dtype == x.dtype):
        raise ValueError(f"`out` must have x's dtype {x.dtype}: post-conv values are rounded to the activation "
                         f"dtype (got {out.dtype}).")
    check_non_overlapping("out", out)
    if _overlaps(out, x):
        raise ValueError("`out` shares memory with `x`; the conv of a token reads its neighbours, which other "
                         "programs may already have overwritten, so it cannot run in place: pass a separate `out`.")
    if not (activation in CONV_ACTIVATIONS):
        raise ValueError(f"`activation` must be 'silu', 'swish' or None (got {activation!r}).")
    if full_checks_enabled(full_checks):
        bounds = cu_seqlens.tolist()
        if not (bounds[0] == 0 and all(a <= b for a, b in zip(bounds, bounds[1:])) and bounds[-1] == T):
            raise ValueError(f"`cu_seqlens` must rise from 0 to T={T} without decreasing (got {bounds}).")
        check_slot_values("slot_indices", slot_indices, conv_state.shape[0], full_checks=True)
        check_finite(True, weight=weight, bias=bias)
    return W


# Chunked prefill
# ----------------------------------------------------------------------------
def check_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, A_log=None, dt_bias=None,
                        lower_bound=None, has_initial_state=None, chunk_states=None, chunk_state_indices=None,
                        full_checks=None) -> int:
    """The chunked-prefill contract (the varlen recurrent forward's, 1-D slots only, plus
    ``has_initial_state`` and the chunk-boundary states). Returns N."""
    if not (slot_indices.dim() == 1):
        raise ValueError(f"`slot_indices` must be 1D [N] for chunk_prefill (got ndim={slot_indices.dim()}); "
                         "each sequence starts from and writes back to one slot.")
    full = full_checks_enabled(full_checks)
    N = check_recurrent_forward(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, A_log=A_log,
                                dt_bias=dt_bias, lower_bound=lower_bound, full_checks=False)
    if has_initial_state is not None:
        if not (_shape(has_initial_state) == (N,)):
            raise ValueError(f"`has_initial_state` must have shape ({N},), one flag per sequence "
                             f"(got {_shape(has_initial_state)}).")
        if not (has_initial_state.dtype in (torch.bool, torch.int32, torch.int64)):
            raise ValueError(f"`has_initial_state` must be a bool, int32 or int64 tensor (got {has_initial_state.dtype}).")
    if (chunk_states is None) != (chunk_state_indices is None):
        raise ValueError("`chunk_states` and `chunk_state_indices` go together: pass both or neither.")
    if chunk_states is not None:
        _, HV, V, K = state.shape
        if not (chunk_states.dim() == 4 and tuple(chunk_states.shape[1:]) == (HV, V, K)):
            raise ValueError(f"`chunk_states` must have shape [scratch, HV={HV}, V={V}, K={K}] "
                             f"(got {_shape(chunk_states)}).")
        if not (chunk_states.stride(-1) == 1 and chunk_states.stride(2) == K and chunk_states.stride(1) == V * K):
            raise ValueError(f"`chunk_states` must have contiguous inner dims [HV, V, K] "
                             f"(got strides {tuple(chunk_states.stride())}).")
        if not (chunk_states.dtype in STATE_DTYPES):
            raise ValueError(f"`chunk_states` must be float32, bfloat16 or float16 (got {chunk_states.dtype}).")
        if not (chunk_state_indices.dim() == 2 and chunk_state_indices.shape[0] == N):
            raise ValueError(f"`chunk_state_indices` must have shape [N={N}, M] (got {_shape(chunk_state_indices)}).")
        check_index_dtype("chunk_state_indices", chunk_state_indices)
    check_same_device(q, state, slot_indices, cu_seqlens, has_initial_state, chunk_states, chunk_state_indices)
    if full:
        _check_recurrent_forward_values(slot_indices, None, cu_seqlens, q.shape[1], state.shape[0])
        check_finite(True, A_log=A_log, dt_bias=dt_bias)
        if chunk_states is not None:
            rows = chunk_state_indices[chunk_state_indices >= 0]
            if rows.numel():
                if not (int(rows.max()) < chunk_states.shape[0]):
                    raise ValueError(f"`chunk_state_indices` holds row {int(rows.max())}, out of range for "
                                     f"`chunk_states` of {chunk_states.shape[0]} rows.")
                if not (torch.unique(rows).numel() == rows.numel()):
                    raise ValueError("`chunk_state_indices` holds the same row twice; each boundary needs its own row.")
    return N
