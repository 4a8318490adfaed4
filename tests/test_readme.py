"""Every command and code block the README shows is run here or by CI (``.ci/run``).

Each line of the README's ``bash`` blocks must be one this file knows how it is covered
(``COVERED`` below): a new command in the README fails ``test_every_readme_command_is_covered``
until it is added there, with the test or CI step that runs it. The ``python`` blocks run here:
the direct-use example as written (on the CPU it takes the PyTorch reference), the transformers
example with a tiny model and a prompt standing in for the reader's ``model`` and ``inputs``.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands():
    """The lines of the ``bash`` blocks, and the ``python -m ...`` commands quoted in the prose."""
    lines = []
    for block in blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command:
                lines.append(command)
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    lines += [c for c in re.findall(r"`(python -m [^`]+)`", prose) if c not in lines]
    return lines


def extras():
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _kdakit_exits_2_without_a_gpu(*args):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the command would run the benchmark")
    done = subprocess.run([sys.executable, "-m", "kdakit", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr


def _ci_runs(text):
    def check():
        assert text in CI, f"CI (.ci/run) no longer runs `{text}`"
    return check


def _extra_exists(name):
    def check():
        assert name in extras(), f"pyproject.toml has no extra [{name}]"
    return check


def _plugin_entry_point():
    names = {ep.name: ep.value for ep in metadata.entry_points(group="sglang.srt.plugins")}
    assert names.get("kdakit") == "kdakit.integrations.sglang:register", names


def _vllm_entry_point():
    names = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("kdakit") == "kdakit.integrations.vllm:register", names


def _vllm_switch():
    from kdakit.integrations import vllm as integ
    assert integ.SWITCH_ENV == "KDAKIT_VLLM" and "0" in integ.OFF_VALUES


# command -> how it is covered (a check run here)
COVERED = {
    # the quick start: CI runs the same install, the demo and the README's test command
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test,transformers]" '
    '&& python -m kdakit demo': lambda: (_ci_runs("pip install -q torch==2.13.0")(),
                                         _ci_runs("pip install -q -e \".[test,helion,transformers]\"")(),
                                         _ci_runs("python -m kdakit demo")()),
    "python -m pytest -q -n 2 tests": _ci_runs("python -m pytest -q -n 2 tests\n"),
    "python -m pytest -q -n 2 tests --exhaustive": _ci_runs("python -m pytest -q -n 2 tests --exhaustive"),
    "pip install .": _ci_runs("python -m build"),  # CI builds the wheel and installs it in a fresh venv
    'pip install ".[sglang]"': _extra_exists("sglang"),
    'pip install ".[transformers]"': _extra_exists("transformers"),
    'pip install ".[vllm]"': lambda: (_extra_exists("vllm")(), _vllm_entry_point()),
    "export KDAKIT_VLLM=0": _vllm_switch,
    'pip install ".[test]"': _extra_exists("test"),
    "python -m kdakit check": _ci_runs("python -m kdakit check"),
    "python -m kdakit bench": lambda: _kdakit_exits_2_without_a_gpu("bench", "--quick"),
    "python -m kdakit bench --prefill": lambda: _kdakit_exits_2_without_a_gpu("bench", "--prefill", "--quick"),
    "python -m kdakit bench --peers": lambda: _kdakit_exits_2_without_a_gpu("bench", "--peers", "--quick"),
    "python -m kdakit bench --peers --cpu-interpret": _ci_runs("python -m kdakit bench --peers --cpu-interpret"),
    "export SGLANG_PLUGINS=kdakit": _plugin_entry_point,
}


def test_every_readme_command_is_covered():
    unknown = [c for c in commands() if c not in COVERED]
    assert not unknown, f"README commands no test or CI step covers (add them to COVERED): {unknown}"
    assert len(commands()) >= 8


@pytest.mark.parametrize("command", sorted(COVERED))
def test_readme_command(command):
    assert command in commands(), f"COVERED names a command the README no longer shows: {command}"
    COVERED[command]()


def test_the_direct_use_example_runs():
    (code,) = [b for b in blocks("python") if "kdakit.packed_decode(" in b]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102  (the README's own example)
    out = namespace["out"]
    assert out.shape == (8, 1, 32, 128) and torch.isfinite(out.float()).all()
    assert float(namespace["state"].abs().sum()) > 0  # the pool was updated


def test_the_transformers_example_runs():
    pytest.importorskip("transformers")
    from kdakit.integrations import transformers as kdakit_hf
    (code,) = [b for b in blocks("python") if "kdakit_hf.enable()" in b]
    model = kdakit_hf.tiny_model()
    inputs = {"input_ids": torch.tensor([[5, 17, 42, 7]]), "max_new_tokens": 3, "do_sample": False}
    namespace = {"model": model, "inputs": inputs}
    try:
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    finally:
        kdakit_hf.disable() if kdakit_hf.is_enabled() else None
    assert namespace["out"].shape == (1, 7)
    with kdakit_hf.torch_fallback():  # transformers' PyTorch bodies (its fla binding cannot run on a CPU)
        assert torch.equal(namespace["out"], model.generate(**inputs))
