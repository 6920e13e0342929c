"""The source tree's shape: no import cycle between modules, no module past 400 lines, and every
package says in its ``__init__`` docstring what it is for and exports only named public names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "runtime")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that ``path`` imports, at any depth (lazy imports in functions count:
    they are still a dependency), except under ``if TYPE_CHECKING``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.add(child.module)
                found.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules}


def test_no_import_cycle_between_modules() -> None:
    modules = _modules()
    # Package __init__ files only re-export; a module importing its own package's names would
    # make every package a cycle, so edges into a package __init__ are not followed.
    graph = {m: {d for d in _imports(p, modules) if modules[d].name != "__init__.py"}
             for m, p in modules.items() if p.name != "__init__.py"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)


def test_no_module_is_longer_than_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_package_says_what_it_is_for() -> None:
    for pkg in PACKAGES:
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            tree = ast.parse(init.read_text())
            assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} has no docstring"
            names = [t.id for node in tree.body if isinstance(node, ast.Assign)
                     for t in node.targets if isinstance(t, ast.Name)]
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
