"""Chunked varlen prefill (the extend path): the KDA recurrence in the WY/UT chunk form.

Inputs are one flattened batch, as for ``recurrent_forward``: ``q, k [1, T, H, K]``,
``v [1, T, HV, V]``, ``g [1, T, HV, K]`` (the raw gate with ``A_log``/``dt_bias``, or the
log-decay when ``A_log`` is None), ``beta [1, T, HV]`` (β or its logit), split into ``N``
sequences by ``cu_seqlens``. Sequence ``n`` starts from ``state[slot_indices[n]]`` (zeros
when ``has_initial_state[n]`` is False) and its final state goes back there; a slot < 0
or >= the pool's slot count is a padding row (zero outputs, no pool access). A slot past
the pool is counted once per sequence (``kdakit.take_errors``), and so is each
``chunk_state_indices`` row past ``chunk_states`` that the kernel reaches (a boundary the
sequence has; a row < 0 means "not written" and is not counted), by the sequence's value
head 0, V tile 0 program of the state kernel.

The math, per chunk of ``C`` tokens of one sequence and one value head, with ``S0`` the
V-major state at the chunk start, ``Γ_t`` the chunk-local inclusive cumulative log-decay
(a K vector; ``Γ_t - Γ_s <= 0`` for ``s <= t``), ``k̂, q̂`` the normalised (q scaled) keys
and queries:

- ``A[s, r] = β_s Σ_k k̂_s k̂_r e^(Γ_s - Γ_r)`` (r < s), ``P[t, s] = Σ_k q̂_t k̂_s e^(Γ_t - Γ_s)``
  (s <= t), ``T = (I + A)^-1`` (forward substitution);
- ``w = T diag(β) (k̂ ⊙ e^Γ)``, ``u = T diag(β) v``;
- state chain: ``U = u - w S0ᵀ``; ``o = (q̂ ⊙ e^Γ) S0ᵀ + P U``;
  ``S = S0 diag(e^Γ_C) + Uᵀ (k̂ ⊙ e^(Γ_C - Γ))``.

Nothing overflows whatever the gate (the default gate's log-decay is unbounded below): the
pair sums ``A`` and ``P`` are never factored as ``(k̂ e^Γ)(k̂ e^-Γ)`` over a chunk. The chunk
is cut into sub-blocks of 16 tokens, and the pairs whose earlier token is in sub-block ``j``
form one tensor-core product over all the rows at or below it, factored at a token ``b``,
``e^(Γ_s - Γ_r) = e^(Γ_s - Γ_b) · e^(Γ_b - Γ_r)``. Where sub-block ``j``'s log-decay spread
(per channel, across its 16 tokens) is at most ``ChunkConfig.factor_spread_max`` (60 under the
default gate; ``SAFE_SPREAD_MAX`` = 80 under the safe gate, whose spread is below
16 |lower_bound|), ``b`` is the token before the block and the product takes the block's own
pairs too: ``e^(Γ_b - Γ_r) <= e^spread``, the only positive exponent. Otherwise ``b`` is the
block's last token (both factors <= 1), the product covers the rows below the block, and the
block's own pairs take their exact decays ``e^(Γ_s - Γ_r)`` element by element. The choice is
made per sub-block on the device, from the decays.

The package, a module per part:

- ``config.py``: ``ChunkConfig``, the launch configuration, and ``chunk_config``, which pins
  it from the shapes (the thresholds it picks by; the products' precision and dtypes);
- ``plan.py``: the chunk plan (which global chunk belongs to which sequence), built on the
  device by ``chunk_plan`` (one launch of a one-program kernel) for ``max_chunks_for`` chunks
  and read by the kernels;
- ``prep.py``: ``_chunk_prep_kernel``, one program per (chunk, value head), token-parallel:
  ``A``, ``P``, the inverse and the chain's factors into a workspace, in up to seven launches;
  with ``products.py`` (the ``A`` and ``P`` products and the loads the phases share),
  ``inverse.py`` (``(I + A)^-1``, its diagonal blocks also as one-warp programs of their
  own) and ``factors.py`` (``w``, ``u`` and the chain's other factors, a K or V slice at a time);
- ``chain.py``: the state chain, serial over each sequence's chunks (``_chunk_state_kernel``),
  cut into pieces (``_chunk_pieces_kernel``) or with its outputs after it (``_chunk_output_kernel``);
- ``run.py``: the backends ``select`` picks from: the Triton launcher
  (``chunk_prefill_triton``: the plan, the workspaces, the launches) and the reference's;
- ``op.py``: the public ``chunk_prefill``, its input checks, and the custom op
  ``torch.ops.kdakit.chunk_prefill`` with its example inputs.
"""
from .config import (BETA_AS_IS, BETA_SIGMOID, BETA_SIGMOID_X2, BF16_DOTS_MIN_BLOCK_V, CHAIN_PIECES,
                     CHAIN_PIECES_FROM_TOKENS, CHUNK_SIZE, OUTPUTS_AFTER_FROM_TOKENS, OUTPUTS_AFTER_MAX_CHAINS,
                     SAFE_SPREAD_MAX, SUB, ChunkConfig, chunk_config)
from .plan import chunk_plan, max_chunks_for
from .run import chunk_prefill_reference, chunk_prefill_triton
from .op import check_chunk_prefill, chunk_prefill, chunk_prefill_op, run_chunk_prefill

__all__ = ["BETA_AS_IS", "BETA_SIGMOID", "BETA_SIGMOID_X2", "BF16_DOTS_MIN_BLOCK_V", "CHAIN_PIECES",
           "CHAIN_PIECES_FROM_TOKENS", "CHUNK_SIZE", "OUTPUTS_AFTER_FROM_TOKENS", "OUTPUTS_AFTER_MAX_CHAINS",
           "SAFE_SPREAD_MAX", "SUB", "ChunkConfig", "chunk_config", "chunk_plan", "max_chunks_for",
           "chunk_prefill_reference", "chunk_prefill_triton", "check_chunk_prefill", "chunk_prefill",
           "chunk_prefill_op", "run_chunk_prefill"]
