"""The source tree's shape: no import cycle between modules (anywhere in the tree, type-only
imports included), the Megatron adapter's layers importing only downwards, no module past 400
lines, and every package says in its ``__init__`` docstring what it is for and exports only
named public names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "runtime")
TREE = (*PACKAGES, "tests", "bench", "scripts")
"""Where the cycle test looks: every Python file of the repository's own."""
MAX_LINES = 400


def _modules(roots: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in roots:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that ``path`` imports, at any depth: lazy imports in functions and
    imports under ``if TYPE_CHECKING`` count too (both are still a dependency: a type-only
    cycle is a cycle a reader has to untangle, and the first refactor that needs the name at
    run time turns it into an ImportError)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m in modules}


def _graph(roots: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules it imports. Package ``__init__`` files only re-export; a module
    importing its own package's names would make every package a cycle, so edges into a
    package ``__init__`` are not followed (a package is not a module of its own here)."""
    modules = _modules(roots)
    return {m: {d for d in _imports(p, modules) if modules[d].name != "__init__.py"}
            for m, p in modules.items() if p.name != "__init__.py"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One named cycle per strongly connected set of modules (Tarjan), shortest found first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for d in sorted(graph.get(m, ())):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on_stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                x = stack.pop()
                on_stack.discard(x)
                component.append(x)
                if x == m:
                    break
            if len(component) > 1 or m in graph.get(m, ()):
                components.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return [_cycle_through(graph, c) for c in components]


def _cycle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    inside = set(component)
    start = component[0]
    paths = {d: [start, d] for d in sorted(graph[start]) if d in inside}
    frontier = list(paths)
    while start not in paths:
        nxt = []
        for m in frontier:
            for d in sorted(graph[m]):
                if d in inside and d not in paths:
                    paths[d] = [*paths[m], d]
                    nxt.append(d)
        frontier = nxt
    return paths[start]


def test_no_import_cycle_anywhere_in_the_tree() -> None:
    cycles = _cycles(_graph(TREE))
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_names_a_cycle() -> None:
    # The finder itself on a known graph: a type-only import closing a circle is one.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\n")
    assert any(isinstance(n, ast.Import) for n in ast.walk(tree))


MEGATRON = "runtime.adapters.megatron"
LAYERS = ("compat", "binding", "model", "parallel", "job", "trainer")
"""The Megatron adapter's layers, lowest first: each imports only from layers before it (and
``model`` may use ``binding``'s MTP build helpers); nothing outside the adapter but its
``__init__`` and the ``--framework`` table reaches into ``trainer``."""


def _layer(module: str) -> str | None:
    if not module.startswith(MEGATRON + "."):
        return None
    return module[len(MEGATRON) + 1:].split(".")[0]


def test_the_megatron_adapter_imports_only_downwards() -> None:
    graph = _graph(TREE)
    upward = []
    for m, deps in sorted(graph.items()):
        layer = _layer(m)
        if layer is None:
            continue
        for d in sorted(deps):
            other = _layer(d)
            if other is not None and LAYERS.index(other) > LAYERS.index(layer):
                upward.append(f"{m} -> {d}")
    assert upward == []


def test_no_module_is_longer_than_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules(TREE).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_package_says_what_it_is_for() -> None:
    for pkg in PACKAGES:
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            tree = ast.parse(init.read_text())
            assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} has no docstring"
            names = [t.id for node in tree.body if isinstance(node, ast.Assign)
                     for t in node.targets if isinstance(t, ast.Name)]
            names += [node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)
                      and isinstance(node.target, ast.Name)]
            assert "__all__" in names, f"{init.relative_to(ROOT)} exports no __all__"


def test_the_readme_public_names_stay() -> None:
    import planner
    import runtime

    for name in ("read_plan", "make_plan", "write_plan", "validate", "PlanHeader"):
        assert callable(getattr(planner, name)) or isinstance(getattr(planner, name), type)
    for name in ("PlanReader", "open_token_source", "Topology", "GroupCatalog", "Replayer",
                 "MicrobatchInputs", "zigzag_indices", "contiguous_indices"):
        assert getattr(runtime, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = runtime.nope  # type: ignore[attr-defined]


@pytest.mark.parametrize("module", ["runtime.train", "runtime.calibrate", "planner.cli"])
def test_entry_points_run_as_modules(module: str) -> None:
    import subprocess
    import sys

    code = f"import runpy, sys; sys.argv = ['x', '--help']; runpy.run_module('{module}', " \
           "run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_every_test_file_is_collected() -> None:
    """pytest skips some folder names by default (dist/, build/): no test file may go unseen."""
    import subprocess
    import sys

    # tests/collected_files.py: the same walk of the folders, without importing every module.
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "",
                          "-p", "no:cacheprovider", "-p", "tests.collected_files", "tests"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 5, out.stdout + out.stderr  # 5: no tests (none was imported)
    collected = {line.split(": ", 1)[1] for line in out.stdout.splitlines()
                 if line.startswith("collected-file: ")}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    assert collected, out.stdout
    assert files - collected == set()
