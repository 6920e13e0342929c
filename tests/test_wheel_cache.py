"""The built wheel, installed into a prefix of its own, compiles its numba kernels once and
never writes into the install tree (issue 29: the first plan after an install).

CI runs as root, for whom ``chmod a-w`` makes nothing unwritable, so the test cannot make the
prefix read-only; what it checks holds for a read-only prefix a fortiori: the planner caches in
the per-user folder whether or not the install tree is writable (planner/numbacache.py), so the
tree is byte for byte the same after two runs, and the second run compiles nothing. Without the
planner's cache locator, numba would write ``__pycache__/*.nbi`` beside the kernels (the tree
check fails), or, in a prefix it cannot write, recompile every run.

The first run compiles every kernel (about 20-45 s of CPU): ``slow``. It runs with ``--workers
2``, so the workers' compiles are reported too; the second runs with workers and the third in
one process, both from the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["data/sample.jsonl", "--dp", "4", "--cp", "2", "--max-tokens-per-rank", "4096",
        "--global-batch-size", "64", "--seed", "0"]


def _tree(prefix: Path) -> dict[str, tuple[int, int]]:
    """Every path under the prefix with its size and mtime (a folder's changes when a file
    is added to it)."""
    return {p.relative_to(prefix).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(prefix.rglob("*"))}


def _assert_unchanged(prefix: Path, before: dict[str, tuple[int, int]]) -> None:
    after = _tree(prefix)
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert changed == [], f"the run wrote into the install tree: {changed[:8]}"


def _build_and_install(tmp_path: Path) -> Path:
    """The wheel built from a copy of the sources (setuptools writes build/ and *.egg-info
    beside them), installed without dependencies (they come from this virtualenv)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("planner", "runtime"):
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    wheels = tmp_path / "wheels"
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("dcp_planner-*.whl")
    prefix = tmp_path / "prefix"
    subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(prefix), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return prefix


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_installed_wheel_compiles_once_and_leaves_its_tree_alone(tmp_path: Path) -> None:
    prefix = _build_and_install(tmp_path)
    work = tmp_path / "work"  # cwd: not the checkout, whose planner/ would shadow the prefix's
    (work / "data").mkdir(parents=True)
    shutil.copy2(ROOT / "data" / "sample.jsonl", work / "data")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH")}
    env.update(PYTHONPATH=str(prefix), XDG_CACHE_HOME=str(tmp_path / "cache"))
    where = subprocess.run([sys.executable, "-c", "import planner; print(planner.__file__)"],
                           capture_output=True, text=True, check=True, cwd=work, env=env)
    assert Path(where.stdout.strip()).is_relative_to(prefix), where.stdout
    before = _tree(prefix)

    def plan(run: str, *extra: str) -> tuple[dict[str, object], str]:
        js = tmp_path / f"{run}.json"
        proc = subprocess.run([sys.executable, "-m", "planner.cli", *PLAN, *extra,
                               "-o", str(tmp_path / f"{run}.arrow"), "--summary-json", str(js)],
                              capture_output=True, text=True, cwd=work, env=env, timeout=800)
        assert proc.returncode == 0, proc.stderr
        return json.loads(js.read_text()), proc.stdout

    cold, text = plan("cold", "--workers", "2")
    compile_s = cold["seconds"]["compile"]  # type: ignore[index]
    assert compile_s > 0
    assert cold["compile"]["worker_processes"] >= 1, cold["compile"]  # type: ignore[index]
    assert f"compile   numba kernels compiled once: {compile_s:.1f} s (" in text
    assert "; the compile excluded)" in text
    _assert_unchanged(prefix, before)
    assert list((tmp_path / "cache" / "dcp-planner" / "numba").glob("*/*.nbi"))
    for run, extra in (("warm-workers", ("--workers", "2")), ("warm", ())):
        warm, text = plan(run, *extra)
        assert warm["seconds"]["compile"] == 0.0, (run, warm["compile"])  # type: ignore[index]
        assert "compile   " not in text
        assert (tmp_path / f"{run}.arrow").read_bytes() == (tmp_path / "cold.arrow").read_bytes()
    _assert_unchanged(prefix, before)
