"""fla-core's pure-PyTorch KDA (naive_recurrent_kda and its gate functions) as an oracle
for varlen recurrent forward, independent of kdakit.reference.

fla's naive recurrence: K-major state ``[B, HV, K, V]``, log-space gate, post-sigmoid
beta, no L2 norm (we normalise as docs/design.md says, eps 1e-6 inside the sqrt), float32 math.
"""
from __future__ import annotations

import pytest
import torch


def naive_modules():
    naive = pytest.importorskip("fla.ops.kda.naive")
    gate = pytest.importorskip("fla.ops.kda.gate")
    return naive, gate


def fla_log_gate(g_raw, A_log, dt_bias, lower_bound):
    """``g_raw [..., HV, K]`` -> log-decay, by fla's naive gate functions (float32)."""
    _, gate = naive_modules()
    shape = g_raw.shape
    flat = g_raw.reshape(-1, *shape[-2:])
    if lower_bound is None:
        out = gate.naive_kda_gate(flat, A_log, dt_bias)
    else:
        out = gate.naive_kda_lowerbound_gate(flat, A_log, dt_bias, lower_bound=lower_bound)
    return out.view(shape)


def l2(x):
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def fla_varlen(q, k, v, g_log, beta, cu_seqlens, initial_kmajor, *, use_qk_l2norm, scale=None):
    """Sequence by sequence, token by token, with fla's naive recurrence.

    ``initial_kmajor``: a list of ``[HV, K, V]`` states (or ``None`` for zeros), one per
    sequence. Returns ``out [1, T, HV, V]`` float32, per-token states ``[T, HV, K, V]`` and
    the final state of every sequence (a list, K-major).
    """
    naive, _ = naive_modules()
    T, HV, V = v.shape[1], v.shape[2], v.shape[3]
    K = q.shape[-1]
    if use_qk_l2norm:
        q, k = l2(q), l2(k)
    out = torch.zeros(1, T, HV, V)
    token_states = torch.zeros(T, HV, K, V)
    finals = []
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        S = None if initial_kmajor[n] is None else initial_kmajor[n].float()[None]
        for t in range(bounds[n], bounds[n + 1]):
            step = slice(t, t + 1)
            o, S = naive.naive_recurrent_kda(q[:, step].float(), k[:, step].float(), v[:, step].float(),
                                             g_log[:, step].float(), beta[:, step].float(), scale=scale,
                                             initial_state=S, output_final_state=True)
            out[0, t] = o[0, 0]
            token_states[t] = S[0]
        finals.append(torch.zeros(HV, K, V) if S is None else S[0])
    return out, token_states, finals
