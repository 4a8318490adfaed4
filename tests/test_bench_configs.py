"""The benchmark scripts' built-in config sweeps parse into their op's config dataclass (on the
CPU: the scripts import without a GPU), and the shared inputs builders' shapes."""
import os
import subprocess
import sys

import pytest
import torch

from kdakit.bench import harness, inputs

from helpers import sweep

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import bench_fused_decode  # noqa: E402
import bench_mtp  # noqa: E402
import bench_packed_decode  # noqa: E402
import bench_recurrent_forward  # noqa: E402

from kdakit.ops.commit import CommitRingConfig  # noqa: E402
from kdakit.ops.fused_decode import FusedDecodeConfig  # noqa: E402
from kdakit.ops.mtp_verify import VerifyConfig, mtp_verify_config  # noqa: E402
from kdakit.ops.packed_decode import PackedDecodeConfig, packed_decode_config  # noqa: E402
from kdakit.ops.recurrent_forward import RecurrentForwardConfig  # noqa: E402
from kdakit.ops.ring_verify import RingVerifyConfig  # noqa: E402
from kdakit.ops.verify_conv import VerifyConvConfig  # noqa: E402


def count(text):
    return len([g for g in text.split(";") if g.strip()])


def test_packed_decode_sweep_is_the_old_list():
    """The old list, then the bf16-pool candidates (more state bytes per program)."""
    groups = bench_packed_decode.sweep_groups(sweep=True)
    assert len(groups) == count(bench_packed_decode.SWEEP) == 13
    for sd in (4, 2):  # the HV = 32 pools it sweeps: float32 and bfloat16 (N >= 32)
        configs = [harness.parse_configs(g, PackedDecodeConfig, base=packed_decode_config(128, 32, 128, 128, sd))[0]
                   for g in groups]
        assert configs == [PackedDecodeConfig(bv, t, w, 1, "") for bv, t, w in (
            (4, 1, 1), (4, 2, 1), (8, 1, 1), (8, 2, 1), (8, 4, 1), (16, 1, 1), (16, 2, 1),
            (16, 4, 1), (32, 1, 1), (32, 2, 1), (32, 1, 2), (64, 1, 2), (64, 1, 4))]
    assert bench_packed_decode.sweep_groups() == []


def test_recurrent_forward_sweep_is_the_old_list():
    groups = bench_recurrent_forward.config_groups(bench_recurrent_forward.SWEEP)
    base = RecurrentForwardConfig(block_v=32, num_warps=4, v_tiles=3, prefetch_tile=False, tiles_first=True)
    configs = [harness.parse_configs(g, RecurrentForwardConfig, base=base)[0] for g in groups]
    assert configs == [RecurrentForwardConfig(*c) for c in ((16, 1, 1, 1), (8, 1, 1, 1), (8, 1, 2, 0), (8, 1, 4, 0),
                                                            (4, 1, 2, 0), (4, 1, 4, 1), (8, 1, 2, 1), (8, 1, 4, 1))]


def test_fused_decode_sweeps_parse():
    bench_fused_decode.set_sweeps("one")
    assert [bench_fused_decode.one_kernel_variant(g, 8) for g in bench_fused_decode.SWEEP][-1] == FusedDecodeConfig(
        128, 1, 16)
    assert len(bench_fused_decode.SWEEP) == 10 and not bench_fused_decode.CHAIN_SWEEP
    bench_fused_decode.set_sweeps("chain")
    probe = bench_fused_decode.make_probe()
    configs = [bench_fused_decode.chain_config(part, g, probe) for part, g in bench_fused_decode.CHAIN_SWEEP]
    assert [c for c in configs if isinstance(c, PackedDecodeConfig)] == [
        PackedDecodeConfig(bv, t, 1, 1, "") for bv, t in ((2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (4, 2))]
    assert [(c.block_c, c.num_warps) for c in configs if not isinstance(c, PackedDecodeConfig)] == [
        (128, 1), (512, 4), (1024, 4), (64, 1)]
    norms = [bench_fused_decode.chain_config("norm", kw["norm"], probe) for kw in
             bench_fused_decode.CHAIN_VARIANTS.values()]
    assert [(c.rows, c.num_warps) for c in norms] == [(1, 1), (8, 4)]
    bench_fused_decode.set_sweeps()
    assert not bench_fused_decode.SWEEP and not bench_fused_decode.CHAIN_SWEEP and len(
        bench_fused_decode.CHAIN_VARIANTS) == 2


@pytest.mark.parametrize("name, config_type", [("SWEEP", VerifyConfig), ("RING_SWEEP", RingVerifyConfig),
                                               ("CONV_SWEEP", VerifyConvConfig), ("COMMIT_SWEEP", CommitRingConfig)])
def test_mtp_sweeps_parse(name, config_type):
    text = getattr(bench_mtp, name)
    assert len(bench_mtp.sweep_groups(text, config_type)) == count(text)


def test_mtp_pickers_apply_the_fields_at_each_shape():
    shapes = (64, 4, 32, 128, 128, -5.0)
    picked = mtp_verify_config(*shapes)
    ring = bench_mtp.verify_with(ring="state_block_v=32,state_warps=2", form="chunked")(*shapes)
    assert ring.ring_form == "chunked" and (ring.ring.state_block_v, ring.ring.state_warps) == (32, 2)
    assert ring.ring.steps_warps == picked.ring.steps_warps and ring.block_v == picked.block_v
    tile = bench_mtp.verify_with("block_v=16")(*shapes)
    commit = bench_mtp.commit_with(verify_group="block_v=16")(128, 128)
    assert tile.block_v == commit.block_v == 16 and commit.num_warps == tile.num_warps
    assert bench_mtp.commit_with("tiles=2,steps_ahead=1")(128, 128).tiles == 2


def test_tree_bench_ring_configs_force_the_chunk_form_with_their_fields():
    import bench_tree_verify
    from kdakit.ops import tree_verify as tree_module
    shapes = (8, 8, 32, 128, 128, -5.0)
    picked = tree_module.tree_verify_config(*shapes)
    with bench_tree_verify.ring_config("state_block_v=32,state_warps=2"):
        swept = tree_module.tree_verify_config(*shapes)
    assert tree_module.tree_verify_config(*shapes) == picked, "the picker is put back"
    assert swept.ring_form == "chunked" and (swept.ring.state_block_v, swept.ring.state_warps) == (32, 2)
    assert swept.ring.steps_warps == picked.ring.steps_warps and swept.block_v == picked.block_v
    with bench_tree_verify.ring_config(""):
        assert tree_module.tree_verify_config(1, 4, 32, 128, 128, None).ring_form == "chunked"


def test_a_wrong_field_fails_before_anything_runs():
    with pytest.raises(ValueError, match="not field=value"):
        bench_mtp.sweep_groups("k_chunk=32", CommitRingConfig)
    with pytest.raises(ValueError, match="true or false"):
        bench_recurrent_forward.config_groups("prefetch_tile=2")


@pytest.mark.parametrize("script", sweep(["bench_packed_decode", "bench_packed_decode_helion", "bench_fused_decode",
                                    "bench_mtp", "bench_recurrent_forward", "bench_launcher",
                                    "bench_tree_verify"], keep=2))
def test_scripts_parse_their_arguments_on_the_cpu(script):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(BENCH))
    done = subprocess.run([sys.executable, os.path.join(BENCH, f"{script}.py"), "--help"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout or script == "bench_launcher"


def test_inputs_builders_shapes():
    L = inputs.packed_decode_inputs(3, 2, 4, 16, 32, device="cpu", seed=1)
    assert L["mixed"].shape == (3, 2 * 2 * 16 + 4 * 32) and L["state"].shape == (6, 4, 32, 16)
    assert L["out"].shape == (3, 1, 4, 32) and len(set(L["idx"].tolist())) == 3
    L = inputs.fused_decode_inputs(3, 2, 4, 16, 32, device="cpu", transposed_conv=True)
    assert L["conv_state"].shape == (6, 2 * 2 * 16 + 4 * 32, 3) and L["conv_state"].stride(1) == 1
    L = inputs.varlen_inputs([2, 0, 3], 2, 4, 16, 32, device="cpu", slots=5)
    assert L["cu"].tolist() == [0, 2, 2, 5] and L["state"].shape[0] == 5 and L["q"].shape == (1, 5, 2, 16)
    L = inputs.mtp_verify_inputs(3, 4, 2, 4, 16, 32, conv=True, mode="ring", norm=True, ring_len=6, device="cpu")
    assert L["rings"][0].shape == (8, 2, 6, 16) and L["rings"][2].dtype == torch.float32
    assert L["intermediate_conv"][2].shape == (3, 4, 4 * 32, 3) and L["norm_gate"].shape == (3, 4, 4, 32)
    a = inputs.packed_decode_inputs(2, 1, 2, 8, 8, device="cpu", seed=3)
    b = inputs.packed_decode_inputs(2, 1, 2, 8, 8, device="cpu", seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a if k != "out")


def test_optional_fields_parse_as_numbers_or_none():
    base = RecurrentForwardConfig(16, 1, 1, True, False)
    assert harness.parse_configs("max_registers=128", RecurrentForwardConfig, base=base)[0].max_registers == 128
    capped = RecurrentForwardConfig(16, 1, 1, True, False, 128)
    assert harness.parse_configs("max_registers=none", RecurrentForwardConfig, base=capped)[0].max_registers is None
    with pytest.raises(ValueError, match="max_registers takes a number or none"):
        harness.parse_configs("max_registers=12x", RecurrentForwardConfig, base=base)


def test_recurrent_forward_register_cap_only_where_it_does_not_spill():
    from kdakit.ops.recurrent_forward import recurrent_forward_config
    assert recurrent_forward_config(8, 32, 128, 128, 128).max_registers == 128  # float32 pool, K = 128
    assert recurrent_forward_config(8, 32, 128, 128, 128, state_bytes=2).max_registers is None
    assert recurrent_forward_config(8, 32, 128, 64, 128).max_registers is None
    assert recurrent_forward_config(64, 32, 128, 128, 64).max_registers is None  # one token a sequence


def test_fused_decode_bench_calls_run_and_match_float64():
    """The benchmark's call builders at tiny sizes on the CPU (the interpreter): the op and the
    op's chain with a config group per kernel (launched plainly: the interpreter has no
    dependent launches), against float64."""
    layer = bench_fused_decode.make_layer(2, 1, 2, 16, 16, device="cpu")
    ref_out, ref_state, _ = bench_fused_decode.ref_fused(layer)
    state0, conv0 = layer["state"].clone(), layer["conv_state"].clone()
    chain = bench_fused_decode.dependent_chain_call
    calls = [bench_fused_decode.fused_call(layer), chain(layer, True, False),
             chain(layer, True, False, groups={"norm": "rows=1"}),
             chain(layer, True, False, groups={"decode": "v_tiles=1"}),
             chain(layer, True, False, groups={"conv": "num_warps=1"})]
    for call in calls:
        layer["state"].copy_(state0)
        layer["conv_state"].copy_(conv0)
        layer["out"].fill_(float("nan"))
        call()
        assert bench_fused_decode.rel(layer["out"], ref_out) < 2e-2
        assert bench_fused_decode.rel(layer["state"], ref_state) < 1e-3


def test_prefill_crossover_is_the_length_from_which_chunked_always_wins():
    import bench_prefill_crossover as bench
    rows = [{"N": 1, "L": L, "ratio": r} for L, r in ((16, 3.0), (32, 0.9), (64, 1.1), (96, 0.8), (128, 0.6))]
    rows += [{"N": 8, "L": 16, "ratio": 2.0}, {"N": 8, "L": 32, "ratio": 1.5}]
    assert bench.crossover(rows, 1) == 96  # 32 is faster but 64 is not: not yet the crossover
    assert bench.crossover(rows, 8) is None
    assert bench.crossover(rows, 64) is None


def test_gpu_check_cases_reach_the_picked_chain_forms():
    """The GPU float64 checks of the chunked prefill reach the forms they are named for: the
    picked config at each check case's shapes (the padding rows count as sequences)."""
    import bench_chunk_prefill
    from kdakit.ops.chunk_prefill import chunk_config
    forms = {name: bench_chunk_prefill.picked_form(chunk_config(len(lens), HV, 128, 128, act_dtype=act, T=sum(lens)))
             for name, lens, H, HV, act, *_ in bench_chunk_prefill.CHECK_CASES}
    assert forms["4k-H8-after-chain"] == "16-row tiles, float32 chain products, outputs after_chain, 1 piece(s)"
    assert forms["8k-H8-pieces-safe"] == "32-row tiles, bfloat16 chain products, outputs in_chain, 4 piece(s)"
    assert forms["4x-bf16-64-rows"].startswith("64-row tiles, bfloat16 chain products")
    assert forms["2k-bf16-safe"].startswith("32-row tiles, bfloat16 chain products")
    assert forms["2k-bf16"].startswith("32-row tiles, bfloat16")


@pytest.mark.parametrize("name", ["chunk_prefill-long", "chunk_prefill-pieces", "chunk_prefill-tiles",
                                  "mtp_verify-ring-chunk", "tree_verify-ring-chunk",
                                  "tree_verify-ring-chunk-post-conv"])
def test_gpu_graph_and_memcheck_cases_take_their_forms(name, monkeypatch):
    """benchmarks/gpu_compile_graph_check.py's cases for the forms picked only past a threshold
    build (on the CPU here) with the shapes that reach them: each asserts its form while it builds;
    gpu_memcheck.py pushes their indices."""
    import gpu_compile_graph_check
    import gpu_memcheck
    monkeypatch.setattr(gpu_compile_graph_check, "DEV", "cpu")
    op, args, kw = gpu_compile_graph_check.CASES[name](1)
    assert callable(op) and name in gpu_memcheck.INDEX_ARGS


@pytest.mark.parametrize("case_id,form,from_inputs", [
    ("tree_verify-ring-chunked-from-inputs-slot", "chunked", True),
    ("mtp_verify-ring-chunked-conv-row", "chunked", False),
    ("mtp_verify-ring-recurrent-slot", "recurrent", False),
], ids=["from-inputs", "chunked", "recurrent"])
def test_gpu_out_of_range_check_forces_each_cases_ring_form(case_id, form, from_inputs, monkeypatch):
    """benchmarks/gpu_out_of_range_check.py gives each case of tests/test_out_of_range.py the ring
    form its id names, in the chain's and the tree's pickers alike (as that file's fixture does)."""
    import gpu_out_of_range_check as script
    monkeypatch.setattr(script.verify_module, "mtp_verify_config", script.verify_module.mtp_verify_config)
    monkeypatch.setattr(script.tree_module, "tree_verify_config", script.tree_module.tree_verify_config)
    monkeypatch.setattr(script.fused_module, "fused_decode_config", script.fused_module.fused_decode_config)
    monkeypatch.setenv("KDAKIT_PDL", "1")
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    script.configure(case_id)
    for config in (script.verify_module.mtp_verify_config(2, 3, 4, 16, 16, None),
                   script.tree_module.tree_verify_config(2, 3, 4, 16, 16, None)):
        assert (config.ring_form, config.ring.state_from_inputs) == (form, from_inputs)
