"""``bench/bench_ab.py`` runs end to end: HEAD's planner against this checkout's, same plan.

A smoke test, not a measurement: a few hundred lengths on pools of 4 and 8, one repeat. The
base is ``HEAD`` exported with ``git archive``, so unless the working tree changed the planner
since HEAD, both plans must be byte-identical (the table says so per run).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ab_compares_whole_processes(tmp_path: Path) -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip("not a git checkout")
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "planner"],
                             capture_output=True, text=True, check=True).stdout.strip()
    rng = np.random.default_rng(0)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{n}\n" for n in rng.integers(64, 20_000, size=400)))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_ab.py"), "--base", "HEAD", "--lengths",
         str(lengths), "--runs", "4:fast,8:balanced", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0].isdigit()]
    assert [r[:2] for r in rows] == [["4", "fast"], ["8", "balanced"]]
    if not changed:
        assert all(r[-1] == "identical" for r in rows), proc.stdout
