"""Packed decode as a Helion kernel (the ``helion`` backend of ``kdakit.packed_decode``).

Same math, layouts and contract as ops/packed_decode.py, plus the
Helion-only rule that K and V are powers of two. Helion is an optional
dependency (``pip install kdakit[helion]``): nothing here imports it until a
Helion kernel is first needed, so ``import kdakit`` works without it.

The launch config is pinned ahead of time (``helion.kernel(config=...)``): a
serving call never autotunes. On CPU tensors the kernel runs through Helion's
eager reference mode when ``HELION_INTERPRET=1`` (how the tests run it).
"""
from dataclasses import dataclass

import torch

from .. import errors
from ..backends import register, select
from ..contracts import env_flag
from .packed_decode import check_packed_decode

INSTALL_HINT = "install it with `pip install kdakit[helion]` (helion==1.5.1)"

hl = None  # helion.language, bound by _import_helion(); the kernel body resolves it as a global

# (ref_mode, block_v, num_warps, int64 indexing) -> helion Kernel
_KERNELS: dict = {}

# Offsets past this need 64-bit indexing (a pool of > 2**31 elements, or an
# interleaved one whose slot stride spans that far).
_INT32_LIMIT = 2 ** 31 - 1


def _import_helion():
    """``helion`` (and ``hl`` bound for the kernel body), or a ValueError that says how to get it."""
    global hl
    try:
        import helion
        import helion.language as language
    except ImportError as exc:
        raise ValueError(f"the helion backend needs the `helion` package, which is not installed; "
                         f"{INSTALL_HINT}.") from exc
    hl = language
    return helion


def _packed_decode_body(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out, errors,
                        scale, lower_bound, use_qk_l2norm, safe_gate):
    """One program per (request, value head, tile of V rows); every tile re-derives the
    request's q, k, gate and beta (a few hundred bytes against a 4 KB state tile)."""
    B = mixed_qkv.size(0)
    HV = hl.specialize(state.size(1))
    V = hl.specialize(state.size(2))
    K = hl.specialize(state.size(3))
    H = hl.specialize((mixed_qkv.size(1) - HV * V) // (2 * K))
    group = HV // H
    block_v = hl.register_block_size(V)
    for tile_b, tile_hv, tile_v in hl.tile([B, HV, V], block_size=[1, 1, block_v]):
        i_b = tile_b.id
        i_hv = tile_hv.id
        i_h = i_hv // group
        offs_k = hl.arange(K)
        # Everything that does not depend on the slot is loaded first, so its latency
        # overlaps the slot -> state chain.
        q = mixed_qkv[i_b, i_h * K + offs_k].to(torch.float32)
        k = mixed_qkv[i_b, (H + i_h) * K + offs_k].to(torch.float32)
        v = mixed_qkv[i_b, 2 * H * K + i_hv * V + tile_v.index].to(torch.float32)
        x = a[i_b, i_hv * K + offs_k].to(torch.float32) + dt_bias[i_hv * K + offs_k].to(torch.float32)
        A = torch.exp(A_log[i_hv].to(torch.float32))
        beta = torch.sigmoid(b[i_b, i_hv].to(torch.float32))
        slot = slot_indices[i_b].to(torch.int64)  # 64-bit: slot * slot_stride passes 2**31
        if (slot < 0) | (slot >= state.size(0)):
            # Padding row, or a slot past the pool: zero output, nothing of the pool read or
            # written; the latter counted on errors[0] (kdakit/errors.py) by one program.
            out[i_b, 0, i_hv, tile_v] = 0.0
            if (slot >= 0) & (i_hv == 0) & (tile_v.begin == 0):
                hl.atomic_add(errors, [0], 1)
        else:
            if use_qk_l2norm:
                q = q / torch.sqrt((q * q).sum() + 1e-6)
                k = k / torch.sqrt((k * k).sum() + 1e-6)
            q = q * scale
            if safe_gate:
                g = lower_bound * torch.sigmoid(A * x)
            else:
                # softplus with the kernels' threshold: exp() stays finite, x above 20
                g = -A * torch.where(x <= 20.0, torch.log(1.0 + torch.exp(torch.clamp(x, max=20.0))), x)
            S = state[slot, i_hv, tile_v, :].to(torch.float32)
            S = S * torch.exp(g)[None, :]
            u = beta * (v - (S * k[None, :]).sum(-1))
            S = S + u[:, None] * k[None, :]
            o = (S * q[None, :]).sum(-1)
            state[slot, i_hv, tile_v, :] = S.to(state.dtype)
            out[i_b, 0, i_hv, tile_v] = o.to(out.dtype)
    return out


@dataclass(frozen=True)
class HelionPackedDecodeConfig:
    """Launch configuration of one Helion call (``helion_packed_decode_config`` picks it)."""
    block_v: int            # state rows (V) per tile
    num_warps: int = 1


def helion_packed_decode_config(batch: int, HV: int, V: int, K: int, state_itemsize: int) -> HelionPackedDecodeConfig:
    """Pinned ahead of time: one warp streams a 4 KB tile of state rows, as the Triton
    kernel's measured choice (benchmarks/results); a tiny batch splits finer so that
    enough warps are in flight."""
    rows = max(1, min(V, 4096 // (K * state_itemsize)))
    if batch * HV <= 32:
        rows = max(1, rows // 2)
    return HelionPackedDecodeConfig(block_v=rows, num_warps=1)


def _interpret() -> bool:
    return env_flag("HELION_INTERPRET") == "1"


def _needs_int64(*tensors) -> bool:
    """Whether any element offset of these tensors can pass 2**31 - 1."""
    for t in tensors:
        span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
        if span + t.numel() > _INT32_LIMIT:
            return True
    return False


def _kernel(block_v: int, num_warps: int, int64: bool):
    helion = _import_helion()
    from helion.runtime.ref_mode import RefMode

    # Chosen from HELION_INTERPRET here, not by Helion's own environment read, which
    # refuses to run when TRITON_INTERPRET=1 is set too (the Triton backend's tests).
    ref_mode = RefMode.EAGER if _interpret() else RefMode.OFF
    key = (ref_mode, block_v, num_warps, int64)
    kernel = _KERNELS.get(key)
    if kernel is None:
        # static_shapes=False: one compile serves every batch size (CUDA-graph buckets) and
        # pool size; HV, V, K, H are specialized in the body, and Triton's own launch
        # specialization (stride == 1, multiples of 16) keeps the state loads 128-bit wide.
        config = helion.Config(block_sizes=[block_v], num_warps=num_warps, num_stages=1, indexing="pointer")
        kernel = helion.kernel(_packed_decode_body, config=config, static_shapes=False, ref_mode=ref_mode,
                               index_dtype=torch.int64 if int64 else torch.int32)
        _KERNELS[key] = kernel
    return kernel


@register("packed_decode", "helion")
def packed_decode_helion(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out, *,
                         scale, use_qk_l2norm, lower_bound, config: "HelionPackedDecodeConfig | None" = None):
    """``config`` overrides the pinned choice (``helion_packed_decode_config``; sweeps, tests)."""
    _import_helion()
    B = mixed_qkv.shape[0]
    if B == 0:
        return out
    _, HV, V, K = state.shape
    cfg = config or helion_packed_decode_config(B, HV, V, K, state.element_size())
    block_v, num_warps = cfg.block_v, cfg.num_warps
    kernel = _kernel(block_v, num_warps, _needs_int64(mixed_qkv, a, state, out))
    counter = errors.INDEX["packed_decode"]
    kernel(mixed_qkv, a, b, A_log, dt_bias, state, slot_indices, out,
           errors.counters(mixed_qkv.device)[counter:counter + 1], float(scale), float(lower_bound) if lower_bound is not None else 0.0,
           hl.constexpr(bool(use_qk_l2norm)), hl.constexpr(lower_bound is not None))
    return out


def helion_fused_recurrent_kda_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                             ssm_state_indices, use_qk_l2norm_in_kernel=False, lower_bound=None):
    """sglang's Helion packed decode: into the caller's ``out`` and ``initial_state``; returns both."""
    check_packed_decode(mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices,
                        lower_bound=lower_bound, helion=True)
    scale = initial_state.shape[-1] ** -0.5 if scale is None else scale
    _, impl = select("packed_decode", mixed_qkv.device, "helion")
    impl(mixed_qkv, a, b, A_log, dt_bias, initial_state, ssm_state_indices, out,
         scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, lower_bound=lower_bound)
    return out, initial_state

