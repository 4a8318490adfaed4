"""The math of one KDA token as Triton device functions, shared by every kernel.

Every kernel calls these same functions in the same order, so two kernels that
compute the same step (a snapshot verify and a ring commit, say) round alike.
"""
import triton
import triton.language as tl


@triton.jit
def softplus(x):
    # The threshold keeps exp() finite; above it softplus(x) == x in float32.
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def kda_log_decay(a, dt_bias, A_log_h, lower_bound, SAFE_GATE: tl.constexpr):
    """Log-decay g per key channel from the raw gate ``a`` (float32 vectors)."""
    x = a + dt_bias
    A = tl.exp(A_log_h)
    if SAFE_GATE:
        g = lower_bound * tl.sigmoid(A * x)
    else:
        g = -A * softplus(x)
    return g


@triton.jit
def l2_normalize(x):
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def delta_rule_update(S, k, v, g, beta):
    """S [BLOCK_V, BLOCK_K] rows of a V-major state; k, g [BLOCK_K]; v [BLOCK_V]; beta scalar."""
    S = S * tl.exp(g)[None, :]
    u = beta * (v - tl.sum(S * k[None, :], axis=1))
    return S + u[:, None] * k[None, :]


@triton.jit
def gated_rmsnorm_rows(o, gate, weight, eps, V: tl.constexpr):
    """o, gate, weight [BLOCK_V] (a full row of V, masked lanes zero)."""
    inv_rms = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / V + eps)
    return o * inv_rms * weight * tl.sigmoid(gate)
