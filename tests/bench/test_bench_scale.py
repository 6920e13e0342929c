"""``bench/bench_scale.py --base`` runs end to end: HEAD's rows beside this checkout's.

A smoke test, not a measurement: 1,000 lengths on a pool of 8, one repeat. Unless the working
tree changed the planner since HEAD, the two plans must be byte-identical and their stats equal.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_scale_puts_base_rows_beside_this(tmp_path: Path) -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip("not a git checkout")
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "planner"],
                             capture_output=True, text=True, check=True).stdout.strip()
    rng = np.random.default_rng(0)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{n}\n" for n in rng.integers(64, 20_000, size=1_000)))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_scale.py"), "--lengths", str(lengths),
         "--runs", "0.001:8:fast", "--base", "HEAD", "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("base", "this")]
    assert [r[:4] for r in rows] == [["base", "0.001M", "8", "fast"],
                                     ["this", "0.001M", "8", "fast"]], proc.stdout
    assert rows[0][9:12] == rows[1][9:12], proc.stdout  # T/tight, worst step, steps
    if not changed:
        assert rows[1][-1] == "identical", proc.stdout
