"""`kdakit demo` on Hugging Face transformers' Kimi Linear (``KimiLinearForCausalLM``).

The model: by default a tiny one built from a config with seeded random weights (no download;
3 KDA layers, 1 MLA full-attention layer, 2 MoE MLPs), or a local checkpoint (``--model PATH``).
The same prompts (random token ids, one longer than a 64-token chunk) are generated greedily:

(a) by transformers' own implementation, ``generate()`` on a left-padded batch (on a CPU its
    PyTorch bodies of the KDA kernels; on a GPU whatever transformers bound: fla when installed);
(b) the same ``generate()`` after ``kdakit.integrations.transformers.enable()``;
(c) through kdakit's serving stack: each KDA layer as ``KDALayer.from_transformers`` on one
    ``StatePool`` (varlen prefill, one-token decode, speculative verify and commit), the MLA and
    MoE layers still transformers' modules; plainly, then speculatively with chain drafts (ring
    and snapshot commits) and top-2 tree drafts (snapshot and ring commits). The drafter knows
    (a)'s continuation and corrupts each drafted token with a seeded probability; emitted
    tokens come from the verify logits alone, so a wrong verify or commit shows as a mismatch.

Exit code 0 only when every run gives (a)'s tokens and (b) and (c)'s plain logits are within
float32 rounding of (a)'s (bf16 rounding for a bf16 model).
"""
from __future__ import annotations

import json
import pathlib
import sys
import time
from contextlib import contextmanager

import torch

from .generation import OpTimer, Progress, generate_plain, generate_speculative, generate_tree, _null
from .layer import KDALayer
from .state_pool import PAD, StatePool


class CheckpointError(ValueError):
    """``--model PATH`` is not a Kimi Linear checkpoint kdakit can load (said in one line, exit 2)."""


# The fields of config.json without which a Kimi Linear config falls back to the 48B model's
# sizes (KimiLinearConfig's defaults): checked before any tensor is allocated.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _some(keys, n: int = 3) -> str:
    keys = sorted(keys, key=str)
    return ", ".join(map(str, keys[:n])) + (f" and {len(keys) - n} more" if len(keys) > n else "")


@contextmanager
def _quiet_transformers():
    """transformers' loading report (a table per checkpoint) and progress bars off: a bad
    checkpoint is said in CheckpointError's one line instead."""
    from transformers.utils import logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def load_checkpoint(path: str, dtype: torch.dtype, device) -> "torch.nn.Module":
    """A local Kimi Linear checkpoint (config.json of ``model_type`` ``kimi_linear`` and its
    safetensors: what ``save_pretrained`` writes, the published checkpoints' layout) as a
    ``KimiLinearForCausalLM`` in eval mode. Raises :class:`CheckpointError` naming what is wrong
    when the folder is not one: no config.json, another model type, a required field missing, no
    KDA layer, no weights, or weights that do not fit the config (missing, unexpected or of
    another shape: none of the model's tensors is left randomly initialised)."""
    from .integrations import transformers as kt
    kt.kimi_linear_module()
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    where = pathlib.Path(path)
    if not where.is_dir():
        raise CheckpointError(f"--model {path}: {'not a directory' if where.exists() else 'no such directory'} (a local Kimi Linear checkpoint: config.json and "
                              "*.safetensors; download a published one first)")
    config_file = where / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"--model {path}: no config.json in it (not a transformers checkpoint)")
    try:
        raw = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"--model {path}: config.json is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"--model {path}: config.json is not a JSON object")
    if "model_type" not in raw:
        raise CheckpointError(f"--model {path}: config.json has no model_type (a Kimi Linear checkpoint's is "
                              f"{KimiLinearConfig.model_type!r})")
    if raw["model_type"] != KimiLinearConfig.model_type:
        raise CheckpointError(f"--model {path}: config.json's model_type is {raw.get('model_type')!r}, not "
                              f"{KimiLinearConfig.model_type!r}: not a Kimi Linear checkpoint")
    missing_fields = [name for name in REQUIRED_FIELDS if name not in raw]
    if missing_fields:
        raise CheckpointError(f"--model {path}: config.json has no {', '.join(missing_fields)}")
    if not any(where.glob("*.safetensors")) and not any(where.glob("*.bin")):
        raise CheckpointError(f"--model {path}: no weights in it (no *.safetensors)")
    try:
        config = KimiLinearConfig.from_pretrained(str(where))
    except Exception as e:  # a field of the wrong type or value: transformers' own words
        raise CheckpointError(f"--model {path}: config.json does not describe a Kimi Linear model: "
                              f"{type(e).__name__}: {e}") from None
    if "linear_attention" not in (config.layer_types or ()):
        raise CheckpointError(f"--model {path}: no KDA layer (layer_types {config.layer_types})")
    with _quiet_transformers():
        model, info = KimiLinearForCausalLM.from_pretrained(str(where), config=config, dtype=dtype,
                                                            output_loading_info=True, ignore_mismatched_sizes=True)
    problems = []
    if info.get("missing_keys"):
        problems.append(f"{len(info['missing_keys'])} tensors missing ({_some(info['missing_keys'])})")
    if info.get("mismatched_keys"):
        shapes = [f"{k[0]}: checkpoint {list(k[1])}, config {list(k[2])}" if isinstance(k, tuple) and len(k) == 3
                  else str(k) for k in info["mismatched_keys"]]
        problems.append(f"{len(shapes)} tensors of another shape than config.json gives ({_some(shapes, 2)})")
    if info.get("unexpected_keys"):
        problems.append(f"{len(info['unexpected_keys'])} tensors the model has no place for "
                        f"({_some(info['unexpected_keys'])})")
    if info.get("error_msgs"):
        problems.append("; ".join(map(str, info["error_msgs"][:2])))
    if problems:
        raise CheckpointError(f"--model {path}: the weights do not fit the model config.json describes: "
                              + "; ".join(problems))
    return model.eval().to(device)


class _Latents:
    """One request's MLA latent cache (transformers' ``KimiLinearAttention`` calls only
    ``update``): verify appends its tokens as pending, ``keep`` retains the accepted ones."""

    def __init__(self):
        self.kv, self.pending = {}, {}

    def update(self, nope, rot, layer_idx, *args, **kwargs):
        past = self.kv.get(layer_idx)
        if past is not None:
            nope, rot = torch.cat([past[0], nope], 2), torch.cat([past[1], rot], 2)
        self.pending[layer_idx] = (nope, rot)
        return nope, rot

    def past(self, layer_idx) -> int:
        return 0 if layer_idx not in self.kv else self.kv[layer_idx][0].shape[2]

    def keep(self, new_positions) -> None:
        for layer_idx, (nope, rot) in self.pending.items():
            P = self.past(layer_idx)
            idx = torch.tensor(list(range(P)) + [P + j for j in new_positions], device=nope.device)
            self.kv[layer_idx] = (nope.index_select(2, idx), rot.index_select(2, idx))
        self.pending = {}


class ServedKimiLinear:
    """A transformers ``KimiLinearForCausalLM`` served by kdakit: KDA layers as ``KDALayer``s on a
    ``StatePool``, everything else the model's own modules. Same interface as the toy model of
    ``kdakit demo --toy`` (prefill / decode / verify / commit / verify_tree / commit_node)."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.vocab = self.config.vocab_size
        self.lm_head = model.lm_head
        self.decoder = model.model.layers
        self.kda = {i: KDALayer.from_transformers(layer.self_attn) for i, layer in enumerate(self.decoder)
                    if self.config.layer_types[i] == "linear_attention"}
        self.pool_index = {i: j for j, i in enumerate(self.kda)}
        self.timer: OpTimer | None = None
        self.latents: list[_Latents] = []

    def new_pool(self, num_slots: int, spec, num_spec: int, scratch_rows: int) -> StatePool:
        l0 = next(iter(self.kda.values()))
        pool = StatePool(len(self.kda), num_slots, num_heads=l0.H, head_k_dim=l0.K, head_v_dim=l0.V,
                         conv_width=l0.conv_width, act_dtype=self.lm_head.weight.dtype,
                         device=self.lm_head.weight.device, spec=spec, num_spec=num_spec, scratch_rows=scratch_rows)
        for i, layer in self.kda.items():
            layer.attach(pool, self.pool_index[i])
        self.latents = [_Latents() for _ in range(num_slots)]
        return pool

    # ------------------------------------------------------------------ the forward
    def _mla(self, attn, x, segments, masks):
        """transformers' MLA layer per request (its own latents); ``segments`` (slot, start, end)."""
        out = torch.zeros_like(x)
        for (slot, start, end), mask in zip(segments, masks):
            if slot < 0:
                continue
            lat = self.latents[slot]
            P = lat.past(attn.layer_idx)
            full = torch.ones(1, 1, end - start, P + end - start, dtype=torch.bool, device=x.device)
            full[..., P:] = mask
            out[start:end] = attn(x[None, start:end], attention_mask=full, past_key_values=lat)[0][0]
        return out

    @torch.no_grad()
    def _run(self, flat_tokens, segments, masks, mode, kda_call):
        h = self.model.model.embed_tokens(flat_tokens)
        for i, layer in enumerate(self.decoder):
            x = layer.input_layernorm(h)
            if i in self.kda:
                with self.timer(mode) if self.timer else _null():
                    h = h + kda_call(self.kda[i], x)
            else:
                h = h + self._mla(layer.self_attn, x, segments, masks)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.model.norm(h))

    @staticmethod
    def _causal(T, device):
        return torch.ones(T, T, dtype=torch.bool, device=device).tril()

    def _keep_all(self, segments):
        for slot, start, end in segments:
            if slot >= 0:
                self.latents[slot].keep(range(end - start))

    # ------------------------------------------------------------------ the toy model's interface
    def prefill(self, prompts, slots):
        dev = self.lm_head.weight.device
        flat = torch.tensor([t for p in prompts for t in p], device=dev)
        cu = [0]
        for p in prompts:
            cu.append(cu[-1] + len(p))
        segments = [(s, cu[n], cu[n + 1]) for n, s in enumerate(slots)]
        masks = [self._causal(len(p), dev) for p in prompts]
        logits = self._run(flat, segments, masks, "prefill", lambda layer, x: layer.prefill(x, slots, cu))
        self._keep_all(segments)
        return logits[torch.tensor(cu[1:], device=dev) - 1]

    def decode(self, tokens, slot_t):
        slots = slot_t.tolist()
        segments = [(s, n, n + 1) for n, s in enumerate(slots)]
        masks = [self._causal(1, tokens.device)] * len(slots)
        logits = self._run(tokens, segments, masks, "decode", lambda layer, x: layer.decode(x, slot_t))
        self._keep_all(segments)
        return logits

    def verify(self, tokens, slot_t, rows):
        N, T = tokens.shape
        segments = [(s, n * T, (n + 1) * T) for n, s in enumerate(slot_t.tolist())]
        masks = [self._causal(T, tokens.device)] * N
        logits = self._run(tokens.reshape(-1), segments, masks, "verify",
                           lambda layer, x: layer.verify(x.view(N, T, -1), slot_t, rows).reshape(N * T, -1))
        return logits.view(N, T, -1)

    def commit(self, slot_t, rows, accept_lens):
        for layer in self.kda.values():
            with self.timer("commit") if self.timer else _null():
                layer.commit(slot_t, rows, accept_lens)
        for s, n in zip(slot_t.tolist(), accept_lens.tolist()):
            if s >= 0:
                self.latents[s].keep(range(n))

    def verify_tree(self, tokens, slot_t, rows, parents):
        N, T = tokens.shape
        segments = [(s, n * T, (n + 1) * T) for n, s in enumerate(slot_t.tolist())]
        masks = []
        for n in range(N):  # a node sees its ancestors and itself
            m = torch.zeros(T, T, dtype=torch.bool, device=tokens.device)
            par = parents[n].tolist()
            for node in range(T):
                a = node
                while a >= 0:
                    m[node, a] = True
                    a = par[a]
            masks.append(m)
        logits = self._run(tokens.reshape(-1), segments, masks, "verify",
                           lambda layer, x: layer.verify_tree(x.view(N, T, -1), slot_t, rows, parents)
                           .reshape(N * T, -1))
        return logits.view(N, T, -1)

    def commit_node(self, slot_t, rows, accepted_nodes, paths=None, path_lens=None):
        for layer in self.kda.values():
            with self.timer("commit") if self.timer else _null():
                layer.commit_node(slot_t, rows, accepted_nodes, paths=paths, path_lens=path_lens)
        for n, s in enumerate(slot_t.tolist()):
            if s >= 0:
                self.latents[s].keep(paths[n, :int(path_lens[n])].tolist())


# ----------------------------------------------------------------------------
def _generate_hf(model, prompts, new_tokens):
    T = max(len(p) for p in prompts)
    dev = model.lm_head.weight.device
    ids = torch.zeros(len(prompts), T, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    for n, p in enumerate(prompts):  # left padding, as generate() wants for a decoder-only model
        ids[n, T - len(p):] = torch.tensor(p, device=dev)
        mask[n, T - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id or 0)
    return out.sequences[:, T:].tolist(), torch.stack(out.logits, 1).float()


def _plain_with_logits(served, prompts, new_tokens, progress):
    """(c) plain, keeping each step's logits [N, new_tokens, vocab] for the comparison with (a)."""
    seen = []
    prefill, decode = served.prefill, served.decode
    served.prefill = lambda *a: (lambda lg: (seen.append(lg.float()), lg)[1])(prefill(*a))
    served.decode = lambda *a: (lambda lg: (seen.append(lg.float()), lg)[1])(decode(*a))
    try:
        tokens = generate_plain(served, prompts, new_tokens, progress)
    finally:
        del served.prefill, served.decode
    return tokens, torch.stack(seen, 1)


def run(args) -> dict:
    from .integrations import transformers as kt
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    progress = not args.quiet
    t_load = time.perf_counter()
    if args.model:
        model = load_checkpoint(args.model, dtype, dev)
        what = f"checkpoint {args.model}"
    else:
        model = kt.tiny_model(seed=args.seed, dtype=dtype, device=dev)
        what = f"tiny KimiLinearForCausalLM, random weights (seed {args.seed})"
    cfg = model.config
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [args.prompt_len + 3 * n for n in range(args.batch)]
    lengths[0] = max(lengths[0], 70)  # one prompt longer than a 64-token chunk
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    header = (f"kdakit demo: {what}: {sum(t == 'linear_attention' for t in cfg.layer_types)} KDA + "
              f"{sum(t == 'full_attention' for t in cfg.layer_types)} MLA layers, hidden {cfg.hidden_size}, "
              f"H={cfg.linear_num_heads}, K=V={cfg.linear_head_dim}, vocab {cfg.vocab_size}, {args.dtype}, on {dev}; "
              f"{args.batch} prompts of {', '.join(map(str, lengths))} tokens, {args.new_tokens} new tokens each")
    if not args.json:
        print(header, file=sys.stderr if args.json else sys.stdout)
    runs = []
    tol = 1e-4 if dtype == torch.float32 else 5e-2

    def record(name, tokens, seconds, logits=None, stats=None, ref=None):
        diff = None if logits is None or ref is None else float((logits - ref["logits"]).abs().max())
        runs.append({"run": name, "tokens": tokens, "seconds": round(seconds, 3),
                     "tokens_per_s": round(sum(len(t) for t in tokens) / max(seconds, 1e-9), 1),
                     "match": ref is None or tokens == ref["tokens"],
                     "logits_ok": diff is None or diff <= tol * max(1.0, float(ref["logits"].abs().max())),
                     "max_logit_diff": diff, **({} if stats is None else stats)})
        return runs[-1]

    own = kt.torch_fallback() if dev.type == "cpu" else _null()  # fla's Triton kernels cannot run on a CPU
    own_name = "(a) transformers" + (" (its PyTorch KDA)" if dev.type == "cpu" else "")
    with own:
        _generate_hf(model, prompts[:1], 2)  # warm-up (first-call costs) outside the timings
        bar = Progress("(a) transformers", 1, progress)
        t0 = time.perf_counter()
        tokens, logits = _generate_hf(model, prompts, args.new_tokens)
        bar.update(1)
        bar.close()
    ref = record(own_name, tokens, time.perf_counter() - t0)
    ref["logits"] = logits
    with kt.enabled():
        _generate_hf(model, prompts[:1], 2)
        bar = Progress("(b) enable()", 1, progress)
        t0 = time.perf_counter()
        tokens, logits = _generate_hf(model, prompts, args.new_tokens)
        bar.update(1)
        bar.close()
    record("(b) transformers + kdakit.enable()", tokens, time.perf_counter() - t0, logits, ref=ref)

    served = ServedKimiLinear(model)
    served.timer = OpTimer(dev)
    t0 = time.perf_counter()
    tokens, logits = _plain_with_logits(served, prompts, args.new_tokens, progress)
    record("(c) kdakit serving, plain", tokens, time.perf_counter() - t0, logits, ref=ref)
    timings = served.timer.summary()
    accept = None
    for name, spec in (("chain, ring commit", "ring"), ("chain, snapshot commit", "snapshot"),
                       ("tree, snapshot commit", "tree"), ("tree, ring commit", "tree-ring")):
        served.timer = OpTimer(dev)
        t0 = time.perf_counter()
        if spec.startswith("tree"):
            tokens, stats = generate_tree(served, prompts, args.new_tokens, args.num_spec, ref["tokens"], args.corrupt,
                                          args.seed, progress, ring=spec == "tree-ring")
        else:
            tokens, stats = generate_speculative(served, prompts, args.new_tokens, args.num_spec, spec, ref["tokens"],
                                                 args.corrupt, args.seed, progress)
        r = record(f"(c) kdakit serving, {name}", tokens, time.perf_counter() - t0,
                   stats={**stats, "accept_rate": round(stats["accept_rate"], 4), "spec": spec}, ref=ref)
        timings.update({k: v for k, v in served.timer.summary().items() if k not in timings})
        accept = accept or r
    del ref["logits"]
    match = all(r["match"] and r["logits_ok"] for r in runs)
    return {"match": match, "accept_rate": accept["accept_rate"], "tokens": sum(len(t) for t in accept["tokens"]),
            "rounds": accept["rounds"], "accept_len_hist": accept["accept_len_hist"], "num_spec": args.num_spec,
            "spec": accept["spec"], "model": what, "dtype": args.dtype, "device": str(dev),
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
            "us_per_layer_call": timings, "seconds": round(time.perf_counter() - t_load, 2),
            "reference_tokens": runs[0]["tokens"], "header": header}


def print_table(result) -> None:
    print(f"{'run':44s} {'tokens':>7s} {'max |dlogit|':>13s} {'accept':>7s} {'s':>7s} {'tok/s':>8s}")
    for r in result["runs"]:
        same = "same" if r["match"] else "DIFFER"
        diff = "-" if r["max_logit_diff"] is None else f"{r['max_logit_diff']:.1e}" + ("" if r["logits_ok"] else "!")
        acc = f"{r['accept_rate']:.2f}" if "accept_rate" in r else "-"
        print(f"{r['run']:44s} {same:>7s} {diff:>13s} {acc:>7s} {r['seconds']:7.2f} {r['tokens_per_s']:8.1f}")
    show = 12
    for n, toks in enumerate(result["reference_tokens"]):
        print(f"  prompt {n}: {' '.join(f'{t:3d}' for t in toks[:show])} ...")
    print(f"match: {'YES' if result['match'] else 'NO'} (tokens identical in every run; logits of (b) and (c) "
          f"plain against (a)); chain ring accept rate {result['accept_rate']:.2f}")
    print("per KDA layer call in (c) (median µs): " + ", ".join(
        f"{op} {t['us']:.0f} ({t['calls']} calls)" for op, t in result["us_per_layer_call"].items()))
    print(f"done in {result['seconds']:.1f} s")


def main(args) -> int:
    try:
        result = run(args)
    except Exception as e:  # a missing transformers, an unreadable checkpoint: say so, exit 2
        from .integrations.transformers import IntegrationError
        if isinstance(e, (CheckpointError, IntegrationError, ImportError, OSError)):
            print(f"kdakit demo: {e}", file=sys.stderr)
            return 2
        raise
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k not in ("reference_tokens", "header")}))
    else:
        print_table(result)
    return 0 if result["match"] else 1
