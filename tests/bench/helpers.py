"""Shared set-up of the bench scripts' smoke tests: a lengths file, a script in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def write_lengths(path: Path, num_samples: int, seed: int = 0) -> Path:
    """A ``.txt`` lengths file of ``num_samples`` lengths in [64, 20000), seeded."""
    rng = np.random.default_rng(seed)
    path.write_text("".join(f"{n}\n" for n in rng.integers(64, 20_000, size=num_samples)))
    return path


def run_bench(script: str, *args: str) -> str:
    """``python bench/SCRIPT ARGS`` from the checkout's root in a fresh process; its stdout,
    after checking that it exited 0 (else the test fails with the end of its stderr)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
