"""An earlier revision's planner beside this checkout's, for side-by-side benchmarks.

``export_planner`` writes the ``planner/`` package of a git revision into a directory (``git
archive``, so no checkout or worktree is touched); ``base_variant`` is the command and
environment that run that revision's ``dcp-plan`` from there (its console-script entry, its
directory first on PYTHONPATH, and ``python -P``: ``-c`` would otherwise put the current
directory, a checkout's root where its own ``planner/`` is, before PYTHONPATH); ``check_base``
confirms that the exported package is the one imported. bench_ab.py, bench_scale.py and
bench_stages.py share them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# The revision's own console-script entry (``planner.cli:entry``: main, then os._exit without
# the interpreter's teardown, ~0.1 s a run) where it has one, as its ``dcp-plan`` would run.
_BASE_MAIN = ("import sys, planner.cli as c; e = getattr(c, 'entry', None); "
              "e() if e else sys.exit(c.main())")


def export_planner(rev: str, into: Path, who: str) -> None:
    """``planner/`` of ``rev`` under ``into``; a revision git does not know exits naming it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "planner"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"{who}: git archive {rev}: {archive.stderr.decode().strip()}")
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def base_env(into: Path) -> dict[str, str]:
    """This process's environment with the exported planner first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": str(into)}


def base_variant(into: Path) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of the exported revision's ``dcp-plan``."""
    return ([sys.executable, "-P", "-c", _BASE_MAIN], base_env(into))


def check_base(into: Path, who: str, cwd: Path | None = None) -> None:
    """Exit unless ``python -P`` with ``base_env(into)`` (run in ``cwd``) imports ``into``'s
    planner: a base that silently ran this checkout would compare it with itself."""
    probe = subprocess.run([sys.executable, "-P", "-c",
                            "import planner.cli, sys; sys.stdout.write(planner.cli.__file__)"],
                           env=base_env(into), cwd=cwd, capture_output=True, text=True,
                           check=False)
    got = Path(probe.stdout.strip()).resolve() if probe.returncode == 0 else None
    if got is None or not got.is_relative_to(into.resolve()):
        raise SystemExit(f"{who}: the base imports {got or probe.stderr.strip()[-500:]}, "
                         f"not the export in {into}")


def this_variant() -> tuple[list[str], dict[str, str]]:
    """(command, environment) of this checkout's ``dcp-plan``."""
    return [str(Path(sys.executable).with_name("dcp-plan"))], dict(os.environ)
