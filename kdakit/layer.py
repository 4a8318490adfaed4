"""A Kimi Delta Attention layer (Kimi Linear's parameters) on top of the kdakit ops.

``KDALayer`` holds the weights; the caches live in a ``StatePool`` (``attach(pool,
layer_idx)``, or ``cache=pool.layer(i)`` per call). The math of every mode is the one of
docs/design.md, with the projections of Kimi Linear around it:

- ``q, k, v`` = short conv (SiLU, width W, no bias) of ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``;
- raw gate ``a = f_b_proj(f_a_proj(x))`` ``[HV*K]``, raw beta ``b = b_proj(x)`` ``[HV]``,
  ``A_log [HV]``, ``dt_bias [HV*K]`` (default gate, or the safe gate with ``lower_bound``);
- output ``o_proj(gated_rmsnorm(o, g_b_proj(g_a_proj(x)), o_norm_weight))``.

Modes: ``prefill`` (``causal_conv1d_varlen`` over every prompt, then ``chunk_prefill``, or
``recurrent_forward`` for extends of a few tokens a sequence), ``decode``
(``fused_decode``: conv + recurrence + output norm, a chain of dependent launches on Hopper), ``verify``
(``mtp_verify`` with the conv fused, snapshots or rings, fused output norm) and ``commit``
(``commit_snapshots``, or ``commit_ring`` plus the conv windows).

Tensor parallelism: ``tp_rank``/``tp_size`` keep key heads ``[rank*H/tp, (rank+1)*H/tp)``
(and their value heads); ``o_proj`` then returns a partial sum that an engine all-reduces.
``KDALayer.shard(full, rank, size)`` cuts a shard out of an unsharded layer.
"""
from __future__ import annotations

import torch
from torch import nn

from .ops.chunk_prefill import chunk_prefill
from .ops.commit import commit_ring, commit_snapshots
from .ops.conv1d_varlen import causal_conv1d_varlen
from .ops.fused_decode import fused_decode
from .ops.gated_rmsnorm import gated_rmsnorm
from .ops.mtp_verify import mtp_verify
from .ops.recurrent_forward import recurrent_forward
from .ops.tree_commit import commit_tree_ring
from .ops.tree_verify import tree_verify
from .state_pool import LayerCache, StatePool


PREFILL_CHUNK_FROM = 64  # see KDALayer.prefill_chunk_from (docs/tuning.md: the measured crossover)


class KDALayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_k_dim: int, head_v_dim: int | None = None, *,
                 num_v_heads: int | None = None, conv_width: int = 4, lower_bound: float | None = None,
                 norm_eps: float = 1e-6, tp_rank: int = 0, tp_size: int = 1, device=None, dtype=None):
        super().__init__()
        HV = num_v_heads or num_heads
        if num_heads % tp_size or HV % tp_size or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_size={tp_size} must divide H={num_heads} and HV={HV}, and 0 <= tp_rank < tp_size "
                             f"(got tp_rank={tp_rank}).")
        if HV % num_heads:
            raise ValueError(f"value heads must be a multiple of key heads (got H={num_heads}, HV={HV}).")
        self.hidden_size, self.conv_width = hidden_size, conv_width
        self.total_heads, self.total_v_heads = num_heads, HV
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.H, self.HV = num_heads // tp_size, HV // tp_size  # this shard's heads
        self.K, self.V = head_k_dim, head_v_dim or head_k_dim
        self.lower_bound, self.norm_eps = lower_bound, norm_eps
        # Mean tokens a sequence from which prefill takes the chunked forward (a 64-token chunk);
        # shorter extends run token by token. Decided from shapes alone: no host sync.
        self.prefill_chunk_from = PREFILL_CHUNK_FROM
        H, HV, K, V = self.H, self.HV, self.K, self.V
        lin = dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, H * K, **lin)
        self.k_proj = nn.Linear(hidden_size, H * K, **lin)
        self.v_proj = nn.Linear(hidden_size, HV * V, **lin)
        # The three short convs as one packed [C, W] float32 weight (q | k | v rows): fused_decode
        # takes it whole, mtp_verify its row slices (contiguous views), with no copy per call.
        self.conv_weight = nn.Parameter(torch.empty(2 * H * K + HV * V, conv_width, device=device,
                                                    dtype=torch.float32))
        self.f_a_proj = nn.Linear(hidden_size, K, **lin)
        self.f_b_proj = nn.Linear(K, HV * K, **lin)
        self.b_proj = nn.Linear(hidden_size, HV, **lin)
        self.A_log = nn.Parameter(torch.empty(HV, device=device, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(HV * K, device=device, dtype=torch.float32))
        self.g_a_proj = nn.Linear(hidden_size, V, **lin)
        self.g_b_proj = nn.Linear(V, HV * V, **lin)
        self.o_norm_weight = nn.Parameter(torch.ones(V, device=device, dtype=torch.float32))
        self.o_proj = nn.Linear(HV * V, hidden_size, **lin)
        self.reset_parameters()
        self.cache: LayerCache | None = None

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random weights of a sensible scale (this layer's own init; real models load theirs)."""
        def normal_(t, std):
            with torch.no_grad():
                t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32) * std)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, self.g_a_proj):
            normal_(lin.weight, self.hidden_size ** -0.5)
        normal_(self.f_b_proj.weight, self.K ** -0.5)
        normal_(self.g_b_proj.weight, self.V ** -0.5)
        normal_(self.o_proj.weight, (self.total_v_heads * self.V) ** -0.5)
        normal_(self.conv_weight, self.conv_width ** -0.5)
        with torch.no_grad():
            self.A_log.copy_(torch.rand(self.HV, generator=generator) * 2 - 1)
            self.dt_bias.copy_(torch.randn(self.HV * self.K, generator=generator) * 0.5)
            self.o_norm_weight.fill_(1.0)

    # ------------------------------------------------------------------ layout
    @property
    def conv_channels(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def conv_weights_qkv(self) -> tuple:
        """``(w_q, w_k, w_v)``: contiguous row views of the packed conv weight."""
        HK = self.H * self.K
        w = self.conv_weight
        return w[:HK], w[HK:2 * HK], w[2 * HK:]

    def attach(self, pool: StatePool, layer_idx: int) -> "KDALayer":
        """Use layer ``layer_idx`` of ``pool`` as this layer's caches."""
        if (pool.H, pool.HV, pool.K, pool.V, pool.W) != (self.H, self.HV, self.K, self.V, self.conv_width):
            raise ValueError(f"pool heads/dims (H={pool.H}, HV={pool.HV}, K={pool.K}, V={pool.V}, W={pool.W}) do "
                             f"not match the layer's (H={self.H}, HV={self.HV}, K={self.K}, V={self.V}, "
                             f"W={self.conv_width}).")
        self.cache = pool.layer(layer_idx)
        return self

    def _cache(self, cache: LayerCache | None) -> LayerCache:
        cache = cache if cache is not None else self.cache
        if cache is None:
            raise ValueError("KDALayer has no cache: call attach(pool, layer_idx) or pass cache=pool.layer(i).")
        return cache

    def _slots(self, slots, n: int) -> torch.Tensor:
        if isinstance(slots, int):
            slots = [slots]
        t = torch.as_tensor(slots, dtype=torch.int32, device=self.conv_weight.device)
        if t.shape != (n,):
            raise ValueError(f"expected {n} slot indices (got shape {tuple(t.shape)}).")
        return t

    def _gate_inputs(self, x: torch.Tensor):
        """Raw gate ``a [.., HV*K]``, raw beta ``b [.., HV]``, output-norm gate ``[.., HV*V]``."""
        return self.f_b_proj(self.f_a_proj(x)), self.b_proj(x), self.g_b_proj(self.g_a_proj(x))

    # ------------------------------------------------------------------ modes
    def prefill(self, x: torch.Tensor, slots, cu_seqlens=None, *, cache: LayerCache | None = None) -> torch.Tensor:
        """Tokens ``x [T, hidden]`` of one sequence (``slots`` an int) or of several split by
        ``cu_seqlens [N+1]`` (``slots [N]``). Each sequence continues from its slot's state and
        conv window (zeros after ``alloc``); both are left after its last token. Returns ``[T, hidden]``."""
        c = self._cache(cache)
        T = x.shape[0]
        dev = self.conv_weight.device
        if cu_seqlens is None:
            cu_t = torch.tensor([0, T], dtype=torch.int32, device=dev)
        elif torch.is_tensor(cu_seqlens):
            cu_t = cu_seqlens.to(device=dev, dtype=torch.int32)
        else:
            cu_t = torch.tensor(list(cu_seqlens), dtype=torch.int32, device=dev)
        slot_t = self._slots(slots, cu_t.numel() - 1)
        H, HV, K, V = self.H, self.HV, self.K, self.V
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, C], pre-conv
        # Every sequence's short conv in one launch, continuing from its slot's window (a PAD slot
        # starts from zeros and keeps none); no host sync, no loop over sequences.
        mixed = causal_conv1d_varlen(qkv, c.conv, self.conv_weight, cu_t, slot_t)
        a, b, gate = self._gate_inputs(x)
        q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
        forward = chunk_prefill if T >= self.prefill_chunk_from * slot_t.numel() else recurrent_forward
        o = forward(q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, V),
                    a.reshape(1, T, HV, K), b.reshape(1, T, HV), c.state, slot_t, cu_seqlens=cu_t,
                    A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound, beta_is_logit=True)
        o = gated_rmsnorm(o[0], gate.view(T, HV, V), self.o_norm_weight, eps=self.norm_eps)
        return self.o_proj(o.reshape(T, HV * V))

    def decode(self, x: torch.Tensor, slots, *, cache: LayerCache | None = None) -> torch.Tensor:
        """One token per request, ``x [B, hidden]``; ``slots [B]`` (``PAD`` rows give zeros).
        Updates the slots' states and conv windows in place. Returns ``[B, hidden]``."""
        c = self._cache(cache)
        B = x.shape[0]
        slot_t = slots if torch.is_tensor(slots) else self._slots(slots, B)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        a, b, gate = self._gate_inputs(x)
        o = fused_decode(qkv, self.conv_weight, c.conv, a, b, self.A_log, self.dt_bias, c.state, slot_t,
                         lower_bound=self.lower_bound, norm_gate=gate, norm_weight=self.o_norm_weight,
                         norm_eps=self.norm_eps)
        return self.o_proj(o.view(B, self.HV * self.V))

    def verify(self, x: torch.Tensor, slots, scratch_rows, *, cache: LayerCache | None = None) -> torch.Tensor:
        """``x [N, 1+num_spec, hidden]``: each request's last token and its drafts. Reads the
        slots' states and windows without changing them; writes snapshots (or rings) and the
        windows after every step to scratch row ``scratch_rows[n]``. Returns ``[N, 1+num_spec, hidden]``."""
        return self._verify(x, slots, scratch_rows, None, cache)

    def commit(self, slots, scratch_rows, accept_lens, *, cache: LayerCache | None = None) -> None:
        """Keep the first ``accept_lens[n]`` verified steps of request ``n`` (its last token and
        the accepted drafts; 0 keeps nothing): state and conv windows into its slot."""
        c = self._cache(cache)
        dev = self.conv_weight.device
        slot_t = slots if torch.is_tensor(slots) else torch.as_tensor(slots, dtype=torch.int32, device=dev)
        rows_t = (scratch_rows if torch.is_tensor(scratch_rows)
                  else torch.as_tensor(scratch_rows, dtype=torch.int32, device=dev))
        lens_t = (accept_lens if torch.is_tensor(accept_lens)
                  else torch.as_tensor(accept_lens, dtype=torch.int32, device=dev))
        steps = lens_t - 1  # the accepted step; -1 commits nothing
        if c.rings is not None:
            commit_ring(c.state, *c.rings, slot_t, lens_t)
            commit_snapshots(c.state, None, slot_t, rows_t, steps, conv_states=[c.conv],
                             intermediate_conv=[c.intermediate_conv])
        else:
            commit_snapshots(c.state, c.snapshots, slot_t, rows_t, steps, conv_states=[c.conv],
                             intermediate_conv=[c.intermediate_conv])

    def verify_tree(self, x: torch.Tensor, slots, scratch_rows, parents, *,
                    cache: LayerCache | None = None) -> torch.Tensor:
        """``x [N, T, hidden]``: each request's tree of ``T`` nodes (node 0 its last token),
        ``parents [N, T]`` (``tree_verify``). Needs a speculative pool with ``1 + num_spec >= T``;
        writes each node's snapshot (or ring entries) and windows to scratch row
        ``scratch_rows[n]``. Returns ``[N, T, hidden]``; ``commit_node`` keeps an accepted node."""
        return self._verify(x, slots, scratch_rows, parents, cache)

    def _verify(self, x, slots, scratch_rows, parents, cache):
        """A chain verify (``parents`` None: ``mtp_verify``) or a tree verify (``tree_verify``)."""
        c = self._cache(cache)
        if c.intermediate_conv is None:
            what = "verify" if parents is None else "tree verify"
            raise ValueError(f"{what} needs a pool with speculative buffers (StatePool(spec='snapshot'|'ring')).")
        N, T, _ = x.shape
        H, HV, K, V = self.H, self.HV, self.K, self.V
        slot_t = slots if torch.is_tensor(slots) else self._slots(slots, N)
        rows_t = scratch_rows if torch.is_tensor(scratch_rows) else self._slots(scratch_rows, N)
        xf = x.reshape(N * T, -1)
        a, b, gate = self._gate_inputs(xf)
        tokens = (self.q_proj(xf).view(N, T, H, K), self.k_proj(xf).view(N, T, H, K),
                  self.v_proj(xf).view(N, T, HV, V), a.view(N, T, HV, K), b.view(N, T, HV), self.A_log,
                  self.dt_bias, c.state, slot_t, rows_t)
        options = dict(conv_weights=self.conv_weights_qkv, conv_states=c.conv_qkv,
                       intermediate_conv=c.intermediate_conv_qkv,
                       snapshots=c.snapshots if c.rings is None else None, rings=c.rings,
                       lower_bound=self.lower_bound, norm_gate=gate.view(N, T, HV, V),
                       norm_weight=self.o_norm_weight, norm_eps=self.norm_eps)
        o = mtp_verify(*tokens, **options) if parents is None else tree_verify(*tokens, parents, **options)
        return self.o_proj(o.view(N, T, HV * V))

    def commit_node(self, slots, scratch_rows, accepted_nodes, *, paths=None, path_lens=None,
                    cache: LayerCache | None = None) -> None:
        """Keep node ``accepted_nodes[n]`` of the last tree verify (the end of the accepted
        path; -1 keeps nothing): its snapshot and windows into the slot. A ring pool folds the
        path instead: ``paths [N, P]`` (node ids, node 0 first) and ``path_lens [N]``."""
        c = self._cache(cache)
        dev = self.conv_weight.device
        as_t = (lambda t: t if torch.is_tensor(t) else torch.as_tensor(t, dtype=torch.int32, device=dev))
        snapshots = c.snapshots
        if c.rings is not None:
            if paths is None or path_lens is None:
                raise ValueError("a ring pool commits a tree's accepted path: pass `paths` and `path_lens`.")
            commit_tree_ring(c.state, *c.rings, as_t(slots), as_t(paths), as_t(path_lens))
            snapshots = None  # the windows still come from the accepted node
        commit_snapshots(c.state, snapshots, as_t(slots), as_t(scratch_rows), as_t(accepted_nodes),
                         conv_states=[c.conv], intermediate_conv=[c.intermediate_conv])

    # ------------------------------------------------------------------ transformers
    @classmethod
    def from_transformers(cls, module: nn.Module) -> "KDALayer":
        """This layer with the weights of Hugging Face transformers' ``KimiLinearDeltaAttention``
        ``module`` (Kimi Linear, transformers 5.17-5.23): same device; the projections keep their
        dtype, the conv taps, ``A_log``, ``dt_bias`` and the output-norm weight become float32.
        The caches are kdakit's (attach a ``StatePool``), not transformers' ``DynamicCache``."""
        needed = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj",
                  "o_norm", "o_proj", "num_heads", "head_dim", "conv_kernel_size", "activation")
        missing = [n for n in needed if not hasattr(module, n)]
        if missing:
            raise ValueError(f"from_transformers takes a transformers KimiLinearDeltaAttention (got "
                             f"{type(module).__name__}, which has no {', '.join(missing)}).")
        if module.activation not in ("silu", "swish"):
            raise ValueError(f"kdakit's short conv applies SiLU; this layer's activation is {module.activation!r}.")
        if module.conv1d.bias is not None:
            raise ValueError("kdakit's KDALayer has no short-conv bias; this layer has one.")
        fg = module.forget_gate
        H, K, W = module.num_heads, module.head_dim, module.conv_kernel_size
        hidden = module.q_proj.weight.shape[1]
        shapes = {"q_proj": (module.q_proj.weight, (H * K, hidden)), "conv1d": (module.conv1d.weight, (3 * H * K, 1, W)),
                  "forget_gate.A_log": (fg.A_log, (1, 1, H, 1)), "forget_gate.dt_bias": (fg.dt_bias, (H * K,)),
                  "o_norm": (module.o_norm.weight, (K,)), "b_proj": (module.b_proj.weight, (H, hidden))}
        for name, (t, shape) in shapes.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"`{name}` has shape {tuple(t.shape)}, expected {shape} for H={H}, K=V={K}, "
                                 f"W={W}, hidden={hidden}.")
        p = module.q_proj.weight
        layer = cls(hidden, H, K, K, conv_width=W, norm_eps=module.o_norm.variance_epsilon,
                    device=p.device, dtype=p.dtype)
        f32 = torch.float32
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
                getattr(layer, name).weight.copy_(getattr(module, name).weight)
            layer.f_a_proj.weight.copy_(fg.f_a_proj.weight)
            layer.f_b_proj.weight.copy_(fg.f_b_proj.weight)
            layer.conv_weight.copy_(module.conv1d.weight.squeeze(1).to(f32))
            layer.A_log.copy_(fg.A_log.reshape(H).to(f32))
            layer.dt_bias.copy_(fg.dt_bias.to(f32))
            layer.o_norm_weight.copy_(module.o_norm.weight.to(f32))
        return layer

    # ------------------------------------------------------------------ tensor parallelism
    @classmethod
    def shard(cls, full: "KDALayer", tp_rank: int, tp_size: int) -> "KDALayer":
        """The ``tp_rank``-th of ``tp_size`` shards of the unsharded layer ``full`` (same weights)."""
        if full.tp_size != 1:
            raise ValueError("shard() cuts an unsharded layer (tp_size=1).")
        p = next(full.parameters())
        layer = cls(full.hidden_size, full.total_heads, full.K, full.V, num_v_heads=full.total_v_heads,
                    conv_width=full.conv_width, lower_bound=full.lower_bound, norm_eps=full.norm_eps,
                    tp_rank=tp_rank, tp_size=tp_size, device=p.device, dtype=full.q_proj.weight.dtype)
        H, HV, K, V = layer.H, layer.HV, layer.K, layer.V
        hk = slice(tp_rank * H * K, (tp_rank + 1) * H * K)
        hvk = slice(tp_rank * HV * K, (tp_rank + 1) * HV * K)
        hvv = slice(tp_rank * HV * V, (tp_rank + 1) * HV * V)
        hv = slice(tp_rank * HV, (tp_rank + 1) * HV)
        fq, fk, fv = full.conv_weights_qkv
        with torch.no_grad():
            layer.q_proj.weight.copy_(full.q_proj.weight[hk])
            layer.k_proj.weight.copy_(full.k_proj.weight[hk])
            layer.v_proj.weight.copy_(full.v_proj.weight[hvv])
            layer.conv_weight.copy_(torch.cat([fq[hk], fk[hk], fv[hvv]]))
            layer.f_a_proj.weight.copy_(full.f_a_proj.weight)          # replicated
            layer.f_b_proj.weight.copy_(full.f_b_proj.weight[hvk])
            layer.b_proj.weight.copy_(full.b_proj.weight[hv])
            layer.A_log.copy_(full.A_log[hv])
            layer.dt_bias.copy_(full.dt_bias[hvk])
            layer.g_a_proj.weight.copy_(full.g_a_proj.weight)          # replicated
            layer.g_b_proj.weight.copy_(full.g_b_proj.weight[hvv])
            layer.o_norm_weight.copy_(full.o_norm_weight)              # per head dim: replicated
            layer.o_proj.weight.copy_(full.o_proj.weight[:, hvv])      # row-parallel: partial sums
        return layer

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, H={self.H}, HV={self.HV}, K={self.K}, V={self.V}, W={self.conv_width}, "
                f"lower_bound={self.lower_bound}, tp={self.tp_rank}/{self.tp_size}")
