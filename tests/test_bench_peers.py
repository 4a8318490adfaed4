"""`kdakit bench --peers` on the CPU: every row's calls through Triton's interpreter at tiny
sizes, sglang's kernels as the peer where its wheel is installed (tests/sglang_env.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kdakit.bench import peer_calls, peers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sglang_kernels():
    import sglang_env
    try:
        sglang_env.import_sglang_kda()
    except ImportError as err:
        pytest.skip(f"sglang 0.5.23's wheel is not importable here ({err})")
    found = peer_calls.find_peers()["sglang"]
    if not isinstance(found, dict):
        pytest.skip(f"sglang's kernels: {found}")
    return found


def _run(groups, monkeypatch, sizes=peers.CPU):
    monkeypatch.setenv("KDAKIT_BACKEND", "triton")
    lines = []
    result = peers.run(sizes, groups, progress=lines.append)
    assert len(lines) >= len(result["rows"])  # one progress line a row, besides the peers' lines
    return result


def _skip_if_the_interpreter_cannot_run_sglang(row):
    """sglang's verify kernel runs in some Triton releases' interpreters (3.9) and not in others
    (3.6: a TypeError inside the interpreter): then there is no peer to compare on the CPU."""
    cell = row["agree"].get("sglang")
    if isinstance(cell, str) and cell.startswith("error: InterpreterError"):
        import triton
        pytest.skip(f"sglang's verify kernel does not run in Triton {triton.__version__}'s interpreter: {cell}")


def _rows(result, op):
    return [r for r in result["rows"] if r["op"] == op]


def test_verify_rows_agree_with_sglang(sglang_kernels, monkeypatch):
    """sglang's target verify (snapshots, its ring write; trees through parent tokens) runs in
    the interpreter: kdakit's outputs and snapshots agree with it on every chain and the tree."""
    result = _run(("verify",), monkeypatch, dataclasses.replace(peers.CPU, chain_drafts=(3,)))
    rows = result["rows"]
    assert {r["op"] for r in rows} == {"chain_snapshot", "chain_ring", "tree_snapshot", "tree_ring"}
    for row in rows:
        assert row["kdakit"] is not None and row["agree"]["kdakit"] == 0.0
        if row["op"] != "tree_ring":
            _skip_if_the_interpreter_cannot_run_sglang(row)
        if row["op"] == "tree_ring":
            assert row["sglang"] is None and "no such mode" in row["agree"]["sglang"]
        else:
            assert isinstance(row["agree"]["sglang"], float) and row["agree"]["sglang"] < 1e-5, row
            assert row["sglang"] is not None


def test_a_disagreeing_peer_is_not_timed(sglang_kernels, monkeypatch):
    """A peer whose result differs from kdakit's is reported, never timed."""
    real = peer_calls.verify_sglang

    def wrong(fns, L, mode, parents=None):
        call = real(fns, L, mode, parents)
        return peer_calls.Call(call.run, lambda: {k: v * 1.5 for k, v in call.result().items()})
    monkeypatch.setattr(peer_calls, "verify_sglang", wrong)
    sizes = dataclasses.replace(peers.CPU, chain_drafts=(1,), tree_nodes=())
    row = _run(("verify",), monkeypatch, sizes)["rows"][0]
    _skip_if_the_interpreter_cannot_run_sglang(row)
    assert row["sglang"] is None and row["agree"]["sglang"].startswith("disagrees with kdakit")


def test_decode_rows_and_summaries(monkeypatch):
    """kdakit's decode rows run; a peer that fails is a cell saying why; the summary files
    hold one row per cell in the issues' format."""
    result = _run(("decode",), monkeypatch)
    ops = [r["op"] for r in result["rows"]]
    assert ops.count("packed_decode_fp32") == len(peers.CPU.decode_ns)
    assert ops.count("packed_decode_bf16") == len(peers.CPU.bf16_decode_ns)
    for row in result["rows"]:
        assert row["kdakit"] is not None and row["kdakit"] > 0
        for name in ("sglang", "fla"):
            assert row[name] is not None or isinstance(row["agree"][name], str)
    eager = _rows(result, "eager_host")[0]
    assert eager["kdakit_dropin"] is not None
    result["env"].update(date="2026-01-01", command="test")
    sums = peers.summaries(result)
    dec = sums["decode_vs_peers"]["rows"]
    assert {r["op"] for r in dec} == {"packed_decode_fp32", "packed_decode_bf16", "eager_host", "eager_host_dropin"}
    assert [r for r in dec if r["op"] == "eager_host_dropin"][0]["kdakit"] == eager["kdakit_dropin"]
    assert sums["extend_vs_peers"]["rows"] == []
    md = peers.markdown_lines(result)
    assert md[2].startswith("| op | case |") and len(md) == 4 + len(result["rows"])
    text = "\n".join(peers.table_lines(result))
    assert "packed_decode_fp32" in text and "eager_host" in text


@pytest.mark.exhaustive
def test_extend_rows(sglang_kernels, monkeypatch):
    """The conv (both x layouts) and chunked-prefill rows (both gates) run kdakit's kernels; the
    peers whose kernels the interpreter cannot run are cells saying so."""
    result = _run(("conv", "prefill"), monkeypatch)
    conv, prefill = _rows(result, "conv"), _rows(result, "chunk_prefill")
    assert len(conv) == 2 * len(peers.CPU.conv_cases)
    assert [r["gate"] for r in prefill] == list(peers.CPU.gates)
    for row in conv + prefill:
        assert row["kdakit"] is not None
    sums = peers.summaries(result)["extend_vs_peers"]["rows"]
    assert {(r["op"], r["gate"]) for r in sums} == {("conv", None), ("chunk_prefill", None), ("chunk_prefill", -5.0)}


def test_the_command_without_a_gpu_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kdakit", "bench", "--peers"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU" in proc.stderr and "--cpu-interpret" in proc.stderr


@pytest.mark.exhaustive
def test_the_cpu_interpret_command(tmp_path):
    """The command as CI runs it: the check, every row, the table, the JSON and the summaries."""
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, "-m", "kdakit", "bench", "--peers", "--cpu-interpret", "--json", str(out),
                           "--results", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["check"]["agree"] == result["check"]["of"] > 0
    assert {r["op"] for r in result["rows"]} >= {"packed_decode_fp32", "chain_snapshot", "tree_ring", "conv",
                                                   "chunk_prefill"}
    assert (tmp_path / "extend_vs_peers_cpu.json").exists() and (tmp_path / "decode_vs_peers_cpu.json").exists()
    assert "kdakit vs best peer" in proc.stdout


@pytest.mark.exhaustive
def test_eager_rows(monkeypatch):
    """One host-time cell for each other public op, each call run."""
    result = _run(("eager",), monkeypatch)
    assert [r["case"] for r in result["rows"]] == ["mtp_verify", "tree_verify", "fused_decode", "recurrent_forward",
                                                    "chunk_prefill", "causal_conv1d_varlen"]
    for row in result["rows"]:
        assert row["kdakit"] is not None and row["kdakit"] > 0, row
    ops = {r["op"] for r in peers.summaries(result)["decode_vs_peers"]["rows"]}
    assert "eager_host_chunk_prefill" in ops


def test_rel_in_chunks_equals_the_whole():
    """The agreement measure, computed a chunk at a time (the snapshots are several GB on a GPU),
    is the whole tensors' relative norm error; a non-finite value anywhere is inf."""
    import torch
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 1001, generator=g)
    x = y + 1e-3 * torch.randn(3, 1001, generator=g)
    whole = float((x.double() - y.double()).norm() / y.double().norm())
    assert abs(peers.rel(x, y, chunk=97) - whole) < 1e-12 * whole
    x[2, 1000] = float("nan")
    assert peers.rel(x, y, chunk=97) == float("inf")
