"""sglang's KDA kernel functions, same names, keywords, defaults, returns and error texts."""
from __future__ import annotations

from ..ops.packed_decode import packed_decode


def fused_recurrent_kda_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                      ssm_state_indices, use_qk_l2norm_in_kernel=False, lower_bound=None):
    """Packed decode into the caller's ``out`` and ``initial_state``; returns both."""
    packed_decode(mixed_qkv, a, b, A_log, dt_bias, initial_state, ssm_state_indices, out,
                  scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, lower_bound=lower_bound)
    return out, initial_state
