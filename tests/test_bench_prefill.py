"""`kdakit bench --prefill` on a machine without a GPU: its plan, its inputs and its plot."""

import pytest
import torch

from kdakit.__main__ import main
from kdakit.bench import prefill


def test_prefill_bench_without_gpu_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["bench", "--prefill", "--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_cases_parse_and_reject_unknown_names():
    assert prefill.parse_cases(None, quick=True) == ["1x2k", "8x2k"]
    assert prefill.parse_cases(None) == list(prefill.CASES)
    assert prefill.parse_cases(" 64x512,1x32k-H8 ") == ["64x512", "1x32k-H8"]
    with pytest.raises(ValueError, match="unknown prefill case"):
        prefill.parse_cases("1x2k,2x3k")


def test_layer_inputs_match_the_case():
    L = prefill.make_layer([5, 1, 9], 2, 4, 16, 32, device="cpu", seed=1)
    assert L["q"].shape == (1, 15, 2, 16) and L["v"].shape == (1, 15, 4, 32) and L["g"].shape == (1, 15, 4, 16)
    assert L["cu"].tolist() == [0, 5, 6, 15] and L["state"].shape == (8, 4, 32, 16)
    assert len(set(L["idx"].tolist())) == 3 and all(0 <= s < 8 for s in L["idx"].tolist())
    steep = prefill.make_layer([5], 1, 1, 16, 16, device="cpu", steep=True, seed=1)
    assert bool((steep["g"][..., :2] >= 6).all()), "steep channels take raw gates of 6 + 2|x|"
    assert prefill.flops_per_token_head(128, 128) == 2 * (4 * 64 * 128 + 3 * 128 * 128)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"name": n, "case": c, "gate": "softplus", "tokens_per_s": t}
            for n, c, t in (("kdakit", "1x2k", 2.5e6), ("fla", "1x2k", 6.2e6), ("kdakit", "8x2k", 2.6e6))]
    path = prefill.plot({"rows": rows, "env": {"gpu": "test"}}, str(tmp_path / "p.png"))
    assert path and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
