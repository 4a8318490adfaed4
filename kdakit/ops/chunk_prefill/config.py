"""Launch configuration of ``chunk_prefill``: ``ChunkConfig``, ``chunk_config`` (which pins it
from the shapes) with the thresholds it picks by, and the constants the kernels and the launcher share.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..launch import cdiv, next_power_of_2

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
    #                                  programs of their own (inverse.py) before the rest of it
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
    #                                  and V slice (factors.py) instead of a loop over the slices
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
