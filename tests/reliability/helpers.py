"""Shared pieces of the reliability tests: small real datasets, plans and CLI runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample.jsonl"
PLAN_FLAGS = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "8192",
              "--global-batch-size", "100", "--long-sequences", "split", "--quiet"]
TRAIN_FLAGS = ["--vocab-size", "64", "--hidden-size", "32", "--quiet"]


def write_token_jsonl(path: Path, num_samples: int = 24, seed: int = 0,
                      bad_lines: tuple[int, ...] = ()) -> Path:
    """A JSONL dataset of token lists (ids < 64); ``bad_lines`` (0-based) hold broken JSON."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(num_samples):
        if i in bad_lines:
            lines.append('{"input_ids": [1, 2,')
            continue
        n = int(rng.integers(8, 60))
        lines.append(json.dumps({"input_ids": rng.integers(0, 64, size=n).tolist()}))
    path.write_text("\n".join(lines) + "\n")
    return path


def pool1_plan(cli_main: object, data: Path, out: Path, *extra: str) -> Path:
    """A plan for one rank (dp 1, cp 1), trainable by ``dcp-train`` in this process."""
    argv = [str(data), "-o", str(out), "--dp", "1", "--cp", "1", "--max-tokens-per-rank", "256",
            "--global-batch-size", "6", "--quiet", *extra]
    assert cli_main(argv) == 0  # type: ignore[operator]
    return out


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m planner.cli ARGS`` in a fresh process (exit status, stdout, stderr)."""
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def no_traceback(text: str) -> bool:
    return "Traceback" not in text


def stderr_of(capsys: pytest.CaptureFixture[str]) -> str:
    """What was printed to stderr since the last read, checked to hold no traceback."""
    err = capsys.readouterr().err
    assert no_traceback(err)
    return err
