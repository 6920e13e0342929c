"""``bench/bench_stages.py`` runs end to end and accounts for a run's CPU by stage.

A smoke test, not a measurement: 20,000 lengths (enough steps for the kernel to read above
the printed millisecond), one pool, one repeat, this checkout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def test_bench_stages_prints_every_stage(tmp_path: Path) -> None:
    lengths = tmp_path / "lengths.txt"
    rng = np.random.default_rng(0)
    lengths.write_text("".join(f"{n}\n" for n in rng.integers(64, 20_000, size=20_000)))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_stages.py"), "--lengths", str(lengths),
         "--runs", "8:fast", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line[2:30].strip(): line for line in proc.stdout.splitlines()
             if line.startswith("  ")}
    for stage in ("in-process CPU s", "kernel passes (solve_step)", "validate + copy pass",
                  "- coverage"):
        assert stage in lines, proc.stdout
    total = float(lines["in-process CPU s"].split()[-1])
    kernel = float(lines["kernel passes (solve_step)"].split()[-1])
    assert 0 < kernel <= total
