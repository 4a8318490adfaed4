"""The decoding loops of `kdakit demo`, shared by its two models: kdakit's own tiny KDA model
(``kdakit.demo.TinyKDAModel``, ``--toy``) and transformers' Kimi Linear served by kdakit
(``kdakit.demo_hf.ServedKimiLinear``). Either model offers ``vocab``, ``lm_head``, ``timer``,
``new_pool``, ``prefill``, ``decode``, ``verify``, ``commit``, ``verify_tree`` and
``commit_node``; the loops generate greedily with them: plainly, with chain drafts
(``generate_speculative``) and with top-2 draft trees (``generate_tree``).

Below both demos (they import it, it imports neither), with the timer and the progress bar.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from .state_pool import PAD


class OpTimer:
    """Wall µs per call of each named op (the device synchronised around every call)."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.times: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def __call__(self, name: str):
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.times[name].append((time.perf_counter() - t0) * 1e6)

    def summary(self) -> dict:
        """Median µs per call (the first call of a shape pays the kernel's compile on a GPU)."""
        return {name: {"us": round(statistics.median(ts), 1), "calls": len(ts)} for name, ts in self.times.items()}


@contextmanager
def _null():
    yield



# ----------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------
class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal, else one line at the end)."""

    def __init__(self, label: str, total: int, enabled: bool = True, width: int = 32):
        self.label, self.total, self.width, self.done = label, total, width, 0
        self.enabled, self.tty = enabled, sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        if self.enabled and self.tty:
            self._draw(note, "\r")

    def close(self, note: str = "") -> None:
        if self.enabled:
            self._draw(note, "\r" if self.tty else "")
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _draw(self, note: str, prefix: str) -> None:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"{prefix}{self.label:<22s} [{bar}] {self.done:>4d}/{self.total} tokens "
                         f"{time.perf_counter() - self.t0:5.1f}s {note}")
        sys.stderr.flush()


# ----------------------------------------------------------------------------
# The generations: plain, chain drafts, draft trees
# ----------------------------------------------------------------------------
def generate_plain(model, prompts, new_tokens: int, progress: bool) -> list[list[int]]:
    N = len(prompts)
    dev = model.lm_head.weight.device
    pool = model.new_pool(N, None, 0, 0)
    slots = [pool.alloc() for _ in range(N)]
    out = [[t] for t in model.prefill(prompts, slots).argmax(-1).tolist()]
    bar = Progress("plain decode", N * new_tokens, progress)
    bar.update(N)
    slot_t = torch.tensor(slots, dtype=torch.int32, device=dev)
    for _ in range(new_tokens - 1):
        last = torch.tensor([o[-1] for o in out], device=dev)
        for o, t in zip(out, model.decode(last, slot_t).argmax(-1).tolist()):
            o.append(t)
        bar.update(N)
    bar.close()
    return out


def generate_speculative(model, prompts, new_tokens: int, num_spec: int, spec: str,
                         reference: list[list[int]], corrupt: float, seed: int, progress: bool):
    """Greedy speculative decoding; returns (tokens, stats)."""
    N = len(prompts)
    dev = model.lm_head.weight.device
    rng = torch.Generator().manual_seed(seed + 1)
    pool = model.new_pool(N, spec, num_spec, scratch_rows=N)
    slots = [pool.alloc() for _ in range(N)]
    out = [[t] for t in model.prefill(prompts, slots).argmax(-1).tolist()]
    rows = torch.arange(N, dtype=torch.int32, device=dev)
    bar = Progress(f"speculative ({spec})", N * new_tokens, progress)
    bar.update(N)
    accept_lens_seen, drafted, accepted, rounds = [], 0, 0, 0
    while any(len(o) < new_tokens for o in out):
        live = [len(o) < new_tokens for o in out]
        # Draft: the reference continuation, each token corrupted with probability `corrupt`.
        drafts = []
        for n, o in enumerate(out):
            d = reference[n][len(o):len(o) + num_spec]
            d = d + torch.randint(model.vocab, (num_spec - len(d),), generator=rng).tolist()
            noise = torch.rand(num_spec, generator=rng) < corrupt
            d = [int(torch.randint(model.vocab, (1,), generator=rng)) if bad else t for t, bad in zip(d, noise)]
            drafts.append(d)
        tokens = torch.tensor([[o[-1]] + d for o, d in zip(out, drafts)], device=dev)
        slot_t = torch.tensor([s if ok else PAD for s, ok in zip(slots, live)], dtype=torch.int32, device=dev)
        preds = model.verify(tokens, slot_t, rows).argmax(-1).tolist()   # [N, 1+num_spec]
        accept_lens = []
        for n in range(N):
            if not live[n]:
                accept_lens.append(0)
                continue
            m = 0
            while m < num_spec and drafts[n][m] == preds[n][m]:
                m += 1
            emitted = preds[n][:m + 1][:new_tokens - len(out[n])]
            out[n].extend(emitted)
            accept_lens.append(m + 1)  # the last token and m drafts are now in the state
            accept_lens_seen.append(m + 1)
            drafted += num_spec
            accepted += m
            bar.update(len(emitted))
        model.commit(slot_t, rows, torch.tensor(accept_lens, dtype=torch.int32, device=dev))
        rounds += 1
    bar.close(f"{rounds} rounds")
    hist = [accept_lens_seen.count(i) for i in range(1, num_spec + 2)]
    return out, {"rounds": rounds, "accept_rate": accepted / max(drafted, 1), "accept_len_hist": hist}


def top2_tree(depth: int) -> list[int]:
    """The parents of a top-2 draft tree ``depth`` levels deep: two candidates at every level,
    the first of them (the drafter's top-1) expanded. Node 0 is the last token; level ``l``
    holds nodes ``2l - 1`` (expanded) and ``2l``."""
    parents = [-1]
    for level in range(1, depth + 1):
        expanded = 0 if level == 1 else 2 * level - 3
        parents += [expanded, expanded]
    return parents


def generate_tree(model, prompts, new_tokens: int, depth: int, reference: list[list[int]],
                  corrupt: float, seed: int, progress: bool, ring: bool = False):
    """Greedy tree speculation (``tree_verify`` + ``commit_snapshots`` of the accepted node, or
    with ``ring`` the ring-mode verify and ``commit_tree_ring`` of the accepted path);
    returns (tokens, stats). At each level the drafter's top-1 is run (a)'s next token,
    corrupted with probability ``corrupt``; its second candidate is then, half the time, the
    right token (so accepted paths end in either branch), else a random one."""
    N = len(prompts)
    dev = model.lm_head.weight.device
    rng = torch.Generator().manual_seed(seed + 1)
    parents_list = top2_tree(depth)
    T = len(parents_list)
    children = [[c for c in range(T) if parents_list[c] == node and c > 0] for node in range(T)]
    parents = torch.tensor([parents_list] * N, dtype=torch.int32, device=dev)
    pool = model.new_pool(N, "ring" if ring else "snapshot", T - 1, scratch_rows=N)
    slots = [pool.alloc() for _ in range(N)]
    out = [[t] for t in model.prefill(prompts, slots).argmax(-1).tolist()]
    rows = torch.arange(N, dtype=torch.int32, device=dev)
    bar = Progress(f"speculative (tree{'-ring' if ring else ''})", N * new_tokens, progress)
    bar.update(N)
    accept_lens_seen, drafted, accepted, rounds = [], 0, 0, 0
    while any(len(o) < new_tokens for o in out):
        live = [len(o) < new_tokens for o in out]
        trees = []
        for n, o in enumerate(out):
            ref = reference[n][len(o):len(o) + depth]
            ref = ref + torch.randint(model.vocab, (depth - len(ref),), generator=rng).tolist()
            nodes = [o[-1]]
            for level in range(depth):
                top1 = ref[level]
                if float(torch.rand(1, generator=rng)) < corrupt:
                    top1 = int(torch.randint(model.vocab, (1,), generator=rng))
                second = ref[level] if (top1 != ref[level] and float(torch.rand(1, generator=rng)) < 0.5) \
                    else int(torch.randint(model.vocab, (1,), generator=rng))
                nodes += [top1, second]
            trees.append(nodes)
        tokens = torch.tensor(trees, device=dev)
        slot_t = torch.tensor([s if ok else PAD for s, ok in zip(slots, live)], dtype=torch.int32, device=dev)
        preds = model.verify_tree(tokens, slot_t, rows, parents).argmax(-1).tolist()   # [N, T]
        accepted_nodes, paths = [], []
        for n in range(N):
            if not live[n]:
                accepted_nodes.append(-1)
                paths.append([])
                continue
            node, path = 0, [0]
            while True:  # follow the child whose token the model predicts after this node
                nxt = [c for c in children[node] if trees[n][c] == preds[n][node]]
                if not nxt:
                    break
                node = nxt[0]
                path.append(node)
            emitted = [preds[n][i] for i in path][:new_tokens - len(out[n])]
            out[n].extend(emitted)
            accepted_nodes.append(node)
            paths.append(path)
            accept_lens_seen.append(len(path))
            drafted += depth
            accepted += len(path) - 1
            bar.update(len(emitted))
        path_t = torch.tensor([p + [-1] * (T - len(p)) for p in paths], dtype=torch.int32, device=dev)
        lens_t = torch.tensor([len(p) for p in paths], dtype=torch.int32, device=dev)
        model.commit_node(slot_t, rows, torch.tensor(accepted_nodes, dtype=torch.int32, device=dev), path_t, lens_t)
        rounds += 1
    bar.close(f"{rounds} rounds")
    hist = [accept_lens_seen.count(i) for i in range(1, depth + 2)]
    return out, {"rounds": rounds, "accept_rate": accepted / max(drafted, 1), "accept_len_hist": hist}
