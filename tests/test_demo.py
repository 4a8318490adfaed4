"""`kdakit demo` on the CPU: transformers' Kimi Linear as is, with enable(), and served by
kdakit (plain and speculative) give the same tokens; `--toy`: kdakit's own model, plain and
speculative decoding give the same tokens."""
import json
import time

import pytest

from kdakit.__main__ import main
from kdakit.layer import KDALayer


@pytest.mark.parametrize("spec", ["ring", "snapshot"])
def test_demo_json_matches(capsys, spec):
    t0 = time.perf_counter()
    rc = main(["demo", "--toy", "--json", "--quiet", "--spec", spec])
    elapsed = time.perf_counter() - t0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and result["match"] is True
    assert 0 < result["accept_rate"] < 1
    assert result["tokens"] > 0 and result["spec"] == spec
    assert len([c for c in result["accept_len_hist"] if c]) > 1, "accept lengths must vary"
    assert set(result["us_per_layer_call"]) == {"prefill", "decode", "verify", "commit"}
    assert elapsed < 30


def test_demo_reports_a_mismatch(capsys, monkeypatch):
    monkeypatch.setattr(KDALayer, "commit", lambda self, *a, **k: None)  # a commit that keeps nothing
    rc = main(["demo", "--toy", "--json", "--quiet", "--new-tokens", "12", "--batch", "1"])
    assert rc == 1 and json.loads(capsys.readouterr().out.strip())["match"] is False


def test_bench_without_gpu_exits_2(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["bench"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["tree", "tree-ring"])
def test_demo_tree_matches(capsys, monkeypatch, spec):
    """`kdakit demo --spec tree|tree-ring`: top-2 draft trees through tree_verify and the commit
    of the accepted node (its snapshot, or a ring fold of its path) give plain decoding's
    tokens; accepted paths end in both branches."""
    from kdakit import demo
    seen = []
    commit_node = demo.TinyKDAModel.commit_node
    monkeypatch.setattr(demo.TinyKDAModel, "commit_node",
                        lambda self, slots, rows, nodes, *paths: (seen.extend(nodes.tolist()),
                                                                  commit_node(self, slots, rows, nodes, *paths))[1])
    rc = main(["demo", "--toy", "--json", "--quiet", "--spec", spec])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and result["match"] is True and result["spec"] == spec
    assert len([c for c in result["accept_len_hist"] if c]) > 1, "accept lengths must vary"
    assert any(n > 0 and n % 2 == 1 for n in seen) and any(n > 0 and n % 2 == 0 for n in seen), \
        "accepted nodes in the expanded (odd) and the second (even) branches"
    assert set(result["us_per_layer_call"]) == {"prefill", "decode", "verify", "commit"}


def test_transformers_demo_json_matches(capsys):
    pytest.importorskip("transformers")
    t0 = time.perf_counter()
    rc = main(["demo", "--json", "--quiet", "--new-tokens", "12"])
    elapsed = time.perf_counter() - t0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and result["match"] is True
    runs = {r["run"].split(" (")[0] if r["run"].startswith("(a)") else r["run"]: r for r in result["runs"]}
    assert len(result["runs"]) == 7 and all(r["match"] and r["logits_ok"] for r in result["runs"])
    assert result["runs"][1]["max_logit_diff"] < 1e-4 and result["runs"][2]["max_logit_diff"] < 1e-4
    assert 0 < result["accept_rate"] < 1 and result["tokens"] == 3 * 12 and result["rounds"] > 0
    assert {"prefill", "decode", "verify", "commit"} <= set(result["us_per_layer_call"])
    assert elapsed < 40


def test_transformers_demo_reports_a_mismatch(capsys, monkeypatch):
    """A commit that keeps nothing in the served KDA layers: the speculative runs diverge."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(KDALayer, "commit", lambda self, *a, **k: None)
    rc = main(["demo", "--json", "--quiet", "--new-tokens", "8", "--batch", "1"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and result["match"] is False
    assert [r["match"] for r in result["runs"]][:3] == [True, True, True]
