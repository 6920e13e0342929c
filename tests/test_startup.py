"""Commands that need no planner start at once (issue 29): ``dcp-plan --version`` and ``--help``,
``dcp-train --version`` and ``dcp-calibrate --version`` load none of numba, pyarrow, OR-Tools,
numpy or torch, and cost at most 0.25 CPU-s.

The primary check is which modules the command leaves in ``sys.modules`` (exact, whatever the
load); the CPU time of the child (user + sys, not wall time: the machine is shared) is the
second, with the fastest of three runs asserted so one descheduled run does not fail it.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numba", "pyarrow", "ortools", "numpy", "torch")
MAX_CPU_S = 0.25

# Each entry point the way its console script calls it (pyproject.toml [project.scripts]).
COMMANDS = {
    "dcp-plan --version": ("planner.cli", "entry", ["--version"]),
    "dcp-plan --help": ("planner.cli", "entry", ["--help"]),
    "dcp-train --version": ("runtime.train", "main", ["--version"]),
    "dcp-calibrate --version": ("runtime.calibrate", "main", ["--version"]),
}

# The command exits through SystemExit (argparse) or os._exit (dcp-plan's entry): the probe
# reports sys.modules from an atexit hook and from os._exit alike.
_PROBE = """\
import atexit, os, sys
def _report():
    heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r}))
    sys.stderr.write('LOADED ' + ','.join(heavy) + '\\n'); sys.stderr.flush()
atexit.register(_report)
_exit = os._exit
os._exit = lambda code: (_report(), _exit(code))
sys.argv = [{prog!r}, *{args!r}]
import importlib
sys.exit(getattr(importlib.import_module({module!r}), {func!r})())
"""


def _run(name: str) -> tuple[subprocess.CompletedProcess[str], float]:
    module, func, args = COMMANDS[name]
    code = _PROBE.format(heavy=HEAVY, prog=name.split()[0], args=args, module=module, func=func)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, cpu


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_command_loads_no_heavy_module(name: str) -> None:
    proc, _ = _run(name)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(name.split()[0]) or proc.stdout.startswith("usage: dcp-plan")
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("LOADED ")]
    assert line == "LOADED ", f"{name} imports {line.removeprefix('LOADED ')}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_command_costs_at_most_a_quarter_cpu_second(name: str) -> None:
    cpu = min(_run(name)[1] for _ in range(3))
    assert cpu <= MAX_CPU_S, f"{name}: {cpu:.2f} CPU-s (fastest of 3)"
