"""Module boundaries, checked in fresh interpreters: the planner never loads torch, the runtime
never loads ortools, and Transformer Engine is imported by one module only."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _loaded(code: str) -> set[str]:
    script = code + "\nimport sys\nprint(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return set(out.split())


def test_planner_does_not_import_torch() -> None:
    mods = _loaded("import planner, planner.cli, planner.notebook, planner.cost, planner.schema\n"
                   "import importlib.util\n"
                   "for m in ('planner.plan', 'planner.lengths', 'planner.batches'):\n"
                   "    importlib.util.find_spec(m) and importlib.import_module(m)\n"
                   "import importlib")
    assert "torch" not in mods


def test_runtime_does_not_import_ortools() -> None:
    mods = _loaded("import importlib, pkgutil, runtime\n"
                   "for m in pkgutil.iter_modules(runtime.__path__):\n"
                   "    if m.name not in ('te_adapter',):\n"
                   "        importlib.import_module('runtime.' + m.name)")
    assert "ortools" not in mods
    assert not any(m.startswith("transformer_engine") for m in mods)


def test_third_party_imports_stay_in_one_module_each() -> None:
    ortools, te = [], []
    for path in sorted((ROOT / "planner").glob("*.py")) + sorted((ROOT / "runtime").glob("*.py")):
        text = path.read_text()
        if re.search(r"^\s*(from|import) ortools", text, re.M):
            ortools.append(path.name)
        if re.search(r"^\s*(from|import) transformer_engine", text, re.M):
            te.append(path.name)
    assert ortools in ([], ["cpsat.py"])
    assert te in ([], ["te_adapter.py"])
