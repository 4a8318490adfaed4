"""Run every op's Triton path on CPU tensors in compile-only mode (see kdakit/ops/launch.py):
each launch is compiled for the H200 (sm_90) instead of run. Prints the kernels compiled.
Run in a fresh process with KDAKIT_COMPILE_ONLY=sm_90 and without TRITON_INTERPRET.

The launch variants below are chosen per op (config branches, flag combinations, real head
sizes); then every op of the registry that none of them ran through the Triton backend runs
its example inputs, so a new op compiles here without an entry of its own."""
import dataclasses
import os
import sys

import torch

import kdakit
from kdakit import backends
from kdakit.ops.launch import COMPILED_FOR_TARGET
from kdakit.ops.registry import OPS

RAN = set()  # the ops whose Triton implementation a public call ran


def _noting(name, impl):
    def run(*args, **kwargs):
        RAN.add(name)
        return impl(*args, **kwargs)
    return run


for _name in OPS:
    backends.register(_name, "triton")(_noting(_name, backends.select(_name, torch.device("cpu"), "triton")[1]))

H = HV = 2
K = V = 128
N, T, slots, W = 2, 3, 4, 4
bf = torch.bfloat16
g = torch.Generator().manual_seed(0)


def rnd(*shape, dtype=bf):
    return torch.randn(*shape, generator=g).to(dtype)


def chunk_form(launcher, picker, *args, lower_bound=None, from_inputs=False, pair_dots=False, **kw):
    """A verify's public call as its Triton launch, with its pinned config (``picker``) but
    ring mode's chunk form at any batch (``config=``); ``from_inputs``: its state kernel
    forms its products from the inputs (``RingVerifyConfig.state_from_inputs``); ``pair_dots``:
    its steps kernel's products on tensor cores (``RingVerifyConfig.pair_dots``)."""
    q, v = args[0], args[2]
    (n, t, _, k), (hv, v_dim) = q.shape, v.shape[2:]
    config = picker(n, t, hv, v_dim, k, lower_bound)
    config = dataclasses.replace(config, ring_form="chunked",
                                 ring=dataclasses.replace(config.ring, state_from_inputs=from_inputs,
                                                          pair_dots=pair_dots))
    kw = dict(dict(conv_weights=None, conv_states=None, intermediate_conv=None, conv_bias=None, snapshots=None,
                   norm_gate=None, norm_weight=None, norm_eps=1e-6), **kw)
    return launcher(*args, torch.empty(v.shape, dtype=q.dtype), scale=k ** -0.5, lower_bound=lower_bound,
                    config=config, **kw)


state = rnd(slots, HV, V, K, dtype=torch.float32)
idx = torch.tensor([1, -1], dtype=torch.int32)
A_log, dt_bias = torch.rand(HV), torch.randn(HV * K)
C = 2 * H * K + HV * V
mixed, a, b = rnd(N, C), rnd(N, HV * K), rnd(N, HV)
for lower_bound in (None, -5.0):
    kdakit.packed_decode(mixed, a, b, A_log, dt_bias, state, idx, lower_bound=lower_bound, backend="triton")
kdakit.packed_decode(mixed, a, b, A_log, dt_bias, state.to(bf), idx, backend="triton")
conv_w = torch.randn(C, W, generator=g)
conv_state = rnd(slots, C, W - 1)
for batch in (1, 80):  # both fused-decode tile configs (tiny batch: whole V per program)
    qkv, aa, bb = rnd(batch, C), rnd(batch, HV * K), rnd(batch, HV)
    slots_b = torch.arange(batch, dtype=torch.int32) % slots - (torch.arange(batch) >= slots).int() * 100
    kdakit.fused_decode(qkv, conv_w, conv_state, aa, bb, A_log, dt_bias, state, slots_b.clamp(min=-1),
                        norm_gate=rnd(batch, HV * V), norm_weight=torch.rand(V), backend="triton")
from kdakit.ops.fused_decode import FusedDecodeConfig, fused_decode_triton  # noqa: E402
for config, norm in (((8, 16, 1), False), ((8, 4, 1), True), ((128, 1, 8), True)):
    # one program per head streaming tiles; split programs of several tiles; the whole row
    fused_decode_triton(qkv, conv_w, conv_state, aa, bb, A_log, dt_bias, state, slots_b.clamp(min=-1),
                        torch.empty(80, 1, HV, V, dtype=bf), conv_bias=None, scale=0.1, lower_bound=None,
                        norm_gate=rnd(80, HV * V) if norm else None, norm_weight=torch.rand(V) if norm else None,
                        norm_eps=1e-6, config=FusedDecodeConfig(*config))
from kdakit.ops.fused_decode import _unfused_chain  # noqa: E402
n_before = len(COMPILED_FOR_TARGET)
_unfused_chain(qkv, conv_w, conv_state, aa, bb, A_log, dt_bias, state, slots_b.clamp(min=-1),
               torch.empty(80, 1, HV, V, dtype=bf), conv_bias=None, scale=0.1, lower_bound=None,
               norm_gate=rnd(80, HV * V), norm_weight=torch.rand(V), norm_eps=1e-6, pdl=True)  # waits compile
assert COMPILED_FOR_TARGET[n_before:] == ["_causal_conv1d_update_kernel", "_packed_decode_kernel",
                                          "_gated_rmsnorm_kernel"], COMPILED_FOR_TARGET[n_before:]
kdakit.causal_conv1d_update(mixed, conv_state, conv_w, idx, backend="triton")
cu_var = torch.tensor([0, 3, 3, 20], dtype=torch.int32)
slots_var = torch.tensor([1, -1, 2], dtype=torch.int32)
x_var = rnd(20, C)
for x_layout in (x_var, rnd(C, 20).t()):  # [T, C] rows; the transposed [C, T] view (tokens contiguous)
    kdakit.causal_conv1d_varlen(x_layout, conv_state, conv_w, cu_var, slots_var, backend="triton")
kdakit.causal_conv1d_varlen(x_var, rnd(slots, W - 1, C).transpose(1, 2), conv_w, cu_var.long(), slots_var,
                            has_initial_state=torch.tensor([True, False, True]), bias=torch.randn(C),
                            activation=None, backend="triton")
kdakit.causal_conv1d_varlen(x_var, rnd(slots, C, 1), torch.randn(C, 2), cu_var, slots_var, backend="triton")  # W=2
kdakit.causal_conv1d_varlen(x_var, conv_state, conv_w, cu_var[::3].contiguous(), slots_var[:1], backend="triton")  # N=1
# the "rows" form of the varlen conv (a program streams its tokens a row at a time)
from kdakit.ops.conv1d_varlen import Conv1dVarlenConfig, causal_conv1d_varlen_triton  # noqa: E402
for conv_cfg in (Conv1dVarlenConfig(32, 1024, 4, form="rows"), Conv1dVarlenConfig(16, 512, 2, form="rows"),
                 Conv1dVarlenConfig(8, 256, 2, form="rows")):
    n_before = len(COMPILED_FOR_TARGET)
    causal_conv1d_varlen_triton(x_var, conv_state, conv_w, cu_var, slots_var, torch.empty_like(x_var),
                                has_initial_state=torch.tensor([True, False, True]), bias=torch.randn(C),
                                config=conv_cfg)
    assert COMPILED_FOR_TARGET[n_before:] == ["_causal_conv1d_varlen_rows_kernel"], COMPILED_FOR_TARGET[n_before:]
kdakit.gated_rmsnorm(rnd(N, HV, V), rnd(N, HV, V), torch.rand(V), backend="triton")
q, k, v = rnd(N, T, H, K), rnd(N, T, H, K), rnd(N, T, HV, V)
aT, bT = rnd(N, T, HV, K), rnd(N, T, HV)
chans = (H * K, H * K, HV * V)
conv_weights = tuple(torch.randn(c, W, generator=g) for c in chans)
conv_states = tuple(rnd(slots, c, W - 1) for c in chans)
inter = tuple(rnd(slots, T, c, W - 1) for c in chans)
scratch = torch.tensor([0, 1], dtype=torch.int32)
snaps = torch.zeros(slots, T, HV, V, K)
rings = (rnd(slots, H, T, K), rnd(slots, HV, T, V), torch.zeros(slots, HV, T, K), torch.zeros(slots, HV, T))
kdakit.mtp_verify(q, k, v, aT, bT, A_log, dt_bias, state, idx, scratch, conv_weights=conv_weights,
                  conv_states=conv_states, intermediate_conv=inter, snapshots=snaps, lower_bound=-5.0,
                  norm_gate=rnd(N, T, HV, V), norm_weight=torch.rand(V), backend="triton")
kdakit.mtp_verify(q, k, v, aT, bT, A_log, dt_bias, state, idx, scratch, rings=rings, backend="triton")
# q, k, v, a, b as views of packed projections (one stride between tokens, as sglang's chain verify passes them)
packed_qkv = rnd(N * T, 2 * H * K + HV * V + 8)
qs, ks, vs = (t.reshape(N, T, -1, d) for t, d in zip(packed_qkv[:, :2 * H * K + HV * V].split(chans, dim=1),
                                                       (K, K, V)))
kdakit.mtp_verify(qs, ks, vs, rnd(N * T, HV * K + 8)[:, :HV * K].reshape(N, T, HV, K),
                  rnd(N * T, HV + 3)[:, :HV].reshape(N, T, HV), A_log, dt_bias, state, idx, scratch, snapshots=snaps,
                  backend="triton")
kdakit.mtp_verify(q, k, v, aT, bT, A_log, dt_bias, state, idx, scratch, conv_weights=conv_weights,
                  conv_states=conv_states, intermediate_conv=inter, rings=rings, backend="triton")
from kdakit.ops.mtp_verify import mtp_verify_config, mtp_verify_triton  # noqa: E402
chunk_form(mtp_verify_triton, mtp_verify_config, q, k, v, aT, bT, A_log, dt_bias, state, idx, scratch, rings=rings)
chunk_form(mtp_verify_triton, mtp_verify_config, q, k, v, aT, bT, A_log, dt_bias, state, idx, scratch, rings=rings,
           from_inputs=True)
chunk_form(mtp_verify_triton, mtp_verify_config, q, k, v, aT, bT, A_log, dt_bias, state.to(bf), idx, scratch,
           rings=rings)
chunk_form(mtp_verify_triton, mtp_verify_config, q, k, v, aT, bT, A_log, dt_bias, state, idx, scratch,
           conv_weights=conv_weights, conv_states=conv_states, intermediate_conv=inter, rings=rings,
           norm_gate=rnd(N, T, HV, V), norm_weight=torch.rand(V))
accept = torch.tensor([2, 0], dtype=torch.int32)
kdakit.commit_ring(state, *rings, idx, accept, track_slots=torch.tensor([3, -1], dtype=torch.int32),
                   track_steps=torch.tensor([0, 0], dtype=torch.int32), backend="triton")
kdakit.commit_snapshots(state, snaps, idx, scratch, accept - 1, conv_states=conv_states, intermediate_conv=inter,
                        backend="triton")
cu = torch.tensor([0, 2, 5], dtype=torch.int32)
kdakit.recurrent_forward(rnd(1, 5, H, K), rnd(1, 5, H, K), rnd(1, 5, HV, V), rnd(1, 5, HV, K), rnd(1, 5, HV),
                         state, torch.tensor([0, 2], dtype=torch.int32), cu_seqlens=cu, A_log=A_log,
                         dt_bias=dt_bias, beta_is_logit=True, backend="triton")
for n_seq in (3, 130):  # one-token sequences: two tiles a program up to 256 pairs, one tile beyond
    kdakit.recurrent_forward(rnd(1, n_seq, H, K), rnd(1, n_seq, H, K), rnd(1, n_seq, HV, V), rnd(1, n_seq, HV, K),
                             rnd(1, n_seq, HV), state, torch.arange(n_seq, dtype=torch.int32) % slots,
                             cu_seqlens=torch.arange(n_seq + 1, dtype=torch.int32), A_log=A_log, dt_bias=dt_bias,
                             beta_is_logit=True, backend="triton")
kdakit.gated_rmsnorm(rnd(4096, V), rnd(4096, V), torch.rand(V), backend="triton")  # 8 rows a program
# Chunked prefill at real head sizes: default gate with has_initial_state and chunk-boundary
# states; safe gate on a bf16 pool; the log-decay input with a beta logit x2 (the fla drop-in),
# 32-token chunks and a three-stage pipeline in the state kernel.
Tp = 70
cu_p = torch.tensor([0, 5, Tp], dtype=torch.int32)
xp = [rnd(1, Tp, H, K), rnd(1, Tp, H, K), rnd(1, Tp, HV, V), rnd(1, Tp, HV, K), rnd(1, Tp, HV)]
kdakit.chunk_prefill(*xp, state, torch.tensor([1, -1], dtype=torch.int32), cu_seqlens=cu_p, A_log=A_log,
                     dt_bias=dt_bias, beta_is_logit=True, has_initial_state=torch.tensor([True, False]),
                     chunk_states=torch.zeros(3, HV, V, K), chunk_state_indices=torch.tensor([[0], [1]]),
                     backend="triton")
kdakit.chunk_prefill(*xp, state.to(bf), torch.tensor([1, 2], dtype=torch.int32), cu_seqlens=cu_p, A_log=A_log,
                     dt_bias=dt_bias, lower_bound=-5.0, beta_is_logit=True, backend="triton")
from kdakit.ops.chunk_prefill import ChunkConfig, chunk_prefill_triton  # noqa: E402
chunk_prefill_triton(*xp[:3], -torch.rand(1, Tp, HV, K), xp[4], state, torch.tensor([1, 2], dtype=torch.int32),
                     torch.empty(1, Tp, HV, V, dtype=bf), cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True, A_log=None,
                     dt_bias=None, lower_bound=None, beta_mode=2, has_initial_state=None, chunk_states=None,
                     chunk_state_indices=None, config=ChunkConfig(chunk=32, block_v=64, prep_warps=4, pipeline_stages=3))
# the picked config runs the prep as six launches (the products as two) and the diagonal inverses;
# the given one as one
# (each call first builds its chunk plan: one launch)
PLAN = ["_chunk_plan_kernel"]
PICKED_PREP = ["_chunk_prep_kernel"] * 4 + ["_diagonal_inverse_kernel"] + ["_chunk_prep_kernel"] * 2
assert COMPILED_FOR_TARGET[-21:] == (PLAN + PICKED_PREP + ["_chunk_state_kernel"]) * 2 + PLAN + [
    "_chunk_prep_kernel", "_chunk_state_kernel"], COMPILED_FOR_TARGET[-21:]
chunk_prefill_triton(*xp, state, torch.tensor([1, 2], dtype=torch.int32), torch.empty(1, Tp, HV, V, dtype=bf),
                     cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=None,
                     beta_mode=1, has_initial_state=None, chunk_states=None, chunk_state_indices=None,
                     config=ChunkConfig(split_prep=True))  # the prep as three launches
assert COMPILED_FOR_TARGET[-5:] == PLAN + ["_chunk_prep_kernel"] * 3 + ["_chunk_state_kernel"], \
    COMPILED_FOR_TARGET[-5:]
for split in (True, False):  # q and k read from the inputs in the later prep phases
    chunk_prefill_triton(*xp, state, torch.tensor([1, 2], dtype=torch.int32), torch.empty(1, Tp, HV, V, dtype=bf),
                         cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias,
                         lower_bound=None, beta_mode=1, has_initial_state=None, chunk_states=None,
                         chunk_state_indices=None, config=ChunkConfig(split_prep=split, qk_from_input=True))
chunk_prefill_triton(*xp, state, torch.tensor([1, 2], dtype=torch.int32), torch.empty(1, Tp, HV, V, dtype=bf),
                     cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=None,
                     beta_mode=1, has_initial_state=None, chunk_states=None, chunk_state_indices=None,
                     config=ChunkConfig(split_prep=True, split_rest=True,  # five prep launches
                                        factor_dtype="bfloat16"))
assert COMPILED_FOR_TARGET[-7:] == PLAN + ["_chunk_prep_kernel"] * 5 + ["_chunk_state_kernel"], \
    COMPILED_FOR_TARGET[-7:]
for chunk in (32, 64):  # the inverse by doubling (one level, two)
    chunk_prefill_triton(*xp, state, torch.tensor([1, 2], dtype=torch.int32), torch.empty(1, Tp, HV, V, dtype=bf),
                         cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias,
                         lower_bound=None, beta_mode=1, has_initial_state=None, chunk_states=None,
                         chunk_state_indices=None, config=ChunkConfig(chunk=chunk, split_prep=True, split_rest=True,
                                                                      qk_from_input=True, inverse="doubling"))
for bv, stages in ((32, 2), (64, 2), (64, 1)):  # bf16 chain products (native bf16 dots), as picked for bf16 inputs
    chunk_prefill_triton(*(x.to(bf) for x in xp), state, torch.tensor([1, 2], dtype=torch.int32),
                         torch.empty(1, Tp, HV, V, dtype=bf), cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True,
                         A_log=A_log, dt_bias=dt_bias, lower_bound=None, beta_mode=1, has_initial_state=None,
                         chunk_states=None, chunk_state_indices=None,
                         config=ChunkConfig(block_v=bv, state_warps=8, pipeline_stages=stages, split_prep=True,
                                            split_rest=True, qk_from_input=True, factor_dtype="bfloat16",
                                            chain_dot_dtype="bfloat16"))
for chain_dots in ("bfloat16", "float32"):  # the products by K slice; the outputs after the chain
    chunk_prefill_triton(*(x.to(bf) for x in xp), state, torch.tensor([1, 2], dtype=torch.int32),
                         torch.empty(1, Tp, HV, V, dtype=bf), cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True,
                         A_log=A_log, dt_bias=dt_bias, lower_bound=None, beta_mode=1, has_initial_state=None,
                         chunk_states=torch.zeros(3, HV, V, K), chunk_state_indices=torch.tensor([[0], [1]]),
                         config=ChunkConfig(block_v=32, state_warps=8, split_prep=True, split_rest=True,
                                            qk_from_input=True, factor_dtype="bfloat16", chain_dot_dtype=chain_dots,
                                            inverse="doubling", diagonal_programs=True, products="by_slice",
                                            outputs="after_chain"))
    assert COMPILED_FOR_TARGET[-3:] == ["_chunk_prep_kernel", "_chunk_state_kernel", "_chunk_output_kernel"], \
        COMPILED_FOR_TARGET[-3:]
# the state update's factors in float32 beside bf16 q̂ ⊙ e^Γ, with bf16 and float32 chain products
for chain_dots in ("bfloat16", "float32"):
    chunk_prefill_triton(*(x.to(bf) for x in xp), state, torch.tensor([1, 2], dtype=torch.int32),
                         torch.empty(1, Tp, HV, V, dtype=bf), cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True,
                         A_log=A_log, dt_bias=dt_bias, lower_bound=None, beta_mode=1, has_initial_state=None,
                         chunk_states=None, chunk_state_indices=None,
                         config=ChunkConfig(block_v=32, state_warps=8, split_prep=True, split_rest=True,
                                            qk_from_input=True, factor_dtype="bfloat16", update_factor_dtype="float32",
                                            chain_dot_dtype=chain_dots, inverse="doubling",
                                            diagonal_programs=True, products="block_programs", factor_programs=True))
    assert COMPILED_FOR_TARGET[-1] == "_chunk_state_kernel", COMPILED_FOR_TARGET[-4:]
# the products a program per column block, the factors a program per slice; P stored in bf16;
# the steep pairs by K slice
for steep_pairs in ("by_column", "by_slice"):
    chunk_prefill_triton(*(x.to(bf) for x in xp), state, torch.tensor([1, 2], dtype=torch.int32),
                         torch.empty(1, Tp, HV, V, dtype=bf), cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True,
                         A_log=A_log, dt_bias=dt_bias, lower_bound=None, beta_mode=1, has_initial_state=None,
                         chunk_states=None, chunk_state_indices=None,
                         config=ChunkConfig(block_v=32, state_warps=8, split_prep=True, split_rest=True,
                                            qk_from_input=True, factor_dtype="bfloat16", chain_dot_dtype="bfloat16",
                                            inverse="doubling", diagonal_programs=True, products="block_programs",
                                            factor_programs=True, qk_pairs_dtype="bfloat16", steep_pairs=steep_pairs))
    assert COMPILED_FOR_TARGET[-1] == "_chunk_state_kernel" and COMPILED_FOR_TARGET[-2] == "_chunk_prep_kernel", \
        COMPILED_FOR_TARGET[-4:]
chunk_prefill_triton(*xp, state, torch.tensor([1, 2], dtype=torch.int32), torch.empty(1, Tp, HV, V, dtype=bf),
                     cu_seqlens=cu_p, scale=0.1, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=None,
                     beta_mode=1, has_initial_state=torch.tensor([True, False]), chunk_states=torch.zeros(3, HV, V, K),
                     chunk_state_indices=torch.tensor([[0], [1]]), config=ChunkConfig(chain_pieces=3))  # a cut chain
assert COMPILED_FOR_TARGET[-4:] == ["_chunk_prep_kernel", "_chunk_state_kernel", "_chunk_pieces_kernel",
                                    "_chunk_state_kernel"], COMPILED_FOR_TARGET[-4:]
from kdakit.compat.fla import fused_recurrent_kda  # noqa: E402  (K-major pool, zero initial states)
os.environ["KDAKIT_BACKEND"] = "triton"  # the compat entry has no backend argument
fused_recurrent_kda(rnd(1, 5, H, K), rnd(1, 5, H, K), rnd(1, 5, HV, V), rnd(1, 5, HV, K, dtype=torch.float32),
                    rnd(1, 5, HV, dtype=torch.float32), cu_seqlens=cu.long(), output_final_state=True)
fused_recurrent_kda(rnd(1, 5, H, K), rnd(1, 5, H, K), rnd(1, 5, HV, V), rnd(1, 5, HV, K, dtype=torch.float32),
                    rnd(1, 5, HV, dtype=torch.float32), initial_state=state[:2].transpose(-1, -2).contiguous(),
                    cu_seqlens=cu.long(), output_final_state=True)
assert COMPILED_FOR_TARGET[-2:] == ["_recurrent_forward_kernel"] * 2, COMPILED_FOR_TARGET[-3:]
# Tree verify at real shapes (K = V = 128, HV = 32): conv prologue, recurrence, output norm.
HT, TT = 32, 4
tq, tk, tv = rnd(N, TT, HT, K), rnd(N, TT, HT, K), rnd(N, TT, HT, V)
ta, tb = rnd(N, TT, HT, K), rnd(N, TT, HT)
t_state = torch.zeros(slots, HT, V, K)
t_chans = (HT * K, HT * K, HT * V)
t_conv = dict(conv_weights=tuple(torch.randn(c, W, generator=g) for c in t_chans),
              conv_states=tuple(rnd(slots, c, W - 1) for c in t_chans),
              intermediate_conv=tuple(rnd(2, TT, c, W - 1) for c in t_chans))
t_parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]], dtype=torch.int32)
t_snaps = torch.zeros(2, TT, HT, V, K)
kdakit.tree_verify(tq, tk, tv, ta, tb, torch.rand(HT), torch.randn(HT * K), t_state, idx, scratch, t_parents,
                   snapshots=t_snaps, lower_bound=-5.0, norm_gate=rnd(N, TT, HT, V), norm_weight=torch.rand(V),
                   backend="triton", **t_conv)
kdakit.tree_verify(tq, tk, tv, ta, tb, torch.rand(HT), torch.randn(HT * K), t_state.to(bf), idx, scratch,
                   t_parents.long(), snapshots=t_snaps, backend="triton")
t_rings = (rnd(slots, HT, TT, K), rnd(slots, HT, TT, V), torch.zeros(slots, HT, TT, K), torch.zeros(slots, HT, TT))
kdakit.tree_verify(tq, tk, tv, ta, tb, torch.rand(HT), torch.randn(HT * K), t_state, idx, scratch, t_parents,
                   rings=t_rings, backend="triton", **t_conv)
kdakit.commit_tree_ring(t_state, *t_rings, idx, torch.tensor([[0, 1, 3, -1], [0, 1, 2, 3]], dtype=torch.int32),
                        torch.tensor([3, 4], dtype=torch.int32), backend="triton")
# Ring mode's chunk form of trees (the ancestor-masked steps kernel), at any batch: conv, norm
# and the safe gate (pair sums factored); the default gate (pair by pair).
from kdakit.ops.tree_verify import tree_verify_config, tree_verify_triton  # noqa: E402
n_before = len(COMPILED_FOR_TARGET)
chunk_form(tree_verify_triton, tree_verify_config, tq, tk, tv, ta, tb, torch.rand(HT), torch.randn(HT * K), t_state,
           idx, scratch, t_parents, rings=t_rings, lower_bound=-5.0, norm_gate=rnd(N, TT, HT, V),
           norm_weight=torch.rand(V), **t_conv)
chunk_form(tree_verify_triton, tree_verify_config, tq, tk, tv, ta, tb, torch.rand(HT), torch.randn(HT * K), t_state,
           idx, scratch, t_parents.long(), rings=t_rings)
chunk_form(tree_verify_triton, tree_verify_config, tq, tk, tv, ta, tb, torch.rand(HT), torch.randn(HT * K), t_state,
           idx, scratch, t_parents, rings=t_rings, lower_bound=-5.0, from_inputs=True)
assert "_tree_verify_kernel" not in COMPILED_FOR_TARGET[n_before:], COMPILED_FOR_TARGET[n_before:]
# Long trees and chains: the node / step loop (VerifyConfig.unroll_steps=False), with the
# parent prefetch in snapshot mode and the refold in ring mode's recurrence.
TL = 9
lq, lk, lv = rnd(N, TL, HT, K), rnd(N, TL, HT, K), rnd(N, TL, HT, V)
la, lb = rnd(N, TL, HT, K), rnd(N, TL, HT)
l_parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 2, 3, -1], [-1, 0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int32)
n_before = len(COMPILED_FOR_TARGET)
kdakit.tree_verify(lq, lk, lv, la, lb, torch.rand(HT), torch.randn(HT * K), t_state, idx, scratch, l_parents,
                   snapshots=torch.zeros(2, TL, HT, V, K), backend="triton")
kdakit.tree_verify(lq, lk, lv, la, lb, torch.rand(HT), torch.randn(HT * K), t_state, idx, scratch, l_parents,
                   rings=(rnd(slots, HT, TL, K), rnd(slots, HT, TL, V), torch.zeros(slots, HT, TL, K),
                          torch.zeros(slots, HT, TL)), backend="triton")
kdakit.mtp_verify(lq, lk, lv, la, lb, torch.rand(HT), torch.randn(HT * K), t_state, idx, scratch,
                  snapshots=torch.zeros(2, TL, HT, V, K), backend="triton")
assert COMPILED_FOR_TARGET[n_before:] == ["_tree_verify_kernel"] * 2 + ["_mtp_verify_kernel"], \
    COMPILED_FOR_TARGET[n_before:]
# Ring mode's steps kernel with its products on tensor cores (RingVerifyConfig.pair_dots): a
# 16-node tree under both gates (the default gate's per-program spread test), a 12-step chain.
T16 = 16
xq, xk, xv = rnd(N, T16, HT, K), rnd(N, T16, HT, K), rnd(N, T16, HT, V)
xa, xb = rnd(N, T16, HT, K), rnd(N, T16, HT)
x_parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, T16)], [-1] + list(range(T16 - 1))], dtype=torch.int32)
x_rings = (rnd(slots, HT, T16, K), rnd(slots, HT, T16, V), torch.zeros(slots, HT, T16, K), torch.zeros(slots, HT, T16))
n_before = len(COMPILED_FOR_TARGET)
for lb in (None, -5.0):
    chunk_form(tree_verify_triton, tree_verify_config, xq, xk, xv, xa, xb, torch.rand(HT), torch.randn(HT * K),
               t_state, idx, scratch, x_parents, rings=x_rings, lower_bound=lb, pair_dots=True)
chunk_form(mtp_verify_triton, mtp_verify_config, xq[:, :12], xk[:, :12], xv[:, :12], xa[:, :12], xb[:, :12],
           torch.rand(HT), torch.randn(HT * K), t_state, idx, scratch, rings=x_rings, pair_dots=True)
assert COMPILED_FOR_TARGET[n_before:].count("_ring_verify_steps_kernel") == 3, COMPILED_FOR_TARGET[n_before:]
for name, op in OPS.items():  # each example is one more compile of its kernels: only where needed
    if name not in RAN:
        n_before = len(COMPILED_FOR_TARGET)
        public, args, kw = op.example(0)
        public(*args, **kw, backend="triton")
        assert name in RAN and len(COMPILED_FOR_TARGET) > n_before, f"{name}: its example compiled no kernel"
print(" ".join(COMPILED_FOR_TARGET))
sys.exit(0)
