"""The import graph runs one way: the layer, the state pool, the drop-ins and the CLI sit
above the ops; the ops (``kdakit/ops/`` and its subpackages) import only each other and the modules below them
(``backends``, ``buffers``, ``contracts``, ``errors``, ``reference``), which import only each
other and the op registry; the op registry imports nothing of kdakit (so ``errors`` can read
the ops that count errors from it without importing any op). Checked on the source (every import statement, function-level ones included)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "kdakit"
BELOW_OPS = {"kdakit.backends", "kdakit.buffers", "kdakit.contracts", "kdakit.errors", "kdakit.reference"}
REGISTRY = "kdakit.ops.registry"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kdakit_imports(path: pathlib.Path) -> set[str]:
    """The kdakit modules ``path`` imports (``from pkg import name`` counts as ``pkg.name``
    when that is a module, else as ``pkg``)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    ROOT.parent / sub.replace(".", "/") / "__init__.py").exists()
                found.add(sub if is_module else base)
    return {name for name in found if name == "kdakit" or name.startswith("kdakit.")}


OP_MODULES = sorted((ROOT / "ops").rglob("*.py"))
LOW_MODULES = [ROOT / f"{name.rpartition('.')[2]}.py" for name in sorted(BELOW_OPS)]


@pytest.mark.parametrize("path", OP_MODULES + LOW_MODULES, ids=lambda p: module_name(p))
def test_no_import_runs_back_up(path):
    allowed = BELOW_OPS | {REGISTRY} if path in LOW_MODULES else BELOW_OPS | {module_name(p) for p in OP_MODULES} | {"kdakit.ops"}
    upward = kdakit_imports(path) - allowed
    assert not upward, f"{module_name(path)} imports {sorted(upward)}, above it"


def test_registry_imports_nothing_of_kdakit():
    assert kdakit_imports(ROOT / "ops" / "registry.py") == set()


def test_the_checker_sees_imports():
    """The parser resolves relative imports (else the test above would pass vacuously)."""
    assert {"kdakit.contracts", "kdakit.backends", "kdakit.ops.registry"} <= kdakit_imports(
        ROOT / "ops" / "packed_decode.py")
    assert {"kdakit.buffers", REGISTRY} <= kdakit_imports(ROOT / "errors.py")
    assert "kdakit.ops.commit" in kdakit_imports(ROOT / "layer.py")
    assert {"kdakit.errors", "kdakit.ops.launch", "kdakit.ops.chunk_prefill.prep"} <= kdakit_imports(
        ROOT / "ops" / "chunk_prefill" / "run.py")
    assert "kdakit.ops.chunk_prefill.op" in kdakit_imports(ROOT / "ops" / "chunk_prefill" / "__init__.py")
