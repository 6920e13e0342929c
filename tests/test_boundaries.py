"""Module boundaries, checked in fresh interpreters: the planner never loads torch, the runtime
never loads ortools, and Transformer Engine is imported by one module only."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@functools.cache  # two tests ask about the same interpreter: it is started once
def _loaded(code: str) -> frozenset[str]:
    script = code + "\nimport sys\nprint(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return frozenset(out.split())


# Every planner module, planner.solver.ray_engine included.
EVERY_PLANNER_MODULE = ("import importlib, pkgutil, planner\n"
                        "for m in pkgutil.walk_packages(planner.__path__, 'planner.'):\n"
                        "    if not m.name.endswith('__main__'):\n"
                        "        importlib.import_module(m.name)")


def test_planner_does_not_import_torch() -> None:
    assert "torch" not in _loaded(EVERY_PLANNER_MODULE)


def test_ray_loads_only_for_the_ray_engine() -> None:
    # Ray is imported when the engine runs, never at import (a plain `dcp-plan` must not pay
    # for it, or need it installed).
    mods = _loaded(EVERY_PLANNER_MODULE)
    assert "planner.solver.ray_engine" in mods
    assert "ray" not in mods


def test_runtime_does_not_import_ortools() -> None:
    # Every runtime module but the framework adapters (each imports its own framework), the
    # Transformer Engine module and the ``__main__`` entry points (they run the command).
    mods = _loaded("import importlib, pkgutil, runtime\n"
                   "skip = ('runtime.adapters.', 'runtime.attention.te', '__main__')\n"
                   "for m in pkgutil.walk_packages(runtime.__path__, 'runtime.'):\n"
                   "    if not any(s in m.name for s in skip):\n"
                   "        importlib.import_module(m.name)")
    assert "ortools" not in mods
    assert not any(m.startswith("transformer_engine") for m in mods)



def _runtime_imports_of_planner_cli() -> set[str]:
    """The ``planner.cli`` modules that runtime/ imports, at any depth (an AST walk)."""
    import ast

    found: set[str] = set()
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "planner.cli":
                found.update(f"planner.cli.{a.name}" for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.startswith("planner.cli."):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("planner.cli"))
    return found


def test_the_runtime_loads_no_solver_through_planner_cli() -> None:
    # dcp-train and dcp-calibrate share dcp-plan's command-line conventions, progress bars and
    # input list (planner.cli.args, .progress, .guard); importing them, or the package, must
    # not load the planning stack: `dcp-train --version` would pay for numba, every rank for
    # the solver.
    used = _runtime_imports_of_planner_cli()
    assert {"planner.cli.args", "planner.cli.progress", "planner.cli.guard"} <= used
    heavy = ("numba", "ortools", "pyarrow", "numpy", "torch", "planner.solver", "planner.plan",
             "planner.cost", "planner.config")
    for module in sorted(used | {"planner.cli"}):
        mods = _loaded(f"import {module}")
        loaded = [h for h in heavy if any(m == h or m.startswith(h + ".") for m in mods)]
        assert loaded == [], f"import {module} loads {loaded}"

def test_third_party_imports_stay_in_one_module_each() -> None:
    ortools, te, titan, ray, mcore, mlm, hf = [], [], [], [], [], [], []
    for path in sorted((ROOT / "planner").rglob("*.py")) + sorted((ROOT / "runtime").rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT).as_posix()
        if re.search(r"^\s*(from|import) ortools", text, re.M):
            ortools.append(name)
        if re.search(r"^\s*(from|import) transformer_engine", text, re.M):
            te.append(name)
        if re.search(r"^\s*(from|import) torchtitan", text, re.M):
            titan.append(name)
        if re.search(r"^\s*(from|import) ray\b", text, re.M):
            ray.append(name)
        if re.search(r"^\s*(from|import) megatron\.core", text, re.M):
            mcore.append(name)
        if re.search(r"^\s*(from|import) megatron\.training", text, re.M):
            mlm.append(name)
        if re.search(r"^\s*(from|import) tokenizers\b", text, re.M):
            hf.append(name)
    assert ortools in ([], ["planner/solver/cpsat.py"])
    assert te in ([], ["runtime/attention/te.py"])
    assert titan in ([], ["runtime/adapters/torchtitan/titan.py"])
    assert ray == ["planner/solver/ray_engine.py"]
    assert hf == ["planner/sources/textenc.py"]
    # The launcher's driver is a user's script of pretrain_gpt.py's shape: it imports Megatron.
    driver = "runtime/adapters/megatron_lm/pretrain_gpt.py"
    assert [m for m in mcore if m != driver] == ["runtime/adapters/megatron/compat/mcore.py"]
    assert [m for m in mlm if m != driver] == ["runtime/adapters/megatron_lm/mlm.py"]
