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


def test_third_party_imports_stay_in_one_module_each() -> None:
    ortools, te, titan, ray = [], [], [], []
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
    assert ortools in ([], ["planner/solver/cpsat.py"])
    assert te in ([], ["runtime/attention/te.py"])
    assert titan in ([], ["runtime/adapters/torchtitan/titan.py"])
    assert ray == ["planner/solver/ray_engine.py"]
