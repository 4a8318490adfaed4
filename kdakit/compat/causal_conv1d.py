"""Dao-AILab causal-conv1d 1.7's ``causal_conv1d_fn`` and ``causal_conv1d_update``: same
names, parameters and defaults, on kdakit's short-conv kernels (``causal_conv1d_varlen`` and
``causal_conv1d_update``).

- ``x`` may be contiguous ``[B, D, T]`` or channel-last (a ``[B, T, D]`` tensor transposed,
  as Hugging Face transformers and most engines hold it); the output has ``x``'s layout and
  dtype. ``weight [D, W]`` and ``bias [D]`` may be float32, bfloat16 or float16 (the conv runs
  in float32, as causal-conv1d's kernels do); ``x`` float32, bfloat16 or float16.
- ``activation``: None, ``"silu"`` or ``"swish"``, as causal-conv1d accepts.

Where we differ (each is a ValueError, never a different result):
- ``seq_idx`` (several sequences packed in one row) is not supported: pass the sequences as
  rows, or use ``kdakit.causal_conv1d_varlen`` with ``cu_seqlens``.
- ``cache_seqlens`` (the circular-buffer form of the update) is not supported.
We accept more than causal-conv1d in two places: ``initial_states`` / ``return_final_states``
with a contiguous ``x`` (causal-conv1d wants channel-last there), and any conv width from 2
to kdakit's maximum (causal-conv1d: 2 to 4). A negative ``conv_state_indices`` entry is a
padding row: zero output, no state access.
"""
from __future__ import annotations

import torch

from ..ops.conv1d_update import causal_conv1d_update as _kdakit_conv_update
from ..ops.conv1d_varlen import causal_conv1d_varlen as _kdakit_conv_varlen

ACTIVATIONS = (None, "silu", "swish")


def _check_common(name: str, x: torch.Tensor, weight: torch.Tensor, bias, activation) -> tuple[int, int]:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: `activation` must be None, 'silu' or 'swish' (got {activation!r}).")
    if not (torch.is_tensor(weight) and weight.dim() == 2):
        raise ValueError(f"{name}: `weight` must be a [D, W] tensor (got "
                         f"{tuple(weight.shape) if torch.is_tensor(weight) else type(weight).__name__}).")
    D, W = weight.shape
    if x.dim() not in (2, 3) or x.shape[1] != D:
        raise ValueError(f"{name}: `x` must be [B, D, T] (or [B, D] for the update) with D={D} channels, the "
                         f"weight's rows (got x of shape {tuple(x.shape)}).")
    if bias is not None and not (torch.is_tensor(bias) and bias.shape == (D,)):
        raise ValueError(f"{name}: `bias` must have shape [D] = ({D},) (got "
                         f"{tuple(bias.shape) if torch.is_tensor(bias) else type(bias).__name__}).")
    return D, W


def _float32(t):
    """kdakit's conv kernels take float32 taps; causal-conv1d converts its weight to float32 too."""
    return None if t is None else t.to(torch.float32).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, D, T]`` as the ``[B*T, D]`` token rows kdakit's varlen conv takes (a view when
    ``x`` is channel-last or B == 1, else a copy)."""
    B, D, T = x.shape
    return x.transpose(1, 2).reshape(B * T, D)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     seq_idx: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False, final_states_out: torch.Tensor | None = None,
                     activation: str | None = None):
    """Causal depthwise conv of ``x [B, D, T]`` with ``weight [D, W]``: ``out[b, d, t] =
    act(bias[d] + sum_w weight[d, w] * x[b, d, t - (W-1) + w])``, inputs before ``t = 0`` from
    ``initial_states [B, D, W-1]`` (zeros when None). Returns ``out [B, D, T]`` (``x``'s dtype
    and layout), or ``(out, final_states [B, D, W-1])`` with ``return_final_states`` (written
    into ``final_states_out`` when given)."""
    return _conv_fn(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
                    activation, channel_last_out=False)


def _conv_fn(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation,
             channel_last_out: bool):
    """``channel_last_out``: return a channel-last output whatever ``x``'s layout (its q/k/v
    split is then contiguous in the last dim; the transformers integration asks for it)."""
    name = "causal_conv1d_fn"
    if not torch.is_tensor(x) or x.dim() != 3:
        raise ValueError(f"{name}: `x` must be a [B, D, T] tensor (got "
                         f"{tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}).")
    D, W = _check_common(name, x, weight, bias, activation)
    if seq_idx is not None:
        raise ValueError(f"{name}: `seq_idx` (sequences packed in one row) is not supported by kdakit; pass each "
                         "sequence as its own row, or call kdakit.causal_conv1d_varlen with cu_seqlens.")
    B, _, T = x.shape
    if initial_states is not None and tuple(initial_states.shape) != (B, D, W - 1):
        raise ValueError(f"{name}: `initial_states` must have shape [B, D, W-1] = {(B, D, W - 1)} (got "
                         f"{tuple(initial_states.shape)}).")
    if final_states_out is not None:
        if not return_final_states:
            raise ValueError(f"{name}: `final_states_out` needs `return_final_states=True`.")
        if tuple(final_states_out.shape) != (B, D, W - 1):
            raise ValueError(f"{name}: `final_states_out` must have shape [B, D, W-1] = {(B, D, W - 1)} (got "
                             f"{tuple(final_states_out.shape)}).")
    dev = x.device
    # The windows: a pool of B rows, row b the sequence b's; without initial states the kernel
    # starts from zeros (has_initial_state False) and still leaves the final windows there.
    if final_states_out is not None:
        pool = final_states_out
        if initial_states is not None and initial_states.data_ptr() != pool.data_ptr():
            pool.copy_(initial_states)
    elif return_final_states:
        pool = (initial_states.clone() if initial_states is not None
                else torch.empty(B, D, W - 1, dtype=x.dtype, device=dev))
    elif initial_states is not None:
        pool = initial_states.clone()  # read, never written (causal-conv1d leaves it alone)
    else:
        pool = x.new_empty(1, D, W - 1)  # untouched: every row is a padding slot
    if return_final_states or initial_states is not None:
        slots = torch.arange(B, dtype=torch.int32, device=dev)
        flags = None if initial_states is not None else torch.zeros(B, dtype=torch.bool, device=dev)
    else:
        slots = torch.full((B,), -1, dtype=torch.int32, device=dev)  # zeros in, nothing kept
        flags = None
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev) if T > 0 else \
        torch.zeros(B + 1, dtype=torch.int32, device=dev)
    if channel_last_out or x.stride(1) == 1:
        out = torch.empty(B, T, D, dtype=x.dtype, device=dev)
        out_rows, out = out.view(B * T, D), out.transpose(1, 2)
    elif B == 1:  # a contiguous [1, D, T]: its token rows are a strided view
        out = torch.empty(1, D, T, dtype=x.dtype, device=dev)
        out_rows = out[0].transpose(0, 1)
    else:
        out = out_rows = None
    result = _kdakit_conv_varlen(_rows(x), pool, _float32(weight), cu, slots, has_initial_state=flags,
                                 bias=_float32(bias), activation=activation, out=out_rows)
    if out is None:  # x contiguous with B > 1: back to its layout
        out = result.view(B, T, D).transpose(1, 2).contiguous()
    if return_final_states:
        return out, pool
    return out


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         cache_seqlens: torch.Tensor | None = None,
                         conv_state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The conv of ``T`` new tokens ``x [B, D]`` or ``[B, D, T]`` continuing from
    ``conv_state [B_state, D, S]`` (``S >= W-1``, newest column last), which is shifted left by
    ``T`` with ``x`` appended, in place: ``conv_state = cat(conv_state, x)[..., -S:]``. Row ``b``
    uses state row ``conv_state_indices[b]`` (``b`` without them). Returns the output in
    ``x``'s shape and dtype."""
    name = "causal_conv1d_update"
    if not torch.is_tensor(x) or x.dim() not in (2, 3):
        raise ValueError(f"{name}: `x` must be a [B, D] or [B, D, T] tensor (got "
                         f"{tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}).")
    D, W = _check_common(name, x, weight, bias, activation)
    if cache_seqlens is not None:
        raise ValueError(f"{name}: `cache_seqlens` (a circular conv state) is not supported by kdakit; keep the "
                         "state newest-column-last and pass cache_seqlens=None.")
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    B, _, T = x3.shape
    if not (torch.is_tensor(conv_state) and conv_state.dim() == 3 and conv_state.shape[1] == D
            and conv_state.shape[2] >= W - 1):
        raise ValueError(f"{name}: `conv_state` must be [B, D, S] with D={D} and S >= W-1 = {W - 1} (got "
                         f"{tuple(conv_state.shape) if torch.is_tensor(conv_state) else None}).")
    S = conv_state.shape[2]
    dev = x.device
    if conv_state_indices is None:
        if conv_state.shape[0] != B:
            raise ValueError(f"{name}: `conv_state` must have B={B} rows without `conv_state_indices` (got "
                             f"{conv_state.shape[0]}).")
        slots = torch.arange(B, dtype=torch.int32, device=dev)
    else:
        if not (conv_state_indices.dim() == 1 and conv_state_indices.shape[0] == B):
            raise ValueError(f"{name}: `conv_state_indices` must have shape [B] = ({B},) (got "
                             f"{tuple(conv_state_indices.shape)}).")
        if conv_state_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: `conv_state_indices` must be int32 or int64 (got {conv_state_indices.dtype}).")
        slots = conv_state_indices
    window = conv_state[..., S - (W - 1):]  # the columns the conv reads: kdakit's [slots, D, W-1] window
    head = None
    if S > W - 1:
        # The columns before the window shift too; take them before the kernel moves the window.
        rows = conv_state if conv_state_indices is None else conv_state[slots.clamp(min=0).long()]
        head = torch.cat([rows, x3.to(conv_state.dtype)], dim=-1)[..., T:T + S - (W - 1)].clone()
    w32, b32 = _float32(weight), _float32(bias)
    if T == 1 and activation is not None:
        out = torch.empty(B, D, dtype=x.dtype, device=dev)
        _kdakit_conv_update(x3[..., 0], window, w32, slots, bias=b32, out=out)
        out = out.view(B, D, 1)
    else:  # several tokens, or no activation: the varlen conv continues from each window
        cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev)
        out_rows = _kdakit_conv_varlen(_rows(x3), window, w32, cu, slots, bias=b32, activation=activation)
        out = out_rows.view(B, T, D).transpose(1, 2)
    if head is not None:
        if conv_state_indices is None:
            conv_state[..., :S - (W - 1)].copy_(head)
        else:
            keep = slots >= 0
            conv_state[slots[keep].long(), :, :S - (W - 1)] = head[keep]
    if x.dim() == 2:
        return out[..., 0]
    return out.contiguous() if x.is_contiguous() else out  # x's layout, as causal-conv1d's empty_like
