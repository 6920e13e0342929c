"""The README's examples run as written (those that need no GPU, and the own-job examples on 4
gloo ranks), and what they write is ignored by git.

Each example is taken from README.md itself, by the heading it sits under, and run in a scratch
directory laid out like a checkout (``data/`` and ``.venv`` linked to this one's, an empty
``plans/``), so the commands run exactly as a user pastes them and nothing lands in the repo;
every file an example leaves there must be one the repository's ``.gitignore`` ignores (they
left ``ckpt/`` and logs untracked in the repo root), and so must every output path the README
names anywhere.
"""

from __future__ import annotations

import json
import math
import os
import re
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


def run_bash(block: str, cwd: Path, *, stderr: list[str] | None = None) -> str:
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "MPLBACKEND": "Agg"})
    assert out.returncode == 0, f"{block}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    if stderr is not None:
        stderr.append(out.stderr)
    assert_ignored(cwd)
    return out.stdout


def _ignored(paths: list[str]) -> set[str]:
    """Which of ``paths`` (relative to a checkout) the repository's .gitignore ignores."""
    if not paths:
        return set()
    out = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"],
                         input="\n".join(paths) + "\n", capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode in (0, 1), out.stderr
    return set(out.stdout.split())


def assert_ignored(checkout: Path) -> None:
    """Every file an example left in the scratch checkout is ignored by git."""
    written = sorted(p.relative_to(checkout).as_posix() for p in checkout.rglob("*")
                     if p.is_file() and p.parts[len(checkout.parts)] not in ("data", ".venv"))
    assert set(written) - _ignored(written) == set()


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


MOE = "Mixture of experts and multi-token prediction (Megatron-core)"


@pytest.mark.dist
def test_megatron_moe_example_equals_its_oracle(checkout: Path) -> None:
    # The MoE example as written: 4 ranks (CP groups of 1, 2 and 4) and the one-process oracle
    # write the same step line, load-balancing term and tokens per expert included.
    pytest.importorskip("megatron.core")
    from runtime.data.plan_reader import PlanReader

    run_bash(readme_block(MOE, "bash", 0), checkout)
    reader = PlanReader(checkout / "plans" / "moe.arrow")
    assert {int(k) for k in reader.step(0).group_cp_size} == {1, 2, 4}
    got, want = ([json.loads(line) for line in (checkout / "runs" / name).read_text().splitlines()]
                 for name in ("moe.jsonl", "moe-oracle.jsonl"))
    assert len(got) == len(want) == 1
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert abs(got[0][key] - want[0][key]) <= 1e-6 * abs(want[0][key]), (key, got, want)
    assert got[0]["moe_tokens_per_expert"] == want[0]["moe_tokens_per_expert"]
    assert got[0]["loss_tokens"] == want[0]["loss_tokens"]


def test_every_output_the_readme_names_is_ignored() -> None:
    """Outputs of every example, run by a test or not (the torchrun ones): plans, figures,
    reports, logs, checkpoints, summaries, and the job scripts it has you save."""
    flags = r"(?:-o|--output|--save|--resume|--log-jsonl|--figure|--summary-json)"
    named = re.findall(rf"(?:^|\s){flags}[ =]([\w./-]+)", README, re.M)
    named += re.findall(r"savefig\(\"([^\"]+)\"\)", README)
    named += re.findall(r"^`(my_\w+\.py)`:$", README, re.M)
    outputs = sorted({n for n in named if not n.startswith(("FILE", "DIR", "PATH"))})
    assert {"runs/ckpt", "runs/train.jsonl", "plans/setups.png", "plans/sample-report.html",
            "my_torchtitan_job.py"} <= set(outputs)
    assert set(outputs) - _ignored(outputs) == set()


@pytest.mark.dist
def test_torchtitan_own_job_example_runs_on_four_ranks(checkout: Path) -> None:
    # The README's own-job example as a user runs it: the two plans, then the Python block
    # saved as my_torchtitan_job.py under torchrun with 4 gloo ranks (CP groups of 1, 2 and 4,
    # FSDP over the pool, evaluation through torchtitan's validation hook). Its imports come
    # in isort's order (torchtitan first): on this CPU host that used to pick "cuda" and fail.
    pytest.importorskip("torchtitan")
    from runtime.data.plan_reader import PlanReader

    heading = "Using a plan in torchtitan"
    script = readme_block(heading, "python")
    assert script.index("from torchtitan") < script.index("from runtime")
    (checkout / "my_torchtitan_job.py").write_text(script)
    errors: list[str] = []
    out = run_bash(readme_block(heading, "bash", 1), checkout, stderr=errors)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    # Each evaluation right after the 0-based step it follows: every 2 steps and at the end.
    assert [x.get("step", f"after {x.get('after_step')}") for x in lines] == [
        0, 1, "after 1", 2, "after 2"]
    reader = PlanReader(checkout / "plans" / "job.arrow")
    assert {int(k) for i in range(3) for k in reader.step(i).group_cp_size} == {1, 2, 4}
    for r in (x for x in lines if "step" in x):
        step = reader.step(r["step"])
        samples: dict[int, int] = {}
        for index, n in zip(step.sample_index.tolist(), step.num_tokens.tolist(), strict=True):
            if index >= 0:
                samples[index] = samples.get(index, 0) + n
        assert r["loss_tokens"] == sum(n - 1 for n in samples.values())
        assert r["microbatches"] == step.num_microbatches
        assert math.isfinite(r["loss"])
        assert 0 < r["loss"] < 12
    evals = [x for x in lines if "after_step" in x]
    assert all(x["eval_tokens"] > 0 and math.isfinite(x["eval_loss"]) for x in evals)
    assert evals[0]["eval_tokens"] == evals[1]["eval_tokens"]  # the same 2 eval steps
    # torchtitan's known warnings stay quiet (titan.KNOWN_WARNINGS); nothing else is printed
    # but torchrun's banner and the run's summary line.
    from runtime.adapters.torchtitan.titan import KNOWN_WARNINGS

    for known in KNOWN_WARNINGS:
        assert not re.search(known.message, errors[0]), known.message
    rest = [x for x in errors[0].splitlines() if "torch/distributed/run.py" not in x]
    assert rest == [x for x in rest if x.startswith("dcp-train: 3 steps (0-2)")], rest
