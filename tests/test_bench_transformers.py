"""benchmarks/bench_transformers.py's CPU side: its arguments and its model at a tiny size
(the timed run needs a GPU)."""
import importlib.util
import pathlib

import pytest
import torch

pytest.importorskip("transformers")
PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_transformers.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_transformers", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_defaults_are_the_issue_sizes():
    args = load().parse_args([])
    assert (args.hidden, args.heads, args.head_dim, args.layers) == (2304, 32, 128, 4)
    assert (args.prefill, args.decode_tokens, args.batch_sizes, args.dtype) == (8192, 256, [1, 32], "bfloat16")


def test_tiny_model_builds_and_runs_on_cpu():
    from kdakit.integrations import transformers as kt
    bench = load()
    args = bench.parse_args(["--hidden", "64", "--heads", "2", "--head-dim", "16", "--layers", "2", "--vocab", "64",
                             "--intermediate", "32", "--dtype", "float32", "--mla-every", "2"])
    model = bench.build_model(args, device="cpu")
    cfg = model.config
    assert cfg.layer_types == ["linear_attention", "full_attention"]
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size) == (2, 16, 64)
    ids = torch.randint(3, 64, (2, 6))
    with kt.enabled():
        tokens, _ = bench.decode(model, ids, 3)
    with kt.torch_fallback():
        ref, _ = bench.decode(model, ids, 3)
    assert torch.equal(tokens, ref)
    assert set(bench.bound_implementations()) == set(kt.REPLACED)
