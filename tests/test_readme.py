"""The README's examples run as written (the ones that need no process group or GPU).

Each example is taken from README.md itself, by the heading it sits under, and run in a scratch
directory laid out like a checkout (``data/`` and ``.venv`` linked to this one's, an empty
``plans/``), so the commands run exactly as a user pastes them and nothing lands in the repo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_block(heading: str, language: str, index: int = 0) -> str:
    """The ``index``-th fenced ``language`` block under the README's ``## heading``."""
    section = README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks: list[tuple[str, list[str]]] = []
    inside = False
    for line in section.splitlines():
        if line.startswith("```"):
            if not inside:
                blocks.append((line[3:].strip(), []))
            inside = not inside
        elif inside:
            blocks[-1][1].append(line)
    return "\n".join([b for lang, b in blocks if lang == language][index]) + "\n"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "data").symlink_to(ROOT / "data")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])
    (tmp_path / "plans").mkdir()
    return tmp_path


def run_bash(block: str, cwd: Path) -> str:
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert out.returncode == 0, f"{block}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    return out.stdout


def test_planning_and_notebook_examples_run(checkout: Path) -> None:
    out = run_bash(readme_block("Planning", "bash"), checkout)
    # The summary's gain lines the README quotes are the ones this plan prints.
    quoted = readme_block("Planning", "", 0).strip().splitlines()
    shown = [line for line in out.splitlines() if line.startswith(("gain ", "   "))]
    assert quoted == [line for line in shown if line.strip()][:len(quoted)]
    code = readme_block("Reading a plan in a notebook", "python")
    result = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert result.returncode == 0, result.stderr


def test_compare_example_runs(checkout: Path) -> None:
    out = run_bash(readme_block("Choosing a pool and capacity: `dcp-plan compare`", "bash"),
                   checkout)
    assert "steps     every step planned (32 per setup)" in out
    assert "refused   pool 4, cap 4,096: " in out          # as the README says
    assert (checkout / "plans" / "setups.png").read_bytes()[:4] == b"\x89PNG"


def test_report_example_runs(checkout: Path) -> None:
    out = run_bash(readme_block("A report to share: `dcp-plan report`", "bash"), checkout)
    assert out.startswith("plans/sample-report.html: report of plans/sample.arrow")
    page = (checkout / "plans" / "sample-report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "Predicted gain" in page
