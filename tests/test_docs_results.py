"""benchmarks/results/ holds exactly the result files the documentation cites.

The citing documents are README.md and docs/*.md. A citation is either a
path under benchmarks/results/ (a link target such as ``../benchmarks/results/foo_h200.json``, or
``results/foo.json``) or a bare file name such as ``foo_h200.json``.
A bare name counts as a result-file citation when it names a file in the folder, or when it
looks like one (a ``_h100`` / ``_h200`` tag in its stem, ``.json``/``.log``/``.png``/``.txt``):
other file names the docs mention (``pyproject.toml``, ``kdakit_bench.json`` written by
``kdakit bench`` into ``--out``) are not citations, nor is a glob (``*_recheck_h200.json``). The test fails when a cited file is missing
from the folder, and when a file in the folder is cited nowhere.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# a file name: word characters, dots and dashes, with one of the result extensions
NAME = r"[\w.-]+\.(?:json|log|png|txt|md)"
# a path that goes through benchmarks/results/ (or results/)
RESULT_PATH = re.compile(r"(?:^|[\s(`'\"/\[])(?:benchmarks/)?results/(" + NAME + r")")
BARE_NAME = re.compile(r"(?<![\w./*-])(" + NAME + r")(?![\w-])")
# what an uncommitted-but-cited result name looks like: a GPU tag in the stem
GPU_TAG = re.compile(r"_h(?:100|200)(?:_[\w-]+)?\.(?:json|log|png|txt)$|_h(?:100|200)_")


def citing_documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in docs if p.is_file()]


def result_files() -> set[str]:
    return {p.name for p in RESULTS.iterdir() if p.is_file() and not p.name.startswith(".")}


def cited_names(text: str, present: set[str]) -> set[str]:
    """The result-file names ``text`` cites (see the module doc)."""
    cited = set(RESULT_PATH.findall(text))
    for name in BARE_NAME.findall(text):
        name = name.rstrip(".")
        if name in present or GPU_TAG.search(name):
            cited.add(name)
    return cited


def citations() -> dict[str, set[str]]:
    """{file name: the documents (relative paths) that cite it}."""
    present = result_files()
    where: dict[str, set[str]] = {}
    for doc in citing_documents():
        for name in cited_names(doc.read_text(encoding="utf-8"), present):
            where.setdefault(name, set()).add(str(doc.relative_to(ROOT)))
    return where


def test_the_scan_tells_result_files_from_other_names():
    present = {"mtp_h200_chunked.json", "foo_h200.json"}
    text = ("see `foo_h200.json`, [x](../benchmarks/results/bar.log), results/baz_h100.json, "
            "mtp_h200_chunked.json and new_h100_quick.json; not pyproject.toml, kdakit_bench.json, "
            "README.md, docs/tuning.md or the glob recurrent_forward_ab_*_h200.json")
    assert cited_names(text, present) == {"foo_h200.json", "bar.log", "baz_h100.json",
                                          "mtp_h200_chunked.json", "new_h100_quick.json"}


def test_every_cited_result_file_exists():
    present = result_files()
    missing = {name: sorted(docs) for name, docs in citations().items() if name not in present}
    assert not missing, f"cited but not in benchmarks/results/: {missing}"


def test_every_result_file_is_cited():
    cited = set(citations())
    uncited = sorted(result_files() - cited)
    assert not uncited, (f"in benchmarks/results/ but cited nowhere in README.md or docs/*.md "
                         f"(git rm them, or cite them): {uncited}")
