"""transformers' Kimi Linear end to end: its KDA layers on fla-core 0.6.0 (what transformers binds
when fla is installed) against the same model after ``kdakit.integrations.transformers.enable()``,
in the same run on one GPU, on the transformers release installed (5.17-5.23; the record names it
and the layer's form).

Model: ``KimiLinearForCausalLM`` with random weights, hidden 2304, H = 32, K = V = 128, 4 layers (all
KDA, dense MLPs, so the time is the KDA layers' and the MLPs'), bf16. Cases: prefill of 1 x 8192
tokens (one forward with a cache, ms, tokens/s), and greedy decode of 256 tokens at batch 1 and 32
after a 64-token prompt (ms per step, tokens/s). Before timing, both paths' prefill logits and decode
tokens are compared (max |dlogit|, share of identical tokens). JSON (GPU name, date, command, rows)
to $OUT or benchmarks/results/.

    python benchmarks/bench_transformers.py            # the full run
    python benchmarks/bench_transformers.py --quick    # prefill 2k, decode 32 steps
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2304)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mla-every", type=int, default=0, help="make every n-th layer MLA (0: all KDA)")
    p.add_argument("--intermediate", type=int, default=2304, help="dense MLP width")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prefill", type=int, default=8192, help="prefill tokens (batch 1)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens before the decode cases")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--batches", default="1,32", help="decode batch sizes")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--reps", type=int, default=5, help="timed prefill repetitions (median)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--name", default="transformers_kimi_linear")
    args = p.parse_args(argv)
    if args.quick:
        args.prefill, args.decode_tokens, args.reps = 2048, 32, 3
    args.batch_sizes = [int(b) for b in args.batches.split(",") if b]
    if args.hidden < 1 or args.heads < 1 or args.head_dim < 1 or args.layers < 1 or not args.batch_sizes:
        p.error("--hidden, --heads, --head-dim, --layers and --batches must be positive")
    return args


def config_kwargs(args) -> dict:
    types = ["full_attention" if args.mla_every and (i + 1) % args.mla_every == 0 else "linear_attention"
             for i in range(args.layers)]
    heads = max(1, args.hidden // 128)
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                moe_intermediate_size=args.intermediate, num_hidden_layers=args.layers, layer_types=types,
                mlp_layer_types=["dense"] * args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                kv_lora_rank=min(512, args.hidden), q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
                v_head_dim=128, linear_num_heads=args.heads, linear_head_dim=args.head_dim, linear_conv_kernel_dim=4,
                num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02)


def build_model(args, device="cuda", seed=0):
    from kdakit.integrations import transformers as kt
    kt.kimi_linear_module()
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(seed)
    with torch.device(device):
        model = KimiLinearForCausalLM(KimiLinearConfig(**config_kwargs(args)))
    return model.eval().to(dtype)


def bound_implementations() -> dict:
    """What transformers bound to the four names (fla / causal_conv1d functions, or its torch bodies)."""
    from kdakit.integrations import transformers as kt
    kl = kt.kimi_linear_module()
    out = {}
    for name in kt.REPLACED:
        fn = getattr(kl, name)
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if callable(c.cell_contents)]
        impl = next((c for c in cells if getattr(c, "__module__", "").startswith(("fla", "causal_conv1d"))), fn)
        out[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', type(impl).__name__)}"
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def prefill(model, ids):
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float(), cache


@torch.no_grad()
def decode(model, prompt_ids, steps):
    logits, cache = prefill(model, prompt_ids)
    nxt = logits.argmax(-1)
    tokens = [nxt]
    sync()
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        nxt = logits.argmax(-1)
        tokens.append(nxt)
    sync()
    return torch.stack(tokens, 1), (time.perf_counter() - t0) / max(steps - 1, 1)


def time_prefill(model, ids, reps):
    prefill(model, ids)  # warm-up: autotuning, compiles
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        prefill(model, ids)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_transformers: needs a CUDA GPU (fla's kernels and kdakit's Triton kernels)", file=sys.stderr)
        return 2
    from kdakit.bench import harness
    from kdakit.integrations import transformers as kt
    kt.disable()
    import transformers
    results = harness.new_results(transformers=transformers.__version__, kimi_linear_form=kt.layer_form(),
                                  transformers_bound=bound_implementations(), args=vars(args))
    model = build_model(args)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(3, args.vocab, (1, args.prefill), device="cuda", generator=gen)
    prompts = {B: torch.randint(3, args.vocab, (B, args.prompt), device="cuda", generator=gen) for B in args.batch_sizes}
    paths = {"fla (transformers as bound)": kt.disable, "kdakit (enable())": kt.enable}
    outputs = {}
    for path, switch in paths.items():
        switch()
        logits, _ = prefill(model, ids)
        toks = {B: decode(model, p, min(args.decode_tokens, 32))[0] for B, p in prompts.items()}
        outputs[path] = (logits, toks)
        t = time_prefill(model, ids, args.reps)
        results["rows"].append({"path": path, "case": f"prefill 1x{args.prefill}", "ms": round(t * 1e3, 3),
                                "tokens_per_s": round(args.prefill / t, 1)})
        for B, p in prompts.items():
            _, step = decode(model, p, args.decode_tokens)
            results["rows"].append({"path": path, "case": f"decode B={B} x {args.decode_tokens}",
                                    "ms": round(step * 1e3, 4), "tokens_per_s": round(B / step, 1)})
    kt.disable()
    (la, ta), (lb, tb) = outputs.values()
    results["checks"].append({"prefill_max_abs_logit_diff": float((la - lb).abs().max()),
                              "prefill_logit_scale": float(la.abs().max()),
                              **{f"decode_B{B}_same_tokens": float((ta[B] == tb[B]).float().mean()) for B in ta}})
    harness.close_results(results)
    path = harness.save(results, args.name + ("_quick" if args.quick else ""), harness.results_folder(__file__))
    harness.print_table(results["rows"], ["path", "case", "ms", "tokens_per_s"])
    print(results["checks"][0])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
