"""The import graph runs one way, with no circle: the layer, the state pool, the drop-ins and the
CLI sit above the ops; the ops (``kdakit/ops/`` and its subpackages) import only each other and the
modules below them (``backends``, ``buffers``, ``contracts``, ``errors``, ``reference``,
``error_layout``), which import only each other and nothing of ``kdakit.ops``; the op registry
imports nothing of kdakit but ``error_layout``, the bottom (the ops that count errors, which the
registry declares there and ``errors`` reads from there), which imports nothing of kdakit. No
module of kdakit reaches itself through its imports. Checked on the source (every import
statement, function-level ones included: a circle closed by one still fails)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "kdakit"
BOTTOM = "kdakit.error_layout"
BELOW_OPS = {"kdakit.backends", "kdakit.buffers", "kdakit.contracts", "kdakit.errors", "kdakit.reference", BOTTOM}
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
    allowed = BELOW_OPS if path in LOW_MODULES else BELOW_OPS | {module_name(p) for p in OP_MODULES} | {"kdakit.ops"}
    upward = kdakit_imports(path) - allowed
    assert not upward, f"{module_name(path)} imports {sorted(upward)}, above it"


def test_registry_imports_only_the_bottom():
    assert kdakit_imports(ROOT / "ops" / "registry.py") <= {BOTTOM}
    assert kdakit_imports(ROOT / "error_layout.py") == set()


def test_errors_imports_nothing_of_the_ops():
    """``kdakit.errors`` sits below the ops: their registry included, it imports none of them."""
    ops = {name for name in kdakit_imports(ROOT / "errors.py") if name == "kdakit.ops" or name.startswith("kdakit.ops.")}
    assert not ops, f"kdakit.errors imports {sorted(ops)}, above it"


ALL_MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the kdakit modules it imports, over every module of kdakit."""
    return {name: kdakit_imports(path) & set(ALL_MODULES) for name, path in ALL_MODULES.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected components of more than one module, and
    the modules that import themselves (Tarjan's algorithm, iterative), each sorted."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        found.append(sorted(component))
    return found


def test_no_import_circle():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a] & set(c))) + ")"
        for c in found)


def test_the_circle_finder_finds_circles():
    """It can fail: circles of two, of three (closed far from where the search starts) and a
    module importing itself are found, a one-way graph with shared bottoms is not."""
    assert circles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c", "d"}, "c": {"d"}, "d": {"b"}, "e": {"a"}}) == [["b", "c", "d"]]
    assert circles({"a": {"a"}}) == [["a"]]
    assert circles({"top": {"left", "right"}, "left": {"bottom"}, "right": {"bottom", "left"}, "bottom": set()}) == []


def test_the_checker_sees_imports():
    """The parser resolves relative imports (else the test above would pass vacuously)."""
    assert {"kdakit.contracts", "kdakit.backends", "kdakit.ops.registry"} <= kdakit_imports(
        ROOT / "ops" / "packed_decode.py")
    assert {"kdakit.buffers", BOTTOM} <= kdakit_imports(ROOT / "errors.py")
    assert BOTTOM in kdakit_imports(ROOT / "ops" / "registry.py")
    assert "kdakit.demo_hf" in kdakit_imports(ROOT / "demo.py")  # a function-level import
    assert "kdakit.bench.plotting" in kdakit_imports(ROOT / "bench" / "prefill.py")
    assert "kdakit.ops.commit" in kdakit_imports(ROOT / "layer.py")
    assert {"kdakit.errors", "kdakit.ops.launch", "kdakit.ops.chunk_prefill.prep"} <= kdakit_imports(
        ROOT / "ops" / "chunk_prefill" / "run.py")
    assert "kdakit.ops.chunk_prefill.op" in kdakit_imports(ROOT / "ops" / "chunk_prefill" / "__init__.py")
