"""The chunk (WY/UT) form of the KDA recurrence in float64 PyTorch, as readable math: the
algebra the chunked prefill kernels implement, checked against the token-by-token
recurrence independently of any kernel (tests/test_chunk_prefill.py).

One sequence and one value head at a time, V-major state ``S [V, K]``; ``q, k [T, K]``
(already normalised, q scaled), ``v [T, V]``, log-decay ``g [T, K]``, ``beta [T]``. Per
chunk of ``C`` tokens, with ``Γ`` the chunk-local inclusive cumulative log-decay and
``D[t, s] = e^(Γ_t - Γ_s)`` for ``s <= t`` (exact pairwise decays: no ``e^-Γ`` is formed):

    A = tril(β_t Σ_k k_t k_s D[t, s], -1)       P = tril(Σ_k q_t k_s D[t, s])
    T = (I + A)^-1        w = T diag(β) (k e^Γ)        u = T diag(β) v
    U = u - w Sᵀ          o = (q e^Γ) Sᵀ + P U         S ← S e^(Γ_C) + Uᵀ (k e^(Γ_C - Γ))
"""
from __future__ import annotations

import torch


def chunk_form(q, k, v, g, beta, S, chunk: int):
    """Returns ``(o [T, V], S_final [V, K])`` in float64."""
    q, k, v, g, beta, S = (x.double() for x in (q, k, v, g, beta, S))
    T = q.shape[0]
    outs = []
    for t0 in range(0, T, chunk):
        qc, kc, vc, gc, bc = (x[t0:t0 + chunk] for x in (q, k, v, g, beta))
        n = qc.shape[0]
        G = gc.cumsum(0)                                        # [n, K]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        expo = G[:, None, :] - G[None, :, :]                     # Γ_t - Γ_s, [n, n, K]
        D = torch.exp(torch.where(causal[:, :, None], expo, torch.tensor(float("-inf"), dtype=G.dtype)))
        A = (bc[:, None] * (kc[:, None, :] * kc[None, :, :] * D).sum(-1)).tril(-1)
        P = (qc[:, None, :] * kc[None, :, :] * D).sum(-1)
        Tinv = torch.linalg.inv(torch.eye(n, dtype=A.dtype) + A)
        w = Tinv @ (bc[:, None] * kc * torch.exp(G))
        u = Tinv @ (bc[:, None] * vc)
        U = u - w @ S.T
        outs.append(qc * torch.exp(G) @ S.T + P @ U)
        S = S * torch.exp(G[-1])[None, :] + U.T @ (kc * torch.exp(G[-1][None, :] - G))
    return torch.cat(outs), S
