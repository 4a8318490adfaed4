"""Random inputs of one call per op (sizes in, tensors out): one builder per op, shared by
`kdakit check`, `kdakit bench` and the scripts under benchmarks/.

Each builder returns a dict of named tensors (the inputs, the pools, the output buffers),
drawn from a generator on ``device`` seeded with ``seed``: the same seed gives the same
tensors on the same device. The pools have spare slots (``slots``, default ``2 N + 2``
or ``N + max(N, 2)`` as named below), the requests on a random permutation of them;
callers that need padding rows set ``idx`` entries to -1 afterwards. The generic tests use
the ops' own tiny examples (``register_example`` in kdakit/ops/*.py: interleaved pools,
fixed padding, seeded on the CPU for the same values on every device).
"""
from __future__ import annotations

import torch


def _rng(seed: int, device):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    def uniform(*shape):
        return torch.rand(*shape, device=device, generator=gen)

    def perm(n):
        return torch.randperm(n, device=device, generator=gen)
    return rnd, uniform, perm


def _decode_step(rnd, uniform, perm, N, HV, K, V, slots, act_dtype, state_dtype) -> dict:
    """The gate and β inputs, gate parameters, state pool and slots of one decode step (drawn in
    this order, so that every builder that calls it draws the same way)."""
    return {"a": rnd(N, HV * K).to(act_dtype), "b": rnd(N, HV).to(act_dtype), "A_log": uniform(HV) * 2 - 1,
            "dt_bias": rnd(HV * K) * 0.5, "state": (rnd(slots, HV, V, K) * 0.5).to(state_dtype),
            "idx": perm(slots)[:N].to(torch.int32)}


def _spare(N, slots, spare_slots):
    if slots is not None:
        return slots
    return N + (spare_slots if spare_slots is not None else max(N, 2))


def packed_decode_inputs(N, H, HV, K, V, *, state_dtype=torch.float32, act_dtype=torch.bfloat16, slots=None,
                         spare_slots=None, seed=0, device="cuda") -> dict:
    """One decode step of ``N`` requests: ``mixed`` (q|k|v packed), ``a``, ``b``, ``A_log``,
    ``dt_bias``, a V-major ``state`` pool ``[slots, HV, V, K]`` (``N + spare_slots``, default
    ``N + max(N, 2)``), ``idx`` and ``out [N, 1, HV, V]``."""
    rnd, uniform, perm = _rng(seed, device)
    slots = _spare(N, slots, spare_slots)
    return {
        "mixed": rnd(N, 2 * H * K + HV * V).to(act_dtype),
        **_decode_step(rnd, uniform, perm, N, HV, K, V, slots, act_dtype, state_dtype),
        "out": torch.empty(N, 1, HV, V, device=device, dtype=act_dtype),
    }


def fused_decode_inputs(N, H, HV, K, V, *, W=4, state_dtype=torch.float32, act_dtype=torch.bfloat16,
                        conv_dtype=torch.bfloat16, transposed_conv=True, slots=None, spare_slots=None, seed=0,
                        device="cuda") -> dict:
    """One fused decode step (short conv of width ``W``, recurrence, gated norm): ``qkv``,
    ``conv_weight [C, W]``, ``conv_state`` (``[slots, C, W-1]``; ``transposed_conv``: stored
    ``[slots, W-1, C]`` and passed as that transposed view, sglang's layout), ``a``, ``b``,
    ``A_log``, ``dt_bias``, ``state``, ``idx``, ``norm_gate [N, HV*V]``, ``norm_weight [V]``
    and ``out [N, 1, HV, V]``."""
    rnd, uniform, perm = _rng(seed, device)
    slots = _spare(N, slots, spare_slots)
    C = 2 * H * K + HV * V
    if transposed_conv:
        conv = rnd(slots, W - 1, C).to(conv_dtype).transpose(1, 2)
    else:
        conv = rnd(slots, C, W - 1).to(conv_dtype)
    return {
        "qkv": rnd(N, C).to(act_dtype),
        "conv_weight": rnd(C, W) * 0.5,
        "conv_state": conv,
        **_decode_step(rnd, uniform, perm, N, HV, K, V, slots, act_dtype, state_dtype),
        "norm_gate": rnd(N, HV * V).to(act_dtype),
        "norm_weight": uniform(V) + 0.5,
        "out": torch.empty(N, 1, HV, V, device=device, dtype=act_dtype),
    }


def varlen_inputs(seqlens, H, HV, K, V, *, state_dtype=torch.float32, act_dtype=torch.bfloat16, slots=None,
                  steep=False, long_memory=False, seed=0, device="cuda") -> dict:
    """Sequences of ``seqlens`` tokens flattened to ``[1, T, ...]`` (the recurrent forward's
    and the chunked prefill's inputs): ``q``, ``k``, ``v``, raw gate ``g``, beta logit
    ``beta``, ``A_log``, ``dt_bias``, a V-major ``state`` pool (``slots``, default ``2 N + 2``),
    ``idx``, ``cu`` (the offsets) and ``out [1, T, HV, V]``. ``steep``: the first K/8
    channels decay by about e^-20 a token (softplus(x) ~ x for the raw gate 6 + 2|x|).
    ``long_memory``: Kimi Linear's gate initialisation instead (``A_log = log U(1, 16)``,
    ``dt_bias`` the inverse softplus of ``U(0.001, 0.1)``, raw gate ``0.5 N(0, 1)``): log-decays
    of about -0.002 to -0.5 a token, so the state carries over thousands of tokens and the
    chunk-to-chunk chain decides the result (the default draws forget within a few tokens)."""
    rnd, uniform, perm = _rng(seed, device)
    N = len(seqlens)
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(seqlens), dtype=torch.int32), 0)
    T = int(cu[-1])
    slots = 2 * N + 2 if slots is None else slots
    g = rnd(1, T, HV, K)
    A_log = uniform(HV) * 2 - 1
    dt_bias = rnd(HV * K) * 0.5
    if steep:
        g[..., : K // 8] = 6.0 + 2.0 * g[..., : K // 8].abs()
    if long_memory:
        A_log = torch.log(1 + 15 * uniform(HV))
        dt = 0.001 + 0.099 * uniform(HV * K)
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
        g = 0.5 * g
    return {
        "q": rnd(1, T, H, K).to(act_dtype), "k": rnd(1, T, H, K).to(act_dtype),
        "v": rnd(1, T, HV, V).to(act_dtype), "g": g.to(act_dtype), "beta": rnd(1, T, HV).to(act_dtype),
        "A_log": A_log, "dt_bias": dt_bias,
        "state": (rnd(slots, HV, V, K) * 0.5).to(state_dtype),
        "idx": perm(slots)[:N].to(torch.int32),
        "cu": cu.to(device), "out": torch.empty(1, T, HV, V, device=device, dtype=act_dtype),
    }


def mtp_verify_inputs(N, T, H, HV, K, V, *, conv, mode, W=4, norm=False, ring_len=None, slots=None,
                      act_dtype=torch.bfloat16, state_scale=0.3, seed=0, device="cuda") -> dict:
    """A speculative verify of ``N`` requests of ``T`` tokens (already convolved, or with
    ``conv``: the q, k, v short convs of width ``W``, their window pools and intermediate
    windows): ``q``, ``k``, ``v``, ``a``, ``b``, ``A_log``, ``dt_bias``, ``state`` (``slots``,
    default ``2 N + 2``), ``slots`` (the requests' pool slots), ``scratch_idx``, ``out``;
    ``mode="snapshot"``: ``snapshots [N, T, HV, V, K]``; ``"ring"``: ``rings`` of ``ring_len``
    (default ``T``) steps per slot (q and k rings in ``act_dtype``, gate and beta float32);
    ``norm``: ``norm_gate`` and ``norm_weight``."""
    rnd, uniform, perm = _rng(seed, device)
    num_slots = slots or 2 * N + 2
    ring_len = ring_len or T

    def act(*shape):
        return rnd(*shape).to(act_dtype)
    L = {"q": act(N, T, H, K), "k": act(N, T, H, K), "v": act(N, T, HV, V), "a": act(N, T, HV, K),
         "b": act(N, T, HV), "A_log": uniform(HV) * 2 - 1, "dt_bias": rnd(HV * K) * 0.5,
         "state": rnd(num_slots, HV, V, K) * state_scale,
         "slots": perm(num_slots)[:N].to(torch.int32),
         "scratch_idx": perm(N).to(torch.int32)}
    channels = (H * K, H * K, HV * V)
    if conv:
        L["conv_weights"] = tuple(rnd(c, W) * 0.5 for c in channels)
        L["conv_states"] = tuple(act(num_slots, c, W - 1) for c in channels)
        L["intermediate_conv"] = tuple(torch.zeros(N, T, c, W - 1, device=device, dtype=act_dtype)
                                       for c in channels)
    if mode == "snapshot":
        L["snapshots"] = torch.zeros(N, T, HV, V, K, device=device)
    else:
        L["rings"] = (torch.zeros(num_slots, H, ring_len, K, device=device, dtype=act_dtype),
                      torch.zeros(num_slots, HV, ring_len, V, device=device, dtype=act_dtype),
                      torch.zeros(num_slots, HV, ring_len, K, device=device),
                      torch.zeros(num_slots, HV, ring_len, device=device))
    if norm:
        L["norm_gate"] = act(N, T, HV, V)
        L["norm_weight"] = uniform(V) + 0.5
    L["out"] = torch.empty(N, T, HV, V, device=device, dtype=act_dtype)
    return L


def top2_parents(T: int) -> list[int]:
    """An EAGLE top-2 tree of ``T`` nodes: two candidates a level, the first expanded; node t's
    parent (-1: the committed state)."""
    parents, level = [-1], 1
    while len(parents) < T:
        expanded = 0 if level == 1 else 2 * level - 3
        parents += [expanded, expanded]
        level += 1
    return parents[:T]
