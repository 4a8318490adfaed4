"""`kdakit demo`: a tiny random-weight KDA language model, decoded twice, with identical tokens.

The model: embedding -> N x (x + KDALayer(rmsnorm(x))) -> rmsnorm -> LM head, its caches in
one ``StatePool``. The same prompts are generated greedily twice:

(a) plain decoding, one token per step (``KDALayer.decode``: ``fused_decode``);
(b) speculative decoding: each round verifies the last token plus ``num_spec`` drafted
    tokens (``mtp_verify``), accepts the longest drafted prefix the model agrees with (plus
    the model's own next token), and commits it (``commit_ring`` or ``commit_snapshots``).
    The drafter knows run (a)'s continuation and corrupts each drafted token with a seeded
    probability, so accept lengths vary from round to round; the tokens emitted come from
    the verify logits alone, so a wrong verify or commit shows as a mismatch.

Finished requests stay in the batch as padding rows (slot ``PAD``), as in a CUDA-graph
batch of fixed size. Exit code 0 when both runs give the same tokens, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

from .backends import select
# The decoding loops live in kdakit.generation, below this module and kdakit.demo_hf (which
# both use them); the names stay importable from here.
from .generation import (OpTimer, Progress, _null, generate_plain, generate_speculative,  # noqa: F401
                         generate_tree, top2_tree)
from .layer import KDALayer
from .state_pool import StatePool


# ----------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


class TinyKDAModel(nn.Module):
    def __init__(self, vocab: int = 256, hidden: int = 64, num_layers: int = 3, num_heads: int = 2,
                 head_dim: int = 32, lower_bound: float | None = None, seed: int = 0, device="cpu",
                 dtype=torch.float32):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.hidden = vocab, hidden
        self.embed = nn.Embedding(vocab, hidden)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, hidden, generator=gen))
        self.layers = nn.ModuleList()
        for _ in range(num_layers):
            layer = KDALayer(hidden, num_heads, head_dim, head_dim, lower_bound=lower_bound)
            layer.reset_parameters(gen)
            self.layers.append(layer)
        self.norm_weights = nn.Parameter(torch.ones(num_layers + 1, hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5 * 4)
        self.to(device=device, dtype=dtype)
        for layer in self.layers:  # the conv weights, A_log, dt_bias and norm weight stay float32
            layer.float()
            for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.f_a_proj, layer.f_b_proj, layer.b_proj,
                        layer.g_a_proj, layer.g_b_proj, layer.o_proj):
                lin.to(dtype)
        self.timer: OpTimer | None = None

    def new_pool(self, num_slots: int, spec: str | None, num_spec: int, scratch_rows: int) -> StatePool:
        l0 = self.layers[0]
        dev = self.lm_head.weight.device
        pool = StatePool(len(self.layers), num_slots, num_heads=l0.H, num_v_heads=l0.HV, head_k_dim=l0.K,
                         head_v_dim=l0.V, conv_width=l0.conv_width, act_dtype=self.lm_head.weight.dtype,
                         device=dev, spec=spec, num_spec=num_spec, scratch_rows=scratch_rows)
        for i, layer in enumerate(self.layers):
            layer.attach(pool, i)
        return pool

    def _run(self, tokens: torch.Tensor, mode: str, *args) -> torch.Tensor:
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, self.norm_weights[i])
            with self.timer(mode) if self.timer else _null():
                h = h + getattr(layer, mode)(x, *args)
        return self.lm_head(rms_norm(h, self.norm_weights[-1]))

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """All prompts in one varlen prefill; returns the logits of each prompt's last token [N, vocab]."""
        dev = self.lm_head.weight.device
        flat = torch.tensor([t for p in prompts for t in p], device=dev)
        cu = [0]
        for p in prompts:
            cu.append(cu[-1] + len(p))
        logits = self._run(flat, "prefill", slots, cu)
        return logits[torch.tensor(cu[1:], device=dev) - 1]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, "decode", slots)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, "verify", slots, rows)

    @torch.no_grad()
    def commit(self, slots, rows, accept_lens) -> None:
        for layer in self.layers:
            with self.timer("commit") if self.timer else _null():
                layer.commit(slots, rows, accept_lens)


    @torch.no_grad()
    def verify_tree(self, tokens: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                    parents: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, self.norm_weights[i])
            with self.timer("verify") if self.timer else _null():
                h = h + layer.verify_tree(x, slots, rows, parents)
        return self.lm_head(rms_norm(h, self.norm_weights[-1]))

    @torch.no_grad()
    def commit_node(self, slots, rows, accepted_nodes, paths=None, path_lens=None) -> None:
        for layer in self.layers:
            with self.timer("commit") if self.timer else _null():
                layer.commit_node(slots, rows, accepted_nodes, paths=paths, path_lens=path_lens)


# ----------------------------------------------------------------------------
def run(args) -> dict:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    model = TinyKDAModel(args.vocab, args.hidden, args.layers, args.heads, args.head_dim,
                         lower_bound=args.lower_bound, seed=args.seed, device=dev)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(args.vocab, (args.prompt_len + 3 * n,), generator=gen).tolist()
               for n in range(args.batch)]
    backend = select("fused_decode", dev)[0]
    if not args.json:
        print(f"kdakit demo: {args.layers}-layer KDA model (vocab {args.vocab}, hidden {args.hidden}, "
              f"H=HV={args.heads}, K=V={args.head_dim}, random weights, seed {args.seed}) on {dev} "
              f"({backend} backend); {args.batch} prompts, {args.new_tokens} new tokens each, "
              f"{args.num_spec} drafts per round, {args.spec} commit")
    t0 = time.perf_counter()
    model.timer = OpTimer(dev)
    plain = generate_plain(model, prompts, args.new_tokens, not args.quiet)
    plain_timer = model.timer
    model.timer = OpTimer(dev)
    if args.spec in ("tree", "tree-ring"):  # top-2 trees num_spec levels deep
        spec_tokens, stats = generate_tree(model, prompts, args.new_tokens, args.num_spec, plain, args.corrupt,
                                           args.seed, not args.quiet, ring=args.spec == "tree-ring")
    else:
        spec_tokens, stats = generate_speculative(model, prompts, args.new_tokens, args.num_spec, args.spec, plain,
                                                  args.corrupt, args.seed, not args.quiet)
    times = {**plain_timer.summary(), **model.timer.summary()}
    match = spec_tokens == plain
    return {"match": match, "accept_rate": round(stats["accept_rate"], 4),
            "tokens": sum(len(o) for o in spec_tokens), "rounds": stats["rounds"],
            "accept_len_hist": stats["accept_len_hist"], "num_spec": args.num_spec, "spec": args.spec,
            "device": str(dev), "backend": backend, "us_per_layer_call": times,
            "seconds": round(time.perf_counter() - t0, 2), "plain": plain, "speculative": spec_tokens}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON line (match, accept_rate, tokens, ...)")
    p.add_argument("--toy", action="store_true",
                   help="kdakit's own tiny KDA-only model (no transformers): plain vs one speculative mode (--spec), "
                        "the safe gate (--lower-bound) and per-op timings")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local Kimi Linear checkpoint directory (config.json of model_type kimi_linear + safetensors, "
                        "as save_pretrained writes them) instead of the tiny model; exit 2 naming what is wrong when "
                        "it is not one")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype (transformers demo)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--spec", choices=("ring", "snapshot", "tree", "tree-ring"), default="ring",
                   help="how verify keeps its steps (tree, tree-ring: top-2 draft trees --num-spec levels deep, "
                        "snapshots or rings)")
    p.add_argument("--num-spec", type=int, default=3, help="drafted tokens per round")
    p.add_argument("--new-tokens", type=int, default=40, help="tokens generated per prompt")
    p.add_argument("--batch", type=int, default=3, help="prompts decoded together")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--lower-bound", type=float, default=None, help="safe gate lower bound (Kimi K3), e.g. -5")
    p.add_argument("--corrupt", type=float, default=0.3, help="probability that a drafted token is wrong")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def main(args) -> int:
    if not args.toy:
        return _main_transformers(args)
    if args.num_spec < 1 or args.new_tokens < 1 or args.batch < 1:
        print("kdakit demo: --num-spec, --new-tokens and --batch must be >= 1", file=sys.stderr)
        return 2
    # The model is tiny: on a CPU, intra-op threads only add synchronisation (on small
    # machines a 3x64 matmul took ~20 ms with 2 threads, 6 µs with one). Restored after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run(args)
    finally:
        torch.set_num_threads(threads)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k not in ("plain", "speculative")}))
    else:
        show = 16
        for n, (p, s) in enumerate(zip(result["plain"], result["speculative"])):
            print(f"  prompt {n}: plain       {' '.join(f'{t:3d}' for t in p[:show])} ...")
            print(f"            speculative {' '.join(f'{t:3d}' for t in s[:show])} ...")
        hist = ", ".join(f"{i + 1}: {c}" for i, c in enumerate(result["accept_len_hist"]))
        print(f"match: {'YES' if result['match'] else 'NO'}: {result['tokens']} tokens; "
              f"{result['rounds']} verify rounds, draft accept rate {result['accept_rate']:.2f}, "
              f"accepted tokens per request-round {{{hist}}}")
        print("per KDA layer call (median µs): " + ", ".join(
            f"{op} {t['us']:.0f} ({t['calls']} calls)" for op, t in result["us_per_layer_call"].items()))
        print(f"done in {result['seconds']:.1f} s")
    return 0 if result["match"] else 1


def _main_transformers(args) -> int:
    """The default demo: transformers' Kimi Linear, (a) as is, (b) with enable(), (c) served by kdakit."""
    if args.num_spec < 1 or args.new_tokens < 2 or args.batch < 1:
        print("kdakit demo: --num-spec and --batch must be >= 1, --new-tokens >= 2", file=sys.stderr)
        return 2
    from . import demo_hf
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only add synchronisation on a CPU
    try:
        return demo_hf.main(args)
    finally:
        torch.set_num_threads(threads)
