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


@pytest.mark.dist
def test_megatron_own_job_example_runs_on_four_ranks(checkout: Path) -> None:
    # The README's own-job example as a user runs it: the plan, then the Python block saved as
    # my_megatron_job.py under torchrun with 4 gloo ranks (CP groups of 1, 2 and 4, Megatron's
    # overlapped DDP and distributed optimizer). Every step is logged with the plan's loss
    # tokens (each sample's length less one, however the plan split it) and finite numbers.
    import json
    import math

    pytest.importorskip("megatron.core")
    from runtime.data.plan_reader import PlanReader

    (checkout / "my_megatron_job.py").write_text(
        readme_block("Using a plan in Megatron-core", "python"))
    bash = readme_block("Using a plan in Megatron-core", "bash", 1)
    out = run_bash(bash, checkout)
    logs = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in logs] == [0, 1, 2]
    reader = PlanReader(checkout / "plans" / "job.arrow")
    assert {int(k) for i in range(3) for k in reader.step(i).group_cp_size} == {1, 2, 4}
    for r in logs:
        step = reader.step(r["step"])
        samples: dict[int, int] = {}
        for index, n in zip(step.sample_index.tolist(), step.num_tokens.tolist(), strict=True):
            if index >= 0:
                samples[index] = samples.get(index, 0) + n
        assert r["loss_tokens"] == sum(n - 1 for n in samples.values())
        assert 0 < r["loss"] < 12
        assert math.isfinite(r["grad_norm"])
        assert r["grad_norm"] > 0


MOE = "Mixture of experts (Megatron-core)"


@pytest.mark.dist
def test_megatron_moe_example_equals_its_oracle(checkout: Path) -> None:
    # The MoE example as written: 4 ranks (CP groups of 1, 2 and 4) and the one-process oracle
    # write the same step line, load-balancing term and tokens per expert included.
    import json

    pytest.importorskip("megatron.core")
    from runtime.data.plan_reader import PlanReader

    run_bash(readme_block(MOE, "bash", 0), checkout)
    reader = PlanReader(checkout / "plans" / "moe.arrow")
    assert {int(k) for k in reader.step(0).group_cp_size} == {1, 2, 4}
    got, want = ([json.loads(line) for line in (checkout / "plans" / name).read_text().splitlines()]
                 for name in ("moe.jsonl", "moe-oracle.jsonl"))
    assert len(got) == len(want) == 1
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert abs(got[0][key] - want[0][key]) <= 1e-6 * abs(want[0][key]), (key, got, want)
    assert got[0]["moe_tokens_per_expert"] == want[0]["moe_tokens_per_expert"]
    assert got[0]["loss_tokens"] == want[0]["loss_tokens"]
