"""Where the planner's numba kernels cache (planner/numbacache.py), and the compile clock.

Each check runs in a fresh interpreter: numba chooses a kernel's cache folder once, when the
kernel is decorated at import, so only a new process shows what an environment does. The
kernels are the planner's own (decorating them compiles nothing); compiles are timed on small
functions written to tmp_path, with the cache in tmp_path too. tests/test_wheel_cache.py
installs the built wheel and runs ``dcp-plan`` twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from planner import numbacache
from planner.cli.summary import Compiles, format_summary, plan_summary
from planner.numbacache import CompileTotals
from planner.planfile.schema import PlanHeader

ROOT = Path(__file__).resolve().parents[2]

# A planner kernel module, and the folder numba chose for one of its kernels.
_KERNEL_PATH = ("import planner.solver.spread as m\n"
                "print(m.spread._cache.cache_path)\n")


def _python(code: str, tmp_path: Path, **env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH")}
    full = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]), **env}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=full, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_kernels_cache_under_xdg_cache_home_not_beside_the_source(tmp_path: Path) -> None:
    out = _python(_KERNEL_PATH, tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    folder = Path(out.strip())
    assert folder.parent == tmp_path / "xdg" / "dcp-planner" / "numba", folder
    # Named after the source's folder (numba's naming), even though this checkout's
    # planner/solver/__pycache__ is writable: numba alone would have chosen that.
    assert folder.name.startswith("solver_")
    assert os.access(ROOT / "planner" / "solver", os.W_OK)


def test_numba_cache_dir_wins(tmp_path: Path) -> None:
    out = _python(_KERNEL_PATH, tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
                  XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert Path(out.strip()).parent == tmp_path / "numba"


def test_home_cache_without_xdg_and_with_a_relative_one(tmp_path: Path) -> None:
    for xdg in ({}, {"XDG_CACHE_HOME": "relative/cache"}):
        out = _python(_KERNEL_PATH, tmp_path, HOME=str(tmp_path / "home"), **xdg)
        assert Path(out.strip()).parent == tmp_path / "home" / ".cache" / "dcp-planner" / "numba"


def test_numba_imported_first_still_gets_the_planner_folder(tmp_path: Path) -> None:
    out = _python("import numba\n" + _KERNEL_PATH, tmp_path,
                  XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert Path(out.strip()).parent == tmp_path / "xdg" / "dcp-planner" / "numba"


def test_import_planner_loads_no_numba(tmp_path: Path) -> None:
    out = _python("import planner, sys\nprint('numba' in sys.modules)", tmp_path)
    assert out.strip() == "False"


def _write_kernels(tmp_path: Path) -> None:
    """``outer`` calls ``inner``: one top-level compile, two signatures."""
    (tmp_path / "userkernels.py").write_text(textwrap.dedent("""\
        import numba

        @numba.njit(cache=True)
        def inner(x):
            return x * 2 + 1

        @numba.njit(cache=True)
        def outer(x):
            return inner(x) - 1
        """))


_COMPILE = """\
import json, time
import planner.numbacache as nc
import userkernels
t = time.perf_counter()
assert userkernels.outer(3) == 6
wall = time.perf_counter() - t
totals = nc.compile_totals()
print(json.dumps({"seconds": totals.seconds, "signatures": totals.signatures, "wall": wall,
                  "path": userkernels.outer._cache.cache_path}))
"""


def test_other_packages_keep_numbas_folder_and_the_clock_counts_top_level_compiles(
        tmp_path: Path) -> None:
    _write_kernels(tmp_path)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    first = json.loads(_python("import planner\n" + _COMPILE, tmp_path, **env))
    # Not the planner's: numba's own choice, __pycache__ beside the source.
    assert Path(first["path"]) == tmp_path / "__pycache__"
    assert first["signatures"] == 2
    # inner's compile runs inside outer's: counted once, so never more than the call's wall.
    assert 0 < first["seconds"] <= first["wall"]
    # A new process loads both from the cache: no compile.
    second = json.loads(_python("import planner\n" + _COMPILE, tmp_path, **env))
    assert second["signatures"] == 0
    assert second["seconds"] == 0.0


def test_processes_started_under_worker_compiles_report_to_the_driver(tmp_path: Path) -> None:
    _write_kernels(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]),
               NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    with numbacache.worker_compiles(folder=tmp_path) as workers:
        assert os.environ[numbacache.COMPILE_LOG_ENV].startswith(f"{os.getpid()}:")
        env[numbacache.COMPILE_LOG_ENV] = os.environ[numbacache.COMPILE_LOG_ENV]
        for _ in range(2):  # the second loads from the cache and reports nothing
            subprocess.run([sys.executable, "-c", "import planner\n" + _COMPILE], check=True,
                           capture_output=True, cwd=ROOT, env=env, timeout=120)
        (one,) = workers.read()
    assert one.signatures == 2
    assert one.seconds > 0
    assert numbacache.COMPILE_LOG_ENV not in os.environ
    assert list(tmp_path.glob("dcp-compile-*")) == []
    with numbacache.worker_compiles(False, folder=tmp_path) as none:  # a run in one process
        assert numbacache.COMPILE_LOG_ENV not in os.environ
        assert none.read() == []
    assert list(tmp_path.glob("dcp-compile-*")) == []


@pytest.fixture(scope="module")
def header(tmp_path_factory: pytest.TempPathFactory) -> PlanHeader:
    """A real plan's header (the sample, as the README plans it)."""
    from planner.cli import main
    from planner.planfile.io import PlanFile

    out = tmp_path_factory.mktemp("plan") / "p.arrow"
    assert main([str(ROOT / "data" / "sample.jsonl"), "--dp", "2", "--cp", "2",
                 "--max-tokens-per-rank", "2048", "--global-batch-size", "8",
                 "--long-sequences", "split", "-o", str(out), "--quiet"]) == 0
    return PlanFile(out).header


def _summary(header: PlanHeader, compiles: Compiles | None) -> tuple[dict[str, Any], str]:
    s = plan_summary(header, "p.arrow", {"read": 1.0, "plan": 8.0, "validate+write": 1.0},
                     compiles)
    return s, format_summary(s)


def test_a_run_that_compiled_nothing_has_no_compile_line(header: PlanHeader) -> None:
    s, text = _summary(header, None)
    assert s["seconds"] == {"read": 1.0, "plan": 8.0, "validate+write": 1.0, "compile": 0.0,
                            "total": 10.0}
    assert s["samples_per_second"] == pytest.approx(2000 / 10.0)
    assert "compile" not in text.replace("compiled", "")
    assert text.splitlines()[-1] == ("speed     200 sequences/s in 10.00 s (read 1.00 s, plan "
                                     "8.00 s, validate+write 1.00 s)")


def test_the_compile_is_its_own_line_and_the_speed_excludes_it(header: PlanHeader) -> None:
    s, text = _summary(header, Compiles(by_phase={"read": 0.5, "plan": 5.5, "validate+write": 0.1},
                                        signatures=68))
    assert s["seconds"]["compile"] == pytest.approx(6.1)
    assert s["seconds"]["total"] == 10.0
    assert s["seconds"]["plan"] == pytest.approx(2.5)
    assert s["samples_per_second"] == pytest.approx(2000 / 3.9)
    lines = text.splitlines()
    assert lines[-2] == ("compile   numba kernels compiled once: 6.1 s (68 signatures; cached "
                         "for later runs)")
    assert lines[-1] == ("speed     513 sequences/s in 3.90 s (read 0.50 s, plan 2.50 s, "
                         "validate+write 0.90 s; the compile excluded)")


def test_workers_compile_at_the_same_time_the_longest_counts(header: PlanHeader) -> None:
    workers = (CompileTotals(seconds=5.0, signatures=40), CompileTotals(seconds=4.0, signatures=40))
    s, text = _summary(header, Compiles(by_phase={"read": 1.0}, signatures=9, workers=workers))
    assert s["seconds"]["compile"] == pytest.approx(6.0)
    assert s["seconds"]["read"] == 0.0
    assert s["seconds"]["plan"] == pytest.approx(3.0)
    assert s["compile"] == {"signatures_here": 9, "seconds_here": 1.0, "worker_processes": 2,
                            "worker_seconds_max": 5.0}
    assert ("compile   numba kernels compiled once: 6.0 s (1.0 s here, up to 5.0 s in each of 2 "
            "worker processes at the same time; cached for later runs)") in text.splitlines()


def test_dcp_plan_json_has_the_compile_figures(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    assert main([str(ROOT / "data" / "sample.jsonl"), "--dp", "4", "--cp", "2",
                 "--max-tokens-per-rank", "4096", "--global-batch-size", "64",
                 "-o", str(tmp_path / "p.arrow"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert set(s["seconds"]) == {"read", "plan", "validate+write", "compile", "total"}
    assert set(s["compile"]) == {"signatures_here", "seconds_here", "worker_processes",
                                 "worker_seconds_max"}
    work = s["seconds"]["total"] - s["seconds"]["compile"]
    assert s["samples_per_second"] == pytest.approx(2000 / work)
