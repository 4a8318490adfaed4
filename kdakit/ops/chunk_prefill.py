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

The kernels:
1. ``_chunk_prep_kernel``, one program per (chunk, value head), token-parallel: L2 norm,
   gate, β, the cumulative decay, ``A`` and ``P``, the inverse, and the chunk's ``w``,
   ``u``, ``q̂ ⊙ e^Γ``, ``k̂ ⊙ e^(Γ_C - Γ)``, ``P`` and ``e^Γ_C`` into a float32 workspace.
   Each phase reads its pieces back from the workspace (16-row sub-blocks,
   ``ChunkConfig.slice_k``-column pieces), so that no whole-chunk tile outlives its phase:
   those spill registers. With ``ChunkConfig.qk_from_input`` the first phase keeps only the
   rows' reciprocal norms of k and q (two floats a row), and the later phases read q and k
   from the inputs and normalise them as they load. With ``ChunkConfig.split_prep`` (the picked default) the phases
   run as three launches of the same kernel (token-parallel; the exact pairs of steep
   sub-blocks, a program per sub-block; the rest), each holding fewer registers. With
   ``split_rest`` the rest goes as three (products, inverse, w and u; the products as two
   with ``products="block_programs"``), and with
   ``diagonal_programs`` (picked) the inverse's 16 x 16 diagonal blocks are inverted one warp
   each by ``chunk_inverse.py`` between the products and the inverse launch, which then only
   builds the blocks below them (by doubling, ``inverse="doubling"``, picked).
2. ``_chunk_state_kernel``, one program per (sequence, value head, V tile), serial over
   the sequence's chunks with the state tile in float32 registers: outputs and the
   state update above; the final state written back in place (and optionally the state
   after every ``C`` tokens into scratch slots: prefix caching). A counted loop of
   ``ChunkConfig.pipeline_stages`` stages streams the next chunk's factors into shared
   memory during this chunk's products (the interpreter runs the same step in a while loop).
   With ``ChunkConfig.chain_pieces = P > 1`` each sequence's chain is cut into P pieces of
   chunks. A chunk maps every state row affinely, ``S -> S (diag(e^Γ_C) - wᵀ k̂_d) + uᵀ k̂_d``
   (``k̂_d = k̂ ⊙ e^(Γ_C - Γ)``), so a piece maps ``S -> S M + B``: the same kernel runs each
   piece from the rows ``[0; I]`` of a ``[V + K, K]`` tile, all pieces at once, giving ``B``
   and ``M``; ``_chunk_pieces_kernel`` walks the pieces in order from the pool slot (one
   ``[V, K] x [K, K]`` product each) for their start states; then the same kernel runs every
   piece's outputs from its start, the last piece writing the final state. About twice the
   chain's products, in P times as many programs: one long sequence with few heads (picked
   there, ``chunk_config``: 4 pieces, the V tile chosen for the pieces' programs).
3. With ``ChunkConfig.outputs="after_chain"`` (picked for few chains of 4096 to 8191 tokens) the chain stores
   each chunk's start state and ``U`` instead of its outputs, and ``_chunk_output_kernel``,
   one program per (V tile, value head, chunk), computes them token-parallel: the serial
   loop runs two of its four products. The same products on the same operands: the same bits.

The prep's products (``ChunkConfig.products``, ``chunk_products.py`` with the loads the phases
share) run a program per column block (``"block_programs"``, picked) in two launches: the
upper half of the blocks on all the chunk's rows, the lower half on the lower half of the rows
(all they cover). The programs of a (chunk, head) are adjacent in the grid, so its k, q and Γ
come from the L2 after the first. ``"by_slice"`` accumulates every block's product per K slice
in one program, ``"by_block"`` loops over the blocks. ``w`` and ``u`` go a program per K and V
slice (``factor_programs``, picked; ``chunk_factors.py``).

Matrix products take their precision from the activations (``ChunkConfig.dot_precision``):
float32 inputs get ``"tf32x3"`` (three TF32 passes on tensor cores, float32-level results:
one pass rounds each operand to 10 mantissa bits, about 1e-3 relative error); bf16 and fp16
inputs, which carry no more bits than that, get one ``"tf32"`` pass (more accurate than fla's
bf16 products on the same inputs, and 2.4x faster than three passes); ``"ieee"`` (exact
float32 FMA) is there for checks. With bf16 activations the
picked config stores the chain's factors in bf16 (``ChunkConfig.factor_dtype``) and, from
32-row V tiles, gives the chain's products bf16 operands (``chain_dot_dtype``; float32
accumulation and state), as fla does: half the bytes the chain streams and no register
spills in its kernel. The in-sub-block pair sums, the cumulative sums and the 16 x 16
forward substitutions are float32 element-wise arithmetic.

The chunk plan (which global chunk belongs to which sequence) is built on the device
from ``cu_seqlens`` by a few torch ops (no ``.item()``, no host sync), for
``max_chunks = T // C + N`` chunks, a bound on ``Σ ceil(len_n / C)`` computed from shapes
alone: a call of fixed ``T`` and ``N`` is CUDA-graph capturable (an engine pads its token
count and sequence count to its capture sizes; padding sequences may be empty, with
slot -1). The workspace (``max_chunks · HV · C · (3K + V + 2C + 1)`` floats) comes from
PyTorch's caching allocator, so from the graph's pool under capture.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import errors, reference
from ..backends import register, select
from .chunk_factors import _k_slice_factors, _v_slice_factors
from .chunk_inverse import diagonal_inverse
from .chunk_products import (_block_spread, _column_block_products, _pair_products_by_slice,
                             _steep_block_pairs_by_slice, _steep_column, _unit_rows)
from .launch import CachedKernel, cdiv, interpreting, next_power_of_2
from .triton_math import count_bad_row, kda_log_decay

CHUNK_SIZE = 64  # tokens per chunk on the GPU (prefix-cache boundaries come every CHUNK_SIZE tokens)
SUB = 16  # sub-block of a chunk: the tensor-core tile and the unit of exact in-block decays
SAFE_SPREAD_MAX = 80.0  # safe gate: sub-blocks factored up to this spread (16 tokens at the -5 bound)

# β as given, sigmoid of a logit, 2·sigmoid (fla's allow_neg_eigval)
BETA_AS_IS, BETA_SIGMOID, BETA_SIGMOID_X2 = 0, 1, 2
_FACTOR_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DOT_PRECISIONS = ("tf32", "tf32x3", "ieee")
_INVERSES = ("substitution", "doubling")
_PRODUCTS = ("by_block", "by_slice", "block_programs")
_OUTPUTS = ("in_chain", "after_chain")
_STEEP_PAIRS = ("by_column", "by_slice")
_DIAGONAL = "diagonal inverse"  # the launch list's entry for chunk_inverse.py's launch
BF16_DOTS_MIN_BLOCK_V = 32  # bf16 chain products on 16-row V tiles wrote non-finite outputs on the H200


@dataclass(frozen=True)
class ChunkConfig:
    """Launch configuration of one call (``chunk_config`` picks it from the shapes)."""
    chunk: int = CHUNK_SIZE          # tokens per chunk: 16, 32 or 64 (a multiple of SUB)
    block_v: int = 64                # V rows of the state tile per state-kernel program
    slice_k: int = 32                # prep: columns of K (and V) a [C, slice] piece spans; wider ones spill
    prep_warps: int = 4
    state_warps: int = 8
    dot_precision: str = "tf32"      # "tf32", "tf32x3" or "ieee"
    pipeline_stages: int = 2         # state kernel: chunks whose factors are in flight at once (1: none ahead)
    factor_spread_max: float = 60.0  # default gate: a sub-block's in-block pairs are one product where
    #                                  its log-decay spread is at most this (e^60 is far inside float32)
    factor_safe_gate: bool = True    # safe gate: factored up to SAFE_SPREAD_MAX (False: exact everywhere)
    chain_pieces: int = 1            # the state chain of each sequence cut into this many pieces (> 1: three
    #                                  launches; fills the GPU for one long sequence with few heads)
    split_prep: bool = False         # the prep as three launches (token-parallel; exact in-sub-block
    #                                  pairs, a program per sub-block; the rest): fewer registers each
    qk_from_input: bool = False      # prep: the later phases read q and k from the inputs and scale them
    #                                  by the reciprocal row norms the first phase keeps, instead of float32
    #                                  k̂ and q̂ in the workspace (the same values: fewer bytes moved)
    split_rest: bool = False         # with split_prep, the last launch as three: the column-block
    #                                  products (two launches with products="block_programs"), the
    #                                  inverse, w and u (fewer registers each; a profile times them apart)
    factor_dtype: str = "float32"    # the chain's factors (w, u, q̂ ⊙ e^Γ, k̂ ⊙ e^(Γ_C - Γ)) as stored
    #                                  for the state kernel: "bfloat16" halves the bytes it streams per
    #                                  V tile, at one bf16 rounding of each factor (the math stays float32)
    update_factor_dtype: str = ""    # the state update's factors (w, u, k̂ ⊙ e^(Γ_C - Γ)) as stored, when they
    #                                  differ from factor_dtype ("" : the same): float32 keeps the state chain
    #                                  at float32 accuracy where only q̂ ⊙ e^Γ, which feeds the outputs alone,
    #                                  is rounded to bf16
    chain_dot_dtype: str = "float32"  # the state kernel's products: "bfloat16" operands (the state and the
    #                                  factors rounded for the product; float32 accumulation and state),
    #                                  on V tiles of BF16_DOTS_MIN_BLOCK_V rows or more
    inverse: str = "substitution"    # (I + A)^-1 below its 16 x 16 diagonal blocks: "substitution" (block
    #                                  row by block row, 16-row products) or "doubling" (16 -> 32 -> 64:
    #                                  one pair of products per level on 16- then 32-row blocks)
    diagonal_programs: bool = False  # with split_rest: the inverse's 16 x 16 diagonal blocks as one-warp
    #                                  programs of their own (chunk_inverse.py) before the rest of it
    outputs: str = "in_chain"        # "in_chain" (each chunk's outputs inside the serial state chain) or
    #                                  "after_chain" (the chain stores each chunk's start state and U, and a
    #                                  token-parallel launch computes the outputs: two of the chain's four
    #                                  products and its q̂, P loads out of the serial loop; one piece only)
    output_block_v: int = 64         # after_chain: V rows of an output program
    output_warps: int = 4
    products: str = "by_block"       # the A and P products: "by_block" (a column block at a time, every K
    #                                  slice of k, q and Γ loaded again for each), "by_slice" (every
    #                                  column block's product accumulated per K slice, each slice loaded
    #                                  once: a quarter of the loads, every block's accumulators live) or
    #                                  "block_programs" (with split_rest: the by-block products, a program
    #                                  per column block, the blocks' loads shared in the L2; two launches,
    #                                  the lower half of the blocks on the lower half of the rows)
    qk_pairs_dtype: str = "float32"  # P (the q̂k̂ pair sums) as stored for the chain: "bfloat16" with bf16
    #                                  chain products, whose operand it is (the same bits, half the bytes)
    lower_block_warps: int = 2       # block_programs: warps of the lower blocks' programs ([C / 2, 16] products)
    factor_programs: bool = False    # with split_rest: w, u and the chain's other factors a program per K
    #                                  and V slice (chunk_factors.py) instead of a loop over the slices
    steep_pairs: str = "by_column"   # a steep sub-block's exact pairs: "by_column" (every K slice of the
    #                                  block's rows loaded again for each of its 16 columns) or
    #                                  "by_slice" (each slice loaded once for all columns; the same bits)

    def __post_init__(self):
        for name, allowed in (("factor_dtype", tuple(_FACTOR_DTYPES)), ("chain_dot_dtype", tuple(_FACTOR_DTYPES)),
                              ("update_factor_dtype", ("", *_FACTOR_DTYPES)),
                              ("qk_pairs_dtype", tuple(_FACTOR_DTYPES)),
                              ("dot_precision", _DOT_PRECISIONS), ("inverse", _INVERSES),
                              ("products", _PRODUCTS), ("outputs", _OUTPUTS), ("steep_pairs", _STEEP_PAIRS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ChunkConfig.{name} must be one of {', '.join(map(repr, allowed))} "
                                 f"(got {getattr(self, name)!r}).")
        for name in ("prep_warps", "state_warps", "output_warps", "lower_block_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"ChunkConfig.{name} must be a power of two up to 16 (got {getattr(self, name)!r}).")
        if self.qk_pairs_dtype == "bfloat16" and self.chain_dot_dtype != "bfloat16":
            raise ValueError("ChunkConfig.qk_pairs_dtype='bfloat16' needs chain_dot_dtype='bfloat16' (P is stored "
                             "rounded as the bf16 chain products take it; float32 products would see the rounding).")
        if (self.products == "block_programs" or self.factor_programs) and not (self.split_prep and self.split_rest):
            raise ValueError("ChunkConfig: products='block_programs' and factor_programs need split_prep and "
                             "split_rest (their launches of their own).")


# Outputs after the chain where the chains are few and long: at most this many chain programs
# (sequences x value heads x V tiles) and at least OUTPUTS_AFTER_FROM_TOKENS tokens a sequence.
OUTPUTS_AFTER_MAX_CHAINS = 64
OUTPUTS_AFTER_FROM_TOKENS = 4096
# From CHAIN_PIECES_FROM_TOKENS tokens a sequence, those few chains are cut into CHAIN_PIECES
# pieces instead: the serial loop is what such a call waits on (docs/tuning.md, "chunk_prefill").
CHAIN_PIECES_FROM_TOKENS = 8192
CHAIN_PIECES = 4


def chunk_config(N: int, HV: int, K: int, V: int, chunk: int = CHUNK_SIZE,
                 act_dtype: torch.dtype = torch.float32, T: int = 0) -> ChunkConfig:
    """Pinned from shapes (no autotuning in a serving call). The state kernel's V tile: the
    widest of 64 / 32 / 16 rows that still gives about two programs per SM of an H200
    (132 SMs) in the serial chain, or with bf16 chain products about one 64-row program per SM
    (a long sequence with few heads needs narrow tiles to fill the GPU; many sequences reread
    the chunk's factors fewer times with wide ones).
    Head dims above 128 take 32-token chunks and V tiles of at most 32 rows.
    The later prep phases read q and k from the inputs (``qk_from_input``), the prep runs as
    six launches (five at 16-token chunks; ``split_prep``, ``split_rest``, the products as two)
    and one more that inverts the 16 x 16 diagonal blocks one warp each (``diagonal_programs``),
    after which the rest of the inverse is built by doubling (``inverse``), and the chain's
    factors are stored in the
    activations' dtype when that is bf16 (``factor_dtype``; float32 otherwise), as fla stores
    its w and u: the chain streams half the bytes and its kernel holds fewer registers, and the
    call stays more accurate against float64 than fla's (docs/tuning.md, "chunk_prefill").
    The A and P products run a program per column block (``products``, the lower blocks'
    on ``lower_block_warps``), w and u a program per slice (``factor_programs``); with bf16 chain
    products P is stored in bf16 (``qk_pairs_dtype``: the same bits, half of P's bytes), and
    the steep sub-blocks' exact pairs load each K slice once for all 16 columns (``steep_pairs``, the
    same bits). Few long chains (``T`` tokens over the ``N`` sequences) take their outputs
    after the chain (``outputs``): the serial loop then runs two products a chunk instead of
    four; longer ones are cut into pieces (``chain_pieces``) that run side by side."""
    wide = max(K, V) > 128  # head dims up to 256: 32-token chunks and V tiles of <= 32 rows keep tiles in budget
    if wide:
        chunk = min(chunk, 32)
    bf16 = act_dtype == torch.bfloat16 and not wide
    bv_max = max(16, next_power_of_2(V))

    def state_tile(programs):
        """The V tile for ``programs`` chain programs a (head, V tile): a program an SM or so."""
        block_v = 16
        for bv in (64, 32):
            if programs * HV * cdiv(V, bv) >= 264:
                block_v = bv
                break
        if bf16 and block_v < 64 and programs * HV * cdiv(V, 64) >= 128:
            block_v = 64  # bf16 products: one 64-row program an SM beat two 32-row ones (8 x 2k at H = 8)
        elif bf16 and block_v == 16 and programs * HV * cdiv(V, 32) >= 128:
            block_v = 32  # bf16 products need the wider tile (below), and about one program an SM still runs
        return min(block_v, bv_max, 32 if wide else 64)

    block_v = state_tile(N)
    few = N * HV * cdiv(V, block_v) <= OUTPUTS_AFTER_MAX_CHAINS
    # (not for head dims above 128: the start-state walk holds a whole [K, K] map, past shared memory)
    pieces = CHAIN_PIECES if few and not wide and T >= CHAIN_PIECES_FROM_TOKENS * max(N, 1) else 1
    if pieces > 1:
        block_v = state_tile(N * pieces)  # the pieces' programs run side by side
    # bf16 chain products (bf16 activations) from 32-row V tiles on: half the registers and
    # shared memory a chunk, so two chunks in flight on 8 warps. 16-row tiles keep float32
    # products: with bf16 ones they wrote non-finite outputs on the H200 (unexplained, docs/tuning.md).
    # Otherwise two chunks in flight only for the narrowest V tile (wider float32 ones exceed the
    # shared memory); 4 warps there, 8 for the widest.
    bf16_dots = bf16 and block_v >= BF16_DOTS_MIN_BLOCK_V
    after = few and pieces == 1 and T >= OUTPUTS_AFTER_FROM_TOKENS * max(N, 1)
    # Float32 activations ask for float32 results: three-pass TF32 products (one pass rounds each
    # operand to 10 mantissa bits, ~1e-3 relative error against float64). bf16 and fp16 inputs carry
    # no more bits than one TF32 pass keeps.
    dot_precision = "tf32x3" if act_dtype == torch.float32 else "tf32"
    return ChunkConfig(chunk=chunk, block_v=block_v, prep_warps=4, dot_precision=dot_precision,
                       state_warps=8 if block_v >= 64 or bf16_dots else 4,
                       pipeline_stages=2 if block_v <= 16 or bf16_dots else 1, split_prep=True, split_rest=True,
                       qk_from_input=True, factor_dtype="bfloat16" if bf16 else "float32",
                       chain_dot_dtype="bfloat16" if bf16_dots else "float32",
                       qk_pairs_dtype="bfloat16" if bf16_dots else "float32", inverse="doubling",
                       diagonal_programs=True, products="block_programs", factor_programs=True,
                       outputs="after_chain" if after else "in_chain", steep_pairs="by_slice",
                       chain_pieces=pieces)


@triton.jit
def _bcast(flag, like):
    """The scalar boolean ``flag`` as a block of ``like``'s shape (a block mask may not be
    combined with a scalar one: Triton 3.9's interpreter rejects it)."""
    return (tl.zeros(like.shape, dtype=tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def _chunk_prep_kernel(
    q, k, v, g, beta, A_log, dt_bias, cu_seqlens, chunk_first, chunk_seq,
    ws_q, ws_k, ws_w, ws_u, ws_p, ws_a, ws_g, ws_n, f_q, f_k, f_w,
    num_seqs, T,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_g_h,
    stride_b_t, stride_b_h,
    scale, lower_bound, diag_spread_max,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr, SLICE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, SAFE_GATE: tl.constexpr,
    BETA_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PHASES: tl.constexpr, SUB_BLOCK_PROGRAMS: tl.constexpr, QK_FROM_INPUT: tl.constexpr,
    INVERSE_BY_DOUBLING: tl.constexpr, DIAGONAL_INVERTED: tl.constexpr, PRODUCTS_BY_SLICE: tl.constexpr,
    STEEP_BY_SLICE: tl.constexpr, FACTORS_IN_PLACE: tl.constexpr, PARTS: tl.constexpr, BLOCK_LAUNCH: tl.constexpr,
):
    # Every phase reads what it needs back from the (L2-resident) workspace in 16-row or
    # SLICE-column pieces, so that no [C, K] tile outlives its phase: whole-chunk tiles kept
    # live across phases spill registers. PHASES (bits: 1 token-parallel, 2 the exact
    # in-sub-block pairs, 4 the column-block products, 8 the inverse, 16 w and u and the
    # chain's other factors) lets a launch run some of them: split over launches,
    # each kernel holds fewer registers, so more programs share an SM. SUB_BLOCK_PROGRAMS:
    # one program per sub-block (program_id 2) instead of a loop over them. QK_FROM_INPUT:
    # the first phase keeps each row's reciprocal norms of k and q (ws_n), and the later phases read
    # q and k from the inputs and scale them as the first phase would have (_unit_rows).
    # f_q, f_k, f_w (and ws_u): where the chain's factors go, in their dtype; float32 ones
    # are ws_q, ws_k, ws_w themselves, written over q̂, k̂ and Γ.
    # PARTS programs a (chunk, head), adjacent in the grid so that they share its loads in the L2:
    # the by-block products a column block each (BLOCK_LAUNCH 1: the upper half of the blocks,
    # 2: the lower half; 0: every block in one program), or the factors a K and V slice each
    i_c, part, i_hv = tl.program_id(0) // PARTS, tl.program_id(0) % PARTS, tl.program_id(1)
    i_h = i_hv // (HV // H)
    c64 = i_c.to(tl.int64)
    NB: tl.constexpr = C // 16
    t0, n_tok = _chunk_tokens(chunk_seq, chunk_first, cu_seqlens, i_c, num_seqs, T, C)  # none past the plan

    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < n_tok
    tok = t0 + offs_c
    # This (chunk, head)'s rows of the [rows, ...] workspaces; offsets inside them are int32
    # (64-bit offset tiles double the registers every address takes).
    ws_row = (c64 * HV + i_hv) * C
    wq = ws_q + ws_row * BLOCK_K
    wk = ws_k + ws_row * BLOCK_K
    ww = ws_w + ws_row * BLOCK_K
    wa = ws_a + ws_row * C
    wp = ws_p + ws_row * C
    wn = ws_n + ws_row * 2  # (1 / norm of k, 1 / norm of q) a row, with QK_FROM_INPUT and the L2 norm
    k_h = k + i_h * stride_k_h
    q_h = q + i_h * stride_q_h

    # ---- token-parallel: normalised k̂ and q̂ (scaled), the cumulative decay Γ ----
    # In SLICE-column pieces too: the row norms first, over every piece.
    offs_n = tl.arange(0, SLICE)
    if PHASES & 1:
        p_kt = k + tok[:, None] * stride_k_t + i_h * stride_k_h
        p_qt = q + tok[:, None] * stride_q_t + i_h * stride_q_h
        p_gt = g + tok[:, None] * stride_g_t + i_hv * stride_g_h
        if USE_QK_L2NORM:
            ss_k = tl.zeros([C], dtype=tl.float32)
            ss_q = tl.zeros([C], dtype=tl.float32)
            for kk in tl.static_range(0, BLOCK_K, SLICE):
                m = mask_c[:, None] & ((kk + offs_n) < K)[None, :]
                b_k = tl.load(p_kt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
                b_q = tl.load(p_qt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
                ss_k += tl.sum(b_k * b_k, axis=1)
                ss_q += tl.sum(b_q * b_q, axis=1)
            # reciprocals: every phase multiplies (a division an element costs about ten instructions)
            inv_k = 1.0 / tl.sqrt(ss_k + 1e-6)
            inv_q = 1.0 / tl.sqrt(ss_q + 1e-6)
            if QK_FROM_INPUT:
                tl.store(wn + offs_c * 2, inv_k)
                tl.store(wn + offs_c * 2 + 1, inv_q)
        for kk in tl.static_range(0, BLOCK_K, SLICE):
            in_k = (kk + offs_n) < K
            m = mask_c[:, None] & in_k[None, :]
            p_sl = offs_c[:, None] * BLOCK_K + kk + offs_n[None, :]
            if not QK_FROM_INPUT:
                b_k = tl.load(p_kt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
                b_q = tl.load(p_qt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
                if USE_QK_L2NORM:
                    b_k = b_k * inv_k[:, None]
                    b_q = b_q * inv_q[:, None]
                tl.store(wk + p_sl, b_k)
                tl.store(wq + p_sl, b_q * scale)
            b_g = tl.load(p_gt + kk + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
            if GATE_IN_KERNEL:
                A_h = tl.load(A_log + i_hv).to(tl.float32)
                bias = tl.load(dt_bias + i_hv * K + kk + offs_n, mask=in_k, other=0.0).to(tl.float32)
                b_g = kda_log_decay(b_g, bias[None, :], A_h, lower_bound, SAFE_GATE)
            b_g = tl.where(m, b_g, 0.0)  # rows past the chunk's tokens: no decay, so Γ_C is the last token's
            tl.store(ww + p_sl, tl.cumsum(b_g, axis=0))  # Γ: chunk-local, inclusive, <= 0 and non-increasing
    tl.debug_barrier()

    # ---- A (β-scaled, strictly lower) and P (lower) ----
    # By column block j (the pairs whose earlier token r is in sub-block j), over all the rows
    # below it at once: a [C, K] x [K, 16] product ([C / 2, K] in block_programs' lower launch),
    # the rows split over the warps (16-row products would copy their left operand into every
    # warp). Factored at a token b, e^(Γ_s - Γ_b) · e^(Γ_b - Γ_r) = e^(Γ_s - Γ_r):
    # - b the token before sub-block j, the block's own rows included, where the sub-block's
    #   log-decay spread (Γ_b - Γ of its last token, per channel) is at most ``diag_spread_max``:
    #   e^(Γ_b - Γ_r) <= e^spread, the only positive exponent (e^60 is far inside float32), and
    #   a left factor that underflows belongs to a term below e^(spread - 87);
    # - else b the last token of sub-block j, rows below the block only (both factors <= 1),
    #   and the block's own pairs take their exact decays element-wise, a column at a time on
    #   [16, SLICE] pieces (the default gate is unbounded: no factoring inside a steep block).
    # Both phases decide from the same workspace values, so they agree on every block.
    offs_s = tl.arange(0, 16)
    if PHASES & 2:
        for i in range(NB):  # a loop, not unrolled: unrolled sub-blocks keep each other's tiles live
            if SUB_BLOCK_PROGRAMS:
                run = i == tl.program_id(2)
            else:
                run = i >= 0
            if run:
                spread = _block_spread(ww, i, offs_k, BLOCK_K)
                if spread > diag_spread_max:
                    rows = i * 16 + offs_s
                    beta_i = _beta_values(beta, t0 + rows, rows < n_tok, stride_b_t, stride_b_h, i_hv, BETA_MODE)
                    if STEEP_BY_SLICE:
                        _steep_block_pairs_by_slice(wa, wp, ww, wk, wq, wn, k_h, q_h, i, beta_i, t0, n_tok,
                                                    stride_k_t, stride_q_t, scale, K, BLOCK_K, C, SLICE,
                                                    USE_QK_L2NORM, QK_FROM_INPUT)
                    else:  # a column at a time
                        for r in range(16):
                            a_col = tl.zeros([16], dtype=tl.float32)
                            p_col = tl.zeros([16], dtype=tl.float32)
                            for kk in tl.static_range(0, BLOCK_K, SLICE):
                                p_ik = rows[:, None] * BLOCK_K + kk + offs_n[None, :]
                                k_r, G_r = _steep_column(ww, wk, wn, k_h, i * 16 + r, kk, offs_n, t0, n_tok,
                                                         stride_k_t, K, BLOCK_K, USE_QK_L2NORM, QK_FROM_INPUT)
                                d = tl.where((offs_s >= r)[:, None], tl.load(ww + p_ik) - G_r[None, :], float("-inf"))
                                kr = k_r[None, :] * tl.exp(d)
                                if QK_FROM_INPUT:
                                    a_col += tl.sum(_unit_rows(k_h, wn, 0, 1.0, t0, n_tok, rows, kk + offs_n, stride_k_t,
                                                               K, USE_QK_L2NORM) * kr, axis=1)
                                    p_col += tl.sum(_unit_rows(q_h, wn, 1, scale, t0, n_tok, rows, kk + offs_n,
                                                               stride_q_t, K, USE_QK_L2NORM) * kr, axis=1)
                                else:
                                    a_col += tl.sum(tl.load(wk + p_ik) * kr, axis=1)
                                    p_col += tl.sum(tl.load(wq + p_ik) * kr, axis=1)
                            tl.store(wa + rows * C + i * 16 + r, tl.where(offs_s > r, a_col * beta_i, 0.0))
                            tl.store(wp + rows * C + i * 16 + r, p_col.to(wp.dtype.element_ty))
    b_beta = _beta_values(beta, tok, mask_c, stride_b_t, stride_b_h, i_hv, BETA_MODE)
    if PHASES & 4:
        if PRODUCTS_BY_SLICE:
            _pair_products_by_slice(wk, wq, ww, wa, wp, wn, k_h, q_h, b_beta, t0, n_tok, stride_k_t, stride_q_t,
                                    scale, diag_spread_max, K, BLOCK_K, C, SLICE, USE_QK_L2NORM, QK_FROM_INPUT,
                                    DOT_PRECISION)
        else:  # a column block at a time: fewer accumulators live, every slice loaded once a block
            if BLOCK_LAUNCH == 0:  # every block, in turn
                for j in range(NB):
                    _column_block_products(wa, wp, wk, wq, ww, wn, k_h, q_h, offs_c, b_beta, j, t0, n_tok,
                                           stride_k_t, stride_q_t, scale, diag_spread_max, K, BLOCK_K, C, SLICE,
                                           USE_QK_L2NORM, QK_FROM_INPUT, DOT_PRECISION)
            else:  # a program per block: of the upper half on every row (BLOCK_LAUNCH 1), of the
                #      lower half on the lower half of the rows, all it covers (2)
                rows, betas, j = offs_c, b_beta, part
                if BLOCK_LAUNCH == 2:
                    rows = C // 2 + tl.arange(0, C // 2)
                    betas = _beta_values(beta, t0 + rows, rows < n_tok, stride_b_t, stride_b_h, i_hv, BETA_MODE)
                    j = NB // 2 + part
                _column_block_products(wa, wp, wk, wq, ww, wn, k_h, q_h, rows, betas, j, t0, n_tok, stride_k_t,
                                       stride_q_t, scale, diag_spread_max, K, BLOCK_K, C, SLICE, USE_QK_L2NORM,
                                       QK_FROM_INPUT, DOT_PRECISION)
    tl.debug_barrier()

    if PHASES & 8:
        # ---- T = (I + A)^-1 in place of A ----
        # (with DIAGONAL_INVERTED the 16 x 16 diagonal blocks hold their inverses: chunk_inverse.py)
        if INVERSE_BY_DOUBLING:
            _invert_unit_lower_by_doubling(wa, C, NB, DOT_PRECISION, DIAGONAL_INVERTED)
        else:
            _invert_unit_lower(wa, C, NB, DOT_PRECISION, DIAGONAL_INVERTED)
        tl.debug_barrier()

    if PHASES & 16:
        # ---- w = T diag(β)(k̂ ⊙ e^Γ), u = T diag(β) v, q̂ ⊙ e^Γ, k̂ ⊙ e^(Γ_C - Γ), e^Γ_C ----
        # (chunk_factors.py) a K and a V slice at a time: all of them here, or with PARTS > 1
        # this program's part only (a program per slice)
        p_cc = offs_c[:, None] * C + offs_c[None, :]
        blk = offs_c // 16
        b_T = tl.load(wa + p_cc, mask=blk[:, None] >= blk[None, :], other=0.0)
        f_row = ws_row * BLOCK_K
        g_last = ws_g + (c64 * HV + i_hv) * BLOCK_K
        u_row = ws_u + ws_row * BLOCK_V
        v_h = v + i_hv * stride_v_h
        if PARTS > 1:
            if part * SLICE < BLOCK_K:
                _k_slice_factors(b_T, b_beta, part * SLICE, ww, wk, wq, wn, k_h, q_h, f_w + f_row, f_q + f_row,
                                 f_k + f_row, g_last, t0, n_tok, stride_k_t, stride_q_t, scale, K, BLOCK_K, C, SLICE,
                                 USE_QK_L2NORM, QK_FROM_INPUT, FACTORS_IN_PLACE, DOT_PRECISION)
            if part * SLICE < BLOCK_V:
                _v_slice_factors(b_T, b_beta, part * SLICE, v_h, tok, mask_c, stride_v_t, u_row, V, BLOCK_V, C,
                                 SLICE, DOT_PRECISION)
        else:
            for kk in tl.static_range(0, BLOCK_K, SLICE):
                _k_slice_factors(b_T, b_beta, kk, ww, wk, wq, wn, k_h, q_h, f_w + f_row, f_q + f_row, f_k + f_row,
                                 g_last, t0, n_tok, stride_k_t, stride_q_t, scale, K, BLOCK_K, C, SLICE,
                                 USE_QK_L2NORM, QK_FROM_INPUT, FACTORS_IN_PLACE, DOT_PRECISION)
            for vv in tl.static_range(0, BLOCK_V, SLICE):
                _v_slice_factors(b_T, b_beta, vv, v_h, tok, mask_c, stride_v_t, u_row, V, BLOCK_V, C, SLICE,
                                 DOT_PRECISION)


@triton.jit
def _chunk_tokens(chunk_seq, chunk_first, cu_seqlens, i_c, num_seqs, T, C: tl.constexpr):
    """(first token, token count) of global chunk ``i_c`` (count 0 past the plan's end).
    Offsets are clamped into [0, T] (and eos >= bos), as the plan clamps them: no token
    outside the inputs is read whatever cu_seqlens holds (full-check mode rejects such offsets)."""
    seq = tl.load(chunk_seq + i_c).to(tl.int64)
    valid = seq < num_seqs
    seq_c = tl.minimum(seq, num_seqs - 1)
    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + seq_c).to(tl.int64), 0), T)
    eos = tl.maximum(tl.minimum(tl.maximum(tl.load(cu_seqlens + seq_c + 1).to(tl.int64), 0), T), bos)
    t0 = bos + (i_c.to(tl.int64) - tl.load(chunk_first + seq_c).to(tl.int64)) * C
    return t0, tl.where(valid, tl.minimum(eos - t0, C), 0)


@triton.jit
def _beta_values(beta, tok, mask, stride_b_t, stride_b_h, i_hv, BETA_MODE: tl.constexpr):
    """β of the tokens ``tok`` (zeros where not ``mask``) from β or its logit."""
    b = tl.load(beta + tok * stride_b_t + i_hv * stride_b_h, mask=mask, other=0.0).to(tl.float32)
    if BETA_MODE == 1:
        b = tl.sigmoid(b)
    if BETA_MODE == 2:
        b = tl.sigmoid(b) * 2.0
    return tl.where(mask, b, 0.0)


@triton.jit
def _invert_diagonal_blocks(wa, C: tl.constexpr, NB: tl.constexpr):
    """The [NB, 16, 16] diagonal blocks of ``(I + A)^-1`` written over ``A``'s, by forward
    substitution, every block's row r at once (each block whole: zeros above its diagonal)."""
    offs_s = tl.arange(0, 16)
    offs_b = tl.arange(0, NB)
    p_d = (offs_b[:, None, None] * 16 + offs_s[None, :, None]) * C \
        + offs_b[:, None, None] * 16 + offs_s[None, None, :]
    A_d = tl.load(wa + p_d)
    row3 = offs_s[None, :, None] + offs_b[:, None, None] * 0
    col2 = offs_s[None, :] + offs_b[:, None] * 0
    inv = tl.where(row3 == offs_s[None, None, :], 1.0, 0.0)
    for r in range(1, 16):
        a_r = tl.sum(tl.where(row3 == r, A_d, 0.0), axis=1)  # [NB, 16]: row r of each block
        new = tl.where(col2 == r, 1.0, 0.0) - tl.sum(a_r[:, :, None] * inv, axis=1)
        inv = tl.where(row3 == r, new[:, None, :], inv)
    tl.debug_barrier()
    tl.store(wa + p_d, inv)
    tl.debug_barrier()


@triton.jit
def _invert_unit_lower_by_doubling(wa, C: tl.constexpr, NB: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                   DIAGONAL_INVERTED: tl.constexpr):
    """``_invert_unit_lower`` by doubling: from the 16 x 16 diagonal blocks, each level inverts
    the diagonal blocks twice as large, whose lower-left block is ``-T_bb A_ba T_aa`` (T_aa,
    T_bb: the inverses of the level below, A_ba: ``A``'s block under T_aa). Two levels at
    C = 64, each one pair of products per block (16- then 32-row), where the block-row
    substitution takes six dependent steps of 16-row products. ``DIAGONAL_INVERTED``: the 16 x 16
    diagonal blocks hold their inverses already."""
    if not DIAGONAL_INVERTED:
        _invert_diagonal_blocks(wa, C, NB)
    if C > 16:
        _double_diagonal_blocks(wa, C, 16, DOT_PRECISION)
    if C > 32:
        _double_diagonal_blocks(wa, C, 32, DOT_PRECISION)


@triton.jit
def _double_diagonal_blocks(wa, C: tl.constexpr, SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The diagonal blocks of 2 SIZE rows from those of SIZE rows (above): each pair's lower-left
    block ``-T_bb A_ba T_aa`` over ``A_ba``. Above the 16 x 16 diagonal blocks the workspace is
    not written: T_aa and T_bb load masked to the blocks at or below it."""
    offs = tl.arange(0, SIZE)
    blk = offs // 16
    at_or_below = blk[:, None] >= blk[None, :]
    for pair in tl.static_range(C // (2 * SIZE)):
        a = 2 * pair * SIZE
        b = a + SIZE
        t_aa = tl.load(wa + (a + offs)[:, None] * C + a + offs[None, :], mask=at_or_below, other=0.0)
        t_bb = tl.load(wa + (b + offs)[:, None] * C + b + offs[None, :], mask=at_or_below, other=0.0)
        p_ba = (b + offs)[:, None] * C + a + offs[None, :]
        t_ba = -tl.dot(t_bb, tl.dot(tl.load(wa + p_ba), t_aa, input_precision=DOT_PRECISION),
                       input_precision=DOT_PRECISION)
        tl.debug_barrier()  # every thread has read A_ba before any overwrites it
        tl.store(wa + p_ba, t_ba)
    tl.debug_barrier()


@triton.jit
def _invert_unit_lower(wa, C: tl.constexpr, NB: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       DIAGONAL_INVERTED: tl.constexpr):
    """``(I + A)^-1`` for the strictly lower-triangular ``A [C, C]`` at
    ``wa`` (row stride ``C``), written over it (blocks above the diagonal are left as they are;
    ``DIAGONAL_INVERTED``: the 16 x 16 diagonal blocks hold their inverses already)."""
    offs_s = tl.arange(0, 16)
    if not DIAGONAL_INVERTED:
        _invert_diagonal_blocks(wa, C, NB)
    # Below the diagonal, row block by row block, j ascending: T_ij = -T_ii Σ_{j<=m<i} A_im T_mj.
    # T_ij may overwrite A_ij: the later j of row block i read A_im only for m > j.
    for i in tl.static_range(1, NB):
        p_i = (i * 16 + offs_s[:, None]) * C + offs_s[None, :]
        t_ii = tl.load(wa + p_i + i * 16)
        for j in tl.static_range(0, i):
            acc = tl.zeros([16, 16], dtype=tl.float32)
            for m in tl.static_range(j, i):
                a_im = tl.load(wa + p_i + m * 16)
                t_mj = tl.load(wa + (m * 16 + offs_s[:, None]) * C + j * 16 + offs_s[None, :])
                acc = tl.dot(a_im, t_mj, acc, input_precision=DOT_PRECISION)
            t_ij = -tl.dot(t_ii, acc, input_precision=DOT_PRECISION)
            tl.debug_barrier()
            tl.store(wa + p_i + j * 16, t_ij)
            tl.debug_barrier()


@triton.jit
def _chain_dot(a, b, acc, BF16_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` (``a @ b`` when ``acc`` is None) as the chain takes it: bf16 operands
    with ``BF16_DOTS`` (float32 accumulation; a float32 operand, the state's included, is
    rounded for the product alone), else float32 operands at ``DOT_PRECISION``. ``BF16_DOTS``
    2: the same products with the rounded operands widened back to float32 and multiplied
    exactly (the interpreter's bf16 dot reads bf16 bits wrongly; a bf16 x bf16 product is
    exact in float32)."""
    if BF16_DOTS == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    if BF16_DOTS == 2:
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), acc,
                      input_precision="ieee")
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)


@triton.jit
def _chain_step(S, c, c_first, live, counts, n64, bos, eos, i_hv, out, ws_q, ws_k, ws_w, ws_u, ws_p, ws_g, ws_h, ws_v,
                chunk_states, chunk_state_idx, errors, num_chunk_slots, chunk_idx_cols,
                stride_o_t, stride_o_h, stride_cs_slot, stride_cs_h, stride_cs_v, stride_cs_k, stride_ci_n,
                stride_ci_j, offs_c, offs_k, offs_v, mask_v, mask_s,
                HV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V_WS: tl.constexpr, C: tl.constexpr,
                HAS_CHUNK_STATES: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERVAL: tl.constexpr,
                ERR_INDEX: tl.constexpr, V: tl.constexpr, OUTPUTS: tl.constexpr, BF16_DOTS: tl.constexpr):
    """One chunk of the chain for one (sequence, value head, V tile): outputs (``OUTPUTS`` 1),
    or the chunk's start state and ``U`` for ``_chunk_output_kernel`` (``OUTPUTS`` 2), then
    the state. With ``OUTPUTS`` 0 only the state, whose rows past V (the transition of a
    piece of the chain) take no ``u``."""
    ws_row = (c * HV + i_hv) * C
    p_ck = offs_c[:, None] * BLOCK_K + offs_k[None, :]
    b_w = tl.load(ws_w + ws_row * BLOCK_K + p_ck)
    b_u = tl.load(ws_u + ws_row * BLOCK_V_WS + offs_c[:, None] * BLOCK_V_WS + offs_v[None, :],
                  mask=(offs_v < V)[None, :], other=0.0).to(tl.float32)
    b_kd = tl.load(ws_k + ws_row * BLOCK_K + p_ck)
    e_last = tl.load(ws_g + (c * HV + i_hv) * BLOCK_K + offs_k)
    St = tl.trans(S)  # [BLOCK_K, BLOCK_V]
    b_U = b_u - _chain_dot(b_w, St, None, BF16_DOTS, DOT_PRECISION)  # [C, BLOCK_V]
    t0 = bos + (c - c_first) * C
    if OUTPUTS == 2:  # as the products below would take them: the output kernel's bits are the same
        tl.store(ws_h + ((c * HV + i_hv) * BLOCK_V_WS + offs_v[:, None]) * BLOCK_K + offs_k[None, :],
                 S.to(ws_h.dtype.element_ty), mask=mask_s)
        tl.store(ws_v + ws_row * BLOCK_V_WS + offs_c[:, None] * BLOCK_V_WS + offs_v[None, :],
                 b_U.to(ws_v.dtype.element_ty), mask=mask_v[None, :])
    if OUTPUTS == 1:
        b_qg = tl.load(ws_q + ws_row * BLOCK_K + p_ck)
        b_P = tl.load(ws_p + ws_row * C + offs_c[:, None] * C + offs_c[None, :],  # above the diagonal: unwritten
                      mask=offs_c[:, None] // 16 >= offs_c[None, :] // 16, other=0.0)
        b_o = _chain_dot(b_qg, St, None, BF16_DOTS, DOT_PRECISION)
        b_o = _chain_dot(b_P, b_U, b_o, BF16_DOTS, DOT_PRECISION)
        b_o = tl.where(live, b_o, 0.0)
        tok = t0 + offs_c
        tl.store(out + tok[:, None] * stride_o_t + i_hv * stride_o_h + offs_v[None, :],
                 b_o.to(out.dtype.element_ty), mask=(tok < eos)[:, None] & mask_v[None, :])
    S = S * e_last[None, :]
    S = _chain_dot(tl.trans(b_U), b_kd, S, BF16_DOTS, DOT_PRECISION)  # [BLOCK_V, BLOCK_K]
    if HAS_CHUNK_STATES:  # (only with OUTPUTS: the launcher passes it so)
        # The state after the sequence's first (j+1)*INTERVAL tokens, when it has that many.
        EVERY: tl.constexpr = INTERVAL // C
        steps = c - c_first + 1
        j = steps // EVERY - 1
        full = (steps % EVERY == 0) & (t0 + C <= eos) & live & (j < chunk_idx_cols)
        row = tl.load(chunk_state_idx + n64 * stride_ci_n + tl.where(full, j, 0) * stride_ci_j,
                      mask=full, other=-1).to(tl.int64)
        ok = full & (row >= 0) & (row < num_chunk_slots)
        count_bad_row(errors, full & (row >= num_chunk_slots) & counts, ERR_INDEX)
        p_cs = chunk_states + tl.where(ok, row, 0) * stride_cs_slot + i_hv * stride_cs_h \
            + offs_v[:, None] * stride_cs_v + offs_k[None, :] * stride_cs_k
        tl.store(p_cs, S.to(chunk_states.dtype.element_ty), mask=mask_s & _bcast(ok, mask_s))
    return S


@triton.jit
def _chunk_state_kernel(
    out, state, slot_indices, has_initial, cu_seqlens, chunk_first,
    ws_q, ws_k, ws_w, ws_u, ws_p, ws_g, ws_h, ws_v, chunk_states, chunk_state_idx, errors, pieces_ws,
    num_slots, num_chunk_slots, T, max_chunks,
    stride_o_t, stride_o_h, stride_s_slot, stride_s_h, stride_s_v, stride_s_k,
    stride_cs_slot, stride_cs_h, stride_cs_v, stride_cs_k, stride_ci_n, stride_ci_j, chunk_idx_cols,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V_WS: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr, HAS_CHUNK_STATES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PIPELINE_STAGES: tl.constexpr, INTERVAL: tl.constexpr, ERR_INDEX: tl.constexpr,
    PIECES: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, OUTPUTS: tl.constexpr, BF16_DOTS: tl.constexpr,
):
    # MODE 0: the whole chain of a sequence from its pool slot. With the chain cut into PIECES
    # pieces (program_id 2 = sequence * PIECES + piece), MODE 1: a piece's transition, the
    # chain run on the rows [0; I] of a [V + K, K] tile without outputs (rows < V: the state
    # the piece reaches from zeros, B; rows >= V: the map M, so that the piece takes S to
    # S M + B), into ``pieces_ws``; MODE 2: a piece's outputs from its start state (in
    # ``pieces_ws``, from _chunk_pieces_kernel), the last piece writing the final state.
    i_v, i_hv, i_prog = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = i_prog // PIECES
    piece = i_prog % PIECES
    n64 = i_n.to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < ROWS  # V, or V + K for a transition (MODE 1)
    mask_s = mask_v[:, None] & mask_k[None, :]

    slot = tl.load(slot_indices + n64).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)  # anything else is a padding row: no pool access
    counts = (i_v == 0) & (i_hv == 0)  # the one program of the sequence (of the piece) that counts
    if MODE != 1:
        count_bad_row(errors, (slot >= num_slots) & counts & (piece == 0), ERR_INDEX)
    read = live
    if HAS_INITIAL_FLAGS:
        read = read & (tl.load(has_initial + n64) != 0)
    p_state = state + tl.where(live, slot, 0) * stride_s_slot + i_hv * stride_s_h \
        + offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k
    p_piece = pieces_ws + ((i_prog.to(tl.int64) * HV + i_hv) * ROWS + offs_v[:, None]) * K + offs_k[None, :]
    if MODE == 0:
        S = tl.load(p_state, mask=mask_s & _bcast(read, mask_s), other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_K]
    elif MODE == 1:
        S = tl.where((offs_v[:, None] - V == offs_k[None, :]) & mask_s, 1.0, 0.0)
    else:
        S = tl.load(p_piece, mask=mask_s, other=0.0)

    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + n64).to(tl.int64), 0), T)
    eos = tl.maximum(tl.minimum(tl.maximum(tl.load(cu_seqlens + n64 + 1).to(tl.int64), 0), T), bos)
    c_first = tl.load(chunk_first + n64).to(tl.int64)
    c_end = tl.minimum(tl.load(chunk_first + n64 + 1).to(tl.int64), max_chunks)  # never past the workspace
    c_lo = c_first
    c_hi = c_end
    if PIECES > 1:
        per_piece = (tl.maximum(c_end - c_first, 0) + PIECES - 1) // PIECES
        c_lo = tl.minimum(c_first + piece * per_piece, c_end)
        c_hi = tl.minimum(c_lo + per_piece, c_end)
    if PIPELINE_STAGES > 1:
        # A counted loop, so that the compiler streams the next chunks' factors into shared
        # memory while this chunk's products run (the interpreter cannot run a loop whose
        # bound is loaded, so it takes the while loop below: the same step).
        for c in tl.range(c_lo, c_hi, num_stages=PIPELINE_STAGES):
            S = _chain_step(S, c, c_first, live, counts, n64, bos, eos, i_hv, out, ws_q, ws_k, ws_w, ws_u, ws_p, ws_g,
                            ws_h, ws_v, chunk_states, chunk_state_idx, errors, num_chunk_slots, chunk_idx_cols,
                            stride_o_t, stride_o_h, stride_cs_slot, stride_cs_h, stride_cs_v, stride_cs_k,
                            stride_ci_n, stride_ci_j, offs_c, offs_k, offs_v, mask_v, mask_s,
                            HV, BLOCK_K, BLOCK_V_WS, C, HAS_CHUNK_STATES, DOT_PRECISION, INTERVAL, ERR_INDEX,
                            V, OUTPUTS, BF16_DOTS)
    else:
        c = c_lo
        while c < c_hi:
            S = _chain_step(S, c, c_first, live, counts, n64, bos, eos, i_hv, out, ws_q, ws_k, ws_w, ws_u, ws_p, ws_g,
                            ws_h, ws_v, chunk_states, chunk_state_idx, errors, num_chunk_slots, chunk_idx_cols,
                            stride_o_t, stride_o_h, stride_cs_slot, stride_cs_h, stride_cs_v, stride_cs_k,
                            stride_ci_n, stride_ci_j, offs_c, offs_k, offs_v, mask_v, mask_s,
                            HV, BLOCK_K, BLOCK_V_WS, C, HAS_CHUNK_STATES, DOT_PRECISION, INTERVAL, ERR_INDEX,
                            V, OUTPUTS, BF16_DOTS)
            c += 1
    if MODE == 1:
        tl.store(p_piece, S, mask=mask_s)
    else:
        # The piece that holds the sequence's last chunk (piece 0 of an empty one) ends it.
        last = (c_hi >= c_end) & ((c_lo < c_end) | (piece == 0))
        tl.store(p_state, S.to(state.dtype.element_ty), mask=mask_s & _bcast(live & last, mask_s))


@triton.jit
def _chunk_output_kernel(out, slot_indices, cu_seqlens, chunk_first, chunk_seq, ws_q, ws_p, ws_h, ws_v,
                         num_seqs, num_slots, T, stride_o_t, stride_o_h,
                         HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V_WS: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BF16_DOTS: tl.constexpr):
    """A chunk's outputs ``o = (q̂ ⊙ e^Γ) S0ᵀ + P U`` from the start state and ``U`` the chain
    stored (``OUTPUTS`` 2), one program per (V tile, value head, chunk): the products the
    chain would have run, out of its serial loop. Zeros for a padding sequence."""
    i_v, i_hv, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c64 = i_c.to(tl.int64)
    t0, n_tok = _chunk_tokens(chunk_seq, chunk_first, cu_seqlens, i_c, num_seqs, T, C)
    seq = tl.minimum(tl.load(chunk_seq + i_c), num_seqs - 1).to(tl.int64)
    slot = tl.load(slot_indices + seq).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    rows = offs_c < n_tok  # none past the plan's chunks
    ws_row = (c64 * HV + i_hv) * C
    b_qg = tl.load(ws_q + (ws_row + offs_c[:, None]) * BLOCK_K + offs_k[None, :], mask=rows[:, None], other=0.0)
    b_P = tl.load(ws_p + (ws_row + offs_c[:, None]) * C + offs_c[None, :],  # above the diagonal: unwritten
                  mask=rows[:, None] & (offs_c[:, None] // 16 >= offs_c[None, :] // 16), other=0.0)
    # the chain stores the state's K columns only: the tile's columns past K are never written
    b_S = tl.load(ws_h + ((c64 * HV + i_hv) * BLOCK_V_WS + offs_v[:, None]) * BLOCK_K + offs_k[None, :],
                  mask=mask_v[:, None] & (offs_k < K)[None, :] & _bcast(n_tok > 0, mask_v[:, None]), other=0.0)
    b_U = tl.load(ws_v + (ws_row + offs_c[:, None]) * BLOCK_V_WS + offs_v[None, :],
                  mask=rows[:, None] & mask_v[None, :], other=0.0)
    b_o = _chain_dot(b_qg, tl.trans(b_S), None, BF16_DOTS, DOT_PRECISION)
    b_o = _chain_dot(b_P, b_U, b_o, BF16_DOTS, DOT_PRECISION)
    b_o = tl.where(_bcast(live, b_o), b_o, 0.0)
    tl.store(out + (t0 + offs_c)[:, None] * stride_o_t + i_hv * stride_o_h + offs_v[None, :],
             b_o.to(out.dtype.element_ty), mask=rows[:, None] & mask_v[None, :])


@triton.jit
def _chunk_pieces_kernel(state, slot_indices, has_initial, pieces_ws, starts, num_slots,
                         stride_s_slot, stride_s_h, stride_s_v, stride_s_k,
                         HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, PIECES: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Each piece's start state from the pool slot and the pieces' transitions (S M + B), the
    pieces in order: the only serial part of a cut chain, one [V, K] x [K, K] product a piece."""
    i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n64 = i_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_s = (offs_v < V)[:, None] & mask_k[None, :]
    slot = tl.load(slot_indices + n64).to(tl.int64)
    read = (slot >= 0) & (slot < num_slots)
    if HAS_INITIAL_FLAGS:
        read = read & (tl.load(has_initial + n64) != 0)
    p_state = state + tl.where(read, slot, 0) * stride_s_slot + i_hv * stride_s_h \
        + offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k
    S = tl.load(p_state, mask=mask_s & _bcast(read, mask_s), other=0.0).to(tl.float32)
    for p in tl.static_range(PIECES):
        prog = n64 * PIECES + p
        tl.store(starts + ((prog * HV + i_hv) * V + offs_v[:, None]) * K + offs_k[None, :], S, mask=mask_s)
        base = pieces_ws + (prog * HV + i_hv) * (V + K) * K
        B = tl.load(base + offs_v[:, None] * K + offs_k[None, :], mask=mask_s, other=0.0)
        M = tl.load(base + (V + offs_k[:, None]) * K + offs_k[None, :], mask=mask_k[:, None] & mask_k[None, :],
                    other=0.0)
        S = tl.dot(S, M, B, input_precision=DOT_PRECISION)


_chunk_prep = CachedKernel(_chunk_prep_kernel)
_chunk_state = CachedKernel(_chunk_state_kernel)
_chunk_pieces = CachedKernel(_chunk_pieces_kernel)
_chunk_output = CachedKernel(_chunk_output_kernel)


def chunk_plan(cu_seqlens: torch.Tensor, chunk: int, max_chunks: int, T: int | None = None):
    """On the device, no sync: ``chunk_first [N+1]`` (the first global chunk of each
    sequence; ``chunk_first[N]`` is the chunk count) and ``chunk_seq [max_chunks]`` (the
    sequence of each global chunk; ``N`` for chunks past the end), int32. Offsets are
    clamped into ``[0, T]`` as the kernels clamp them."""
    cu = cu_seqlens.to(torch.int64)
    if T is not None:
        cu = cu.clamp(0, T)
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    first = torch.zeros(cu.numel(), dtype=torch.int64, device=cu.device)
    torch.cumsum((lens + chunk - 1) // chunk, 0, out=first[1:])
    ids = torch.arange(max_chunks, dtype=torch.int64, device=cu.device)
    seq = torch.searchsorted(first[1:].contiguous(), ids, right=True)
    return first.to(torch.int32), seq.to(torch.int32)


def max_chunks_for(T: int, N: int, chunk: int = CHUNK_SIZE) -> int:
    """An upper bound on ``Σ_n ceil(len_n / chunk)`` from shapes alone (``Σ len_n <= T``)."""
    return T // chunk + N


@register("chunk_prefill", "triton")
def chunk_prefill_triton(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, scale, use_qk_l2norm, A_log,
                         dt_bias, lower_bound, beta_mode, has_initial_state, chunk_states, chunk_state_indices,
                         config: ChunkConfig | None = None, chunk_state_interval: int = CHUNK_SIZE):
    """``chunk_state_interval``: tokens between the states written to ``chunk_states`` (a
    multiple of the kernel's chunk; the public op's is ``CHUNK_SIZE``)."""
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1
    if N == 0 or HV == 0:
        return out
    cfg = config or chunk_config(N, HV, K, V, act_dtype=q.dtype, T=T)
    C = cfg.chunk
    if chunk_states is not None and chunk_state_interval % C:
        raise ValueError(f"chunk_state_interval={chunk_state_interval} must be a multiple of the chunk ({C}).")
    BK = next_power_of_2(max(K, 16))
    BVW = next_power_of_2(max(V, 16))
    block_v = min(cfg.block_v, BVW)
    if cfg.chain_dot_dtype == "bfloat16" and block_v < BF16_DOTS_MIN_BLOCK_V:
        raise ValueError(f"ChunkConfig.chain_dot_dtype='bfloat16' needs V tiles of at least "
                         f"{BF16_DOTS_MIN_BLOCK_V} rows (this call's tile: {block_v}); on 16-row tiles "
                         "the bf16 chain products wrote non-finite outputs on the H200.")
    max_chunks = max_chunks_for(T, N, C)
    first, seq = chunk_plan(cu_seqlens, C, max_chunks, T)
    dev = q.device
    rows = max_chunks * HV * C
    factor_dtype = _FACTOR_DTYPES[cfg.factor_dtype]
    # q̂ and k̂ in float32 unless the later phases read the inputs; with float32 factors the
    # chain's factors are written over q̂, k̂ and Γ (ws_q, ws_k, ws_w), else into their own buffers.
    qk_dtype = factor_dtype if cfg.qk_from_input else torch.float32
    ws_q = torch.empty(rows, BK, dtype=qk_dtype, device=dev)
    ws_k = torch.empty(rows, BK, dtype=qk_dtype, device=dev)
    ws_w = torch.empty(rows, BK, dtype=torch.float32, device=dev)
    update_dtype = _FACTOR_DTYPES[cfg.update_factor_dtype or cfg.factor_dtype]
    ws_u = torch.empty(rows, BVW, dtype=update_dtype, device=dev)
    f_q, f_k, f_w = (ws if ws.dtype == dtype else torch.empty_like(ws, dtype=dtype)
                     for ws, dtype in ((ws_q, factor_dtype), (ws_k, update_dtype), (ws_w, update_dtype)))
    ws_p = torch.empty(rows, C, dtype=_FACTOR_DTYPES[cfg.qk_pairs_dtype], device=dev)
    ws_a = torch.empty(rows, C, dtype=torch.float32, device=dev)
    ws_g = torch.empty(max_chunks * HV, BK, dtype=torch.float32, device=dev)
    # the reciprocal row norms of k and q, kept for the later phases (qk_from_input with the L2 norm)
    ws_n = torch.empty(rows, 2, dtype=torch.float32, device=dev) if cfg.qk_from_input and use_qk_l2norm else ws_g
    gate = A_log is not None
    if lower_bound is None:
        spread_max = cfg.factor_spread_max
    else:  # a sub-block's spread is below 16 |lower_bound|: up to e^80 (|lower_bound| <= 5), all factored
        spread_max = SAFE_SPREAD_MAX if cfg.factor_safe_gate else -1.0
    prep_args = (q, k, v, g, beta, A_log if gate else q, dt_bias if gate else q, cu_seqlens, first, seq,
                 ws_q, ws_k, ws_w, ws_u, ws_p, ws_a, ws_g, ws_n, f_q, f_k, f_w, N, T,
                 q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), g.stride(1),
                 g.stride(2), beta.stride(1), beta.stride(2),
                 float(scale), float(lower_bound) if lower_bound is not None else 0.0, float(spread_max))
    # the inverse's diagonal blocks as programs of their own, between the products and the rest of it
    diagonal_programs = cfg.split_prep and cfg.split_rest and cfg.diagonal_programs
    prep_constexprs = dict(H=H, HV=HV, K=K, V=V, BLOCK_K=BK, BLOCK_V=BVW, C=C, SLICE=min(cfg.slice_k, BK, BVW),
                           USE_QK_L2NORM=bool(use_qk_l2norm), GATE_IN_KERNEL=gate, SAFE_GATE=lower_bound is not None,
                           BETA_MODE=int(beta_mode), DOT_PRECISION=cfg.dot_precision,
                           QK_FROM_INPUT=bool(cfg.qk_from_input), INVERSE_BY_DOUBLING=cfg.inverse == "doubling",
                           DIAGONAL_INVERTED=diagonal_programs, PRODUCTS_BY_SLICE=cfg.products == "by_slice",
                           STEEP_BY_SLICE=cfg.steep_pairs == "by_slice",
                           FACTORS_IN_PLACE=f_w is ws_w or (not cfg.qk_from_input and (f_q is ws_q or f_k is ws_k)))
    # Launches of the prep after the first two, as (phases, programs a (chunk, head), BLOCK_LAUNCH):
    # the products a program per column block (in two launches: the lower blocks take the lower
    # half of the rows) and the factors a program per K and V slice where the config says so.
    NB = C // SUB
    if cfg.products == "block_programs" and NB > 1:
        products = [(4, NB // 2, 1), (4, NB // 2, 2)]
    else:
        products = [(4, 1, 0)]
    factors = [(16, max(BK, BVW) // prep_constexprs["SLICE"] if cfg.factor_programs else 1, 0)]
    if cfg.split_prep:
        tail = [(8, 1, 0), *factors]
        rest = ([*products, (_DIAGONAL, 1, 0), *tail] if diagonal_programs else [*products, *tail]) \
            if cfg.split_rest else [(4 | 8 | 16, 1, 0)]
        launches = [((max_chunks, HV), 1, False, 1, 0), ((max_chunks, HV, NB), 2, True, 1, 0),
                    *[((max_chunks * parts, HV), phases, False, parts, block_launch)
                      for phases, parts, block_launch in rest]]
    else:
        launches = [((max_chunks, HV), 1 | 2 | 4 | 8 | 16, False, 1, 0)]
    for grid, phases, per_sub_block, parts, block_launch in launches:
        if phases is _DIAGONAL:
            diagonal_inverse((max_chunks, HV, NB), (ws_a,), dict(HV=HV, C=C), num_warps=1, num_stages=1)
        else:
            _chunk_prep(grid, prep_args, dict(prep_constexprs, PHASES=phases, SUB_BLOCK_PROGRAMS=per_sub_block,
                                              PARTS=parts, BLOCK_LAUNCH=block_launch),
                        num_warps=cfg.lower_block_warps if block_launch == 2 else cfg.prep_warps, num_stages=1)
    has_cs = chunk_states is not None
    cs = chunk_states if has_cs else state
    ci = chunk_state_indices if has_cs else slot_indices
    ci_cols = ci.shape[1] if has_cs else 0
    # Outputs after the chain (one piece only): the chain stores each chunk's start state and U
    # in the dtype its products take (bf16 with bf16 products) for _chunk_output_kernel.
    after = cfg.outputs == "after_chain" and cfg.chain_pieces <= 1
    bf16_dots = (2 if interpreting() else 1) if cfg.chain_dot_dtype == "bfloat16" else 0
    h_dtype = torch.bfloat16 if bf16_dots else torch.float32
    ws_h = torch.empty(max_chunks * HV, BVW, BK, dtype=h_dtype, device=dev) if after else ws_g
    ws_v = torch.empty(rows, BVW, dtype=h_dtype, device=dev) if after else ws_g
    state_args = (out, state, slot_indices, has_initial_state if has_initial_state is not None else slot_indices,
                  cu_seqlens, first, f_q, f_k, f_w, ws_u, ws_p, ws_g, ws_h, ws_v, cs, ci, errors.counters(q.device))
    state_tail = (state.shape[0], cs.shape[0], T, max_chunks,
                  out.stride(1), out.stride(2), *state.stride(), *cs.stride(),
                  ci.stride(0), ci.stride(1) if has_cs else 0, ci_cols)
    # bf16 chain products (bf16_dots): native bf16 dots, or (interpreter) their emulation (_chain_dot)
    state_constexprs = dict(H=H, HV=HV, K=K, V=V, BLOCK_K=BK, BLOCK_V_WS=BVW, BLOCK_V=block_v, C=C,
                            HAS_INITIAL_FLAGS=has_initial_state is not None, HAS_CHUNK_STATES=has_cs,
                            DOT_PRECISION=cfg.dot_precision, BF16_DOTS=bf16_dots,
                            PIPELINE_STAGES=1 if interpreting() else cfg.pipeline_stages,
                            INTERVAL=chunk_state_interval, ERR_INDEX=errors.INDEX["chunk_prefill"])
    P = cfg.chain_pieces
    if P <= 1:
        _chunk_state((cdiv(V, block_v), HV, N), (*state_args, state, *state_tail),
                     dict(state_constexprs, PIECES=1, MODE=0, ROWS=V, OUTPUTS=2 if after else 1),
                     num_warps=cfg.state_warps, num_stages=1)
        if after:
            bv_out = min(cfg.output_block_v, BVW)
            _chunk_output((cdiv(V, bv_out), HV, max_chunks),
                          (out, slot_indices, cu_seqlens, first, seq, f_q, ws_p, ws_h, ws_v, N, state.shape[0], T,
                           out.stride(1), out.stride(2)),
                          dict(HV=HV, K=K, V=V, BLOCK_K=BK, BLOCK_V_WS=BVW, BLOCK_V=bv_out, C=C,
                               DOT_PRECISION=cfg.dot_precision, BF16_DOTS=bf16_dots),
                          num_warps=cfg.output_warps, num_stages=1)
        return out
    # The chain cut into P pieces of a sequence: each piece's transition (in parallel), the
    # start states (serial over the pieces, one product each), then each piece's outputs.
    transitions = torch.empty(N * P, HV, V + K, K, dtype=torch.float32, device=dev)
    starts = torch.empty(N * P, HV, V, K, dtype=torch.float32, device=dev)
    _chunk_state((cdiv(V + K, block_v), HV, N * P), (*state_args, transitions, *state_tail),
                 dict(state_constexprs, HAS_CHUNK_STATES=False, PIECES=P, MODE=1, ROWS=V + K, OUTPUTS=0),
                 num_warps=cfg.state_warps, num_stages=1)
    _chunk_pieces((cdiv(V, 32), HV, N),
                  (state, slot_indices, has_initial_state if has_initial_state is not None else slot_indices,
                   transitions, starts, state.shape[0], *state.stride()),
                  dict(HV=HV, K=K, V=V, BLOCK_K=BK, BLOCK_V=32, PIECES=P,
                       HAS_INITIAL_FLAGS=has_initial_state is not None, DOT_PRECISION=cfg.dot_precision),
                  num_warps=8, num_stages=1)
    _chunk_state((cdiv(V, block_v), HV, N * P), (*state_args, starts, *state_tail),
                 dict(state_constexprs, PIECES=P, MODE=2, ROWS=V, OUTPUTS=1),
                 num_warps=cfg.state_warps, num_stages=1)
    return out


@register("chunk_prefill", "reference")
def chunk_prefill_reference(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, scale, use_qk_l2norm, A_log,
                            dt_bias, lower_bound, beta_mode, has_initial_state, chunk_states, chunk_state_indices,
                            chunk_size=CHUNK_SIZE, compute_dtype=torch.float32):
    if beta_mode == BETA_SIGMOID_X2:
        beta, beta_mode = 2.0 * torch.sigmoid(beta.float()), BETA_AS_IS
    return reference.chunk_prefill(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                                   use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                                   lower_bound=lower_bound, beta_is_logit=beta_mode == BETA_SIGMOID,
                                   has_initial_state=has_initial_state, chunk_states=chunk_states,
                                   chunk_state_indices=chunk_state_indices, chunk_size=chunk_size,
                                   compute_dtype=compute_dtype)


def run_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, *, cu_seqlens, scale=None, use_qk_l2norm=True,
                      A_log=None, dt_bias=None, lower_bound=None, beta_mode=BETA_AS_IS, has_initial_state=None,
                      chunk_states=None, chunk_state_indices=None, backend=None):
    """Dispatch after validation (callers check first)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if A_log is not None:
        dt_bias = dt_bias.reshape(-1)
    _, impl = select("chunk_prefill", q.device, backend)
    return impl(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                beta_mode=beta_mode, has_initial_state=has_initial_state, chunk_states=chunk_states,
                chunk_state_indices=chunk_state_indices)


from .registry import example_index, example_rand, example_randn, example_rng, kdakit_op  # noqa: E402


@kdakit_op("chunk_prefill", mutates=("state", "out", "chunk_states"))
def chunk_prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slot_indices: torch.Tensor, out: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float | None, use_qk_l2norm: bool, A_log: torch.Tensor | None,
                     dt_bias: torch.Tensor | None, lower_bound: float | None, beta_mode: int,
                     has_initial_state: torch.Tensor | None, chunk_states: torch.Tensor | None,
                     chunk_state_indices: torch.Tensor | None, backend: str | None) -> None:
    """``beta_mode`` is one of ``BETA_*``."""
    run_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, scale=scale,
                      use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                      beta_mode=beta_mode, has_initial_state=has_initial_state, chunk_states=chunk_states,
                      chunk_state_indices=chunk_state_indices, backend=backend)


from ..contracts import STATE_DTYPES, _shape, check_finite, check_index_dtype  # noqa: E402
from ..contracts import check_same_device, full_checks_enabled  # noqa: E402
from .recurrent_forward import _check_recurrent_forward_values, check_recurrent_forward  # noqa: E402


# ----------------------------------------------------------------------------
# Input checks
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


def chunk_prefill(q, k, v, g, beta, state, slot_indices, *, cu_seqlens=None, A_log=None, dt_bias=None,
                  lower_bound=None, beta_is_logit=False, has_initial_state=None, use_qk_l2norm=True, scale=None,
                  chunk_states=None, chunk_state_indices=None, out=None, full_checks=None, backend=None):
    """Chunked varlen KDA prefill over ``state [slots, HV, V, K]`` (see the module doc).

    ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``, ``g [1, T, HV, K]``, ``beta [1, T, HV]``;
    ``cu_seqlens [N+1]`` (None: one sequence of ``T`` tokens); ``slot_indices [N]`` (a slot
    < 0 or >= slots is a padding row); ``has_initial_state [N]`` (bool or int; False: start
    from zeros, the final state is still written). ``g`` is the raw gate when ``A_log
    [HV]`` (with ``dt_bias [HV*K]``, optional ``lower_bound`` for the safe gate) is given,
    else the log-decay; ``beta`` is β, or its logit when ``beta_is_logit``.
    ``chunk_states [scratch, HV, V, K]`` with ``chunk_state_indices [N, M]``: the state of
    sequence ``n`` after its first ``(j+1) * CHUNK_SIZE`` tokens (64, whatever chunk the
    kernels use) goes to
    ``chunk_states[chunk_state_indices[n, j]]`` (rows < 0 or out of range: not written).
    Returns ``out [1, T, HV, V]`` (allocated zeroed in ``v``'s dtype when not given; rows
    of tokens outside ``cu_seqlens`` are not written).
    """
    if out is None:
        out = torch.zeros_like(v) if v.dim() == 4 else v.new_zeros(0)
    if cu_seqlens is None and q.dim() == 4:  # one sequence (a kernel, not a host copy: capturable)
        cu_seqlens = torch.arange(2, dtype=torch.int32, device=q.device) * q.shape[1]
    check_chunk_prefill(q, k, v, g, beta, state, slot_indices, out, cu_seqlens=cu_seqlens, A_log=A_log,
                        dt_bias=dt_bias, lower_bound=lower_bound, has_initial_state=has_initial_state,
                        chunk_states=chunk_states, chunk_state_indices=chunk_state_indices,
                        full_checks=full_checks)
    beta_mode = BETA_SIGMOID if beta_is_logit else BETA_AS_IS
    chunk_prefill_op(q, k, v, g, beta, state, slot_indices, out, cu_seqlens, scale, use_qk_l2norm, A_log, dt_bias,
                     lower_bound, beta_mode, has_initial_state, chunk_states, chunk_state_indices, backend)
    return out


@chunk_prefill_op.register_example
def _example(seed, device="cpu"):
    """Sequences of 3 tokens, of 17 (past a 16-token sub-block; from a zero state), and an empty padding row."""
    g = example_rng(seed)
    H, HV, K, V, slots = 1, 2, 16, 16, 5
    cu = (0, 3, 20, 20)
    T = cu[-1]
    args = (example_randn(g, 1, T, H, K, device=device), example_randn(g, 1, T, H, K, device=device),
            example_randn(g, 1, T, HV, V, device=device), example_randn(g, 1, T, HV, K, device=device),
            example_randn(g, 1, T, HV, device=device), example_randn(g, slots, HV, V, K, scale=0.5, device=device),
            example_index(3, 0, -1, device=device))
    kw = dict(cu_seqlens=example_index(*cu, device=device), A_log=example_rand(g, HV, device=device),
              dt_bias=example_randn(g, HV * K, scale=0.5, device=device), lower_bound=-3.0, beta_is_logit=True,
              has_initial_state=torch.tensor([True, False, True], device=device),
              out=torch.full((1, T, HV, V), 7.0, device=device))
    return chunk_prefill, args, kw
