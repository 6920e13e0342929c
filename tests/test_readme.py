"""The examples of README.md and the docs/ pages run as written (those that need no GPU, and the
first five minutes and own-job examples on 4 gloo ranks), what they write is ignored by git, and
every link between the pages leads somewhere.

Each example is taken from its page itself, by the ``## heading`` it sits under, and run in a
scratch directory laid out like a checkout (``data/`` and ``.venv`` linked to this one's, an
empty ``plans/``), so the commands run exactly as a user pastes them and nothing lands in the
repo; every file an example leaves there must be one the repository's ``.gitignore`` ignores
(they left ``ckpt/`` and logs untracked in the repo root), and so must every output path any
page names anywhere.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from runtime.data.plan_reader import StepPlan

ROOT = Path(__file__).resolve().parents[1]
# The pages a user reads: the README and the reference pages it links to.
PAGES = ["README.md",
         *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
# Those with examples to paste (a fenced bash or python block); the others (design, reliability,
# the format) name commands only as the cases they record, `-o data.jsonl` among them.
EXAMPLE_PAGES = [page for page in PAGES
                 if re.search(r"^ *```(bash|python)$", (ROOT / page).read_text(), re.M)]


def block(page: str, heading: str, language: str, index: int = 0) -> str:
    """The ``index``-th fenced ``language`` block under ``## heading`` of ``page`` (README.md or
    docs/NAME.md); a block indented under a list item comes back without its indent."""
    text = (ROOT / page).read_text()
    assert f"\n## {heading}\n" in text, f"{page} has no section '## {heading}'"
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks: list[tuple[str, list[str]]] = []
    indent: int | None = None
    for line in section.splitlines():
        if line.lstrip().startswith("```"):
            if indent is None:
                indent = len(line) - len(line.lstrip())
                blocks.append((line.strip()[3:].strip(), []))
            else:
                indent = None
        elif indent is not None:
            blocks[-1][1].append(line[indent:])
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


def _loss_tokens(step: StepPlan) -> int:
    """The step's loss tokens: each sample's length less one, however the plan split it."""
    samples: dict[int, int] = {}
    for index, n in zip(step.sample_index.tolist(), step.num_tokens.tolist(), strict=True):
        if index >= 0:
            samples[index] = samples.get(index, 0) + n
    return sum(n - 1 for n in samples.values())


@pytest.mark.dist
def test_first_five_minutes_run_on_four_ranks(checkout: Path) -> None:
    # The README's way in, as a new user pastes it: plan, report, two steps on 4 gloo ranks.
    from runtime.data.plan_reader import PlanReader

    errors: list[str] = []
    out = run_bash(block("README.md", "First five minutes", "bash"), checkout, stderr=errors)
    # The summary lines the README quotes are the ones this plan prints, in that order.
    quoted = block("README.md", "First five minutes", "").strip().splitlines()
    printed = out.splitlines()
    assert set(quoted) <= set(printed), (quoted, out)
    assert [printed.index(line) for line in quoted] == sorted(printed.index(line)
                                                              for line in quoted)
    assert out.count("plans/mine.html: report of plans/mine.arrow") == 1
    page = (checkout / "plans" / "mine.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "Predicted gain" in page
    steps = [json.loads(line) for line in printed if line.startswith('{"step"')]
    assert [r["step"] for r in steps] == [0, 1]
    reader = PlanReader(checkout / "plans" / "mine.arrow")
    for r in steps:
        assert r["loss_tokens"] == _loss_tokens(reader.step(r["step"]))
    assert f"{steps[0]['loss']:.4f}".startswith("10.2")   # as the README's step line says
    assert "dcp-train: 2 steps (0-1), loss " in errors[0]


def test_text_corpus_example_runs(checkout: Path) -> None:
    pytest.importorskip("tokenizers")
    from planner.planfile.io import PlanFile

    out = run_bash(block("README.md", "A text corpus", "bash"), checkout)
    assert "tokenizer data/text/tokenizer.json (sha256 " in out
    assert "EOD 1 appended)" in out
    assert "wrote     plans/sample-text.bin, plans/sample-text.idx: 400 documents" in out
    # As the page says: both plans have the same samples' lengths.
    with PlanFile(checkout / "plans" / "text.arrow") as a, \
            PlanFile(checkout / "plans" / "text-ids.arrow") as b:
        assert a.header.dataset.fingerprint == b.header.dataset.fingerprint
        assert a.header.dataset.tokenizer["vocab_size"] == 512


def test_megatron_data_example_plans_documents_and_sequences(checkout: Path) -> None:
    # The .bin/.idx example: Megatron-core's builder writes 3 sequences per document; the
    # summary lines the README quotes are printed, and each plan holds its unit's samples.
    from runtime.data.plan_reader import PlanReader

    pytest.importorskip("megatron.core")
    heading = "Megatron data (`.bin`/`.idx`)"
    out = run_bash(block("README.md", heading, "bash"), checkout)
    quoted = block("README.md", heading, "").strip().splitlines()
    assert set(quoted) <= set(out.splitlines()), (quoted, out)
    for name, unit, samples in (("docs", "document", 667), ("seqs", "sequence", 2000)):
        with PlanReader(checkout / "plans" / f"sample-{name}.arrow") as reader:
            dataset = reader.header.dataset
            assert (dataset.megatron_unit, dataset.num_samples) == (unit, samples)


def test_planning_and_notebook_examples_run(checkout: Path) -> None:
    out = run_bash(block("docs/planning.md", "Making a plan", "bash"), checkout)
    # The summary's gain lines the page quotes are the ones this plan prints.
    quoted = block("docs/planning.md", "Making a plan", "", 0).strip().splitlines()
    shown = [line for line in out.splitlines() if line.startswith(("gain ", "   "))]
    assert quoted == [line for line in shown if line.strip()][:len(quoted)]
    # The provenance lines and the `show --gain` breakdown the page quotes are printed as such.
    for index in (1, 2):
        quoted = block("docs/planning.md", "Making a plan", "", index).strip().splitlines()
        assert set(quoted) <= set(out.splitlines()), (index, out)
    code = block("docs/planning.md", "Reading a plan in a notebook", "python")
    result = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert result.returncode == 0, result.stderr


def test_compare_example_runs(checkout: Path) -> None:
    out = run_bash(block("docs/planning.md", "Choosing a pool and capacity: `dcp-plan compare`",
                         "bash"), checkout)
    assert "steps     every step planned (32 per setup)" in out
    assert "refused   pool 4, cap 4,096: " in out          # as the page says
    assert (checkout / "plans" / "setups.png").read_bytes()[:4] == b"\x89PNG"


def test_report_example_runs(checkout: Path) -> None:
    out = run_bash(block("docs/planning.md", "A report to share: `dcp-plan report`", "bash"),
                   checkout)
    assert out.startswith("plans/sample-report.html: report of plans/sample.arrow")
    page = (checkout / "plans" / "sample-report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "Predicted gain" in page


@pytest.mark.dist
def test_megatron_own_job_example_runs_on_four_ranks(checkout: Path) -> None:
    # docs/megatron.md's own-job example as a user runs it: the plan, then the Python block
    # saved as my_megatron_job.py under torchrun with 4 gloo ranks (CP groups of 1, 2 and 4,
    # Megatron's overlapped DDP and distributed optimizer). Every step is logged with the plan's
    # loss tokens (each sample's length less one, however the plan split it) and finite numbers.
    pytest.importorskip("megatron.core")
    from runtime.data.plan_reader import PlanReader

    (checkout / "my_megatron_job.py").write_text(block(MEGATRON, OWN_MEGATRON_JOB, "python"))
    out = run_bash(block(MEGATRON, OWN_MEGATRON_JOB, "bash"), checkout)
    logs = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in logs] == [0, 1, 2]
    reader = PlanReader(checkout / "plans" / "job.arrow")
    assert {int(k) for i in range(3) for k in reader.step(i).group_cp_size} == {1, 2, 4}
    for r in logs:
        assert r["loss_tokens"] == _loss_tokens(reader.step(r["step"]))
        assert 0 < r["loss"] < 12
        assert math.isfinite(r["grad_norm"])
        assert r["grad_norm"] > 0


MEGATRON = "docs/megatron.md"
OWN_MEGATRON_JOB = "Your own Megatron job: `PlanJob`"


@pytest.mark.dist
def test_megatron_moe_example_equals_its_oracle(checkout: Path) -> None:
    # The MoE example as written: 4 ranks (CP groups of 1, 2 and 4) and the one-process oracle
    # write the same step line, load-balancing term and tokens per expert included.
    pytest.importorskip("megatron.core")
    from runtime.data.plan_reader import PlanReader

    run_bash(block(MEGATRON, "Mixture of experts", "bash"), checkout)
    reader = PlanReader(checkout / "plans" / "moe.arrow")
    assert {int(k) for k in reader.step(0).group_cp_size} == {1, 2, 4}
    got, want = ([json.loads(line) for line in (checkout / "runs" / name).read_text().splitlines()]
                 for name in ("moe.jsonl", "moe-oracle.jsonl"))
    assert len(got) == len(want) == 1
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert abs(got[0][key] - want[0][key]) <= 1e-6 * abs(want[0][key]), (key, got, want)
    assert got[0]["moe_tokens_per_expert"] == want[0]["moe_tokens_per_expert"]
    assert got[0]["loss_tokens"] == want[0]["loss_tokens"]


def test_every_output_the_pages_name_is_ignored() -> None:
    """Outputs of every example on every page, run by a test or not (the torchrun ones): plans,
    figures, reports, logs, checkpoints, summaries, and the job scripts it has you save."""
    assert {"README.md", "docs/megatron.md", "docs/planning.md", "docs/torchtitan.md",
            "docs/training.md"} <= set(EXAMPLE_PAGES)
    flags = r"(?:-o|--output|--save|--resume|--log-jsonl|--figure|--summary-json)"
    named: list[str] = []
    for page in EXAMPLE_PAGES:
        text = (ROOT / page).read_text()
        named += re.findall(rf"(?:^|\s){flags}[ =]([\w./-]+)", text, re.M)
        named += re.findall(r"savefig\(\"([^\"]+)\"\)", text)
        named += re.findall(r"^`(my_\w+\.py)`:$", text, re.M)
    outputs = sorted({n for n in named if not n.startswith(("FILE", "DIR", "PATH", "PREFIX"))})
    assert {"plans/mine.arrow", "runs/ckpt", "runs/train.jsonl", "plans/setups.png",
            "plans/sample-report.html", "plans/cp-mix.png", "my_torchtitan_job.py",
            "my_megatron_job.py", "runs/moe.jsonl"} <= set(outputs)
    assert set(outputs) - _ignored(outputs) == set()


def _outside_fences(text: str) -> list[str]:
    """The lines of a page that are not inside a fenced block (code is not prose)."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but '-' and '_' dropped, spaces '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_pages_leads_somewhere() -> None:
    """Every relative link (and image) of README.md and docs/*.md names a file that exists, and
    every ``#anchor`` a heading of its page: the README's table and the pages' cross-references
    are the way around now that the reference left the README."""
    anchors: dict[Path, set[str]] = {}
    checked = 0
    for page in PAGES:
        path = ROOT / page
        prose = "\n".join(_outside_fences(path.read_text()))
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if "://" in target or target.startswith("mailto:"):
                continue
            name, _, anchor = target.partition("#")
            linked = (path.parent / name).resolve() if name else path
            assert linked.exists(), f"{page}: link to missing {name}"
            if anchor:
                if linked not in anchors:
                    anchors[linked] = {_anchor(line.lstrip("#")) for line in
                                       _outside_fences(linked.read_text())
                                       if re.match(r"#{1,6} ", line)}
                assert anchor in anchors[linked], f"{page}: no heading for {target}"
            checked += 1
    assert checked > 20


@pytest.mark.dist
def test_torchtitan_own_job_example_runs_on_four_ranks(checkout: Path) -> None:
    # docs/torchtitan.md's own-job example as a user runs it: the two plans, then the Python block
    # saved as my_torchtitan_job.py under torchrun with 4 gloo ranks (CP groups of 1, 2 and 4,
    # FSDP over the pool, evaluation through torchtitan's validation hook). Its imports come
    # in isort's order (torchtitan first): on this CPU host that used to pick "cuda" and fail.
    pytest.importorskip("torchtitan")
    from runtime.data.plan_reader import PlanReader

    page, heading = "docs/torchtitan.md", "Your own torchtitan job"
    script = block(page, heading, "python")
    assert script.index("from torchtitan") < script.index("from runtime")
    (checkout / "my_torchtitan_job.py").write_text(script)
    errors: list[str] = []
    out = run_bash(block(page, heading, "bash"), checkout, stderr=errors)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    # Each evaluation right after the 0-based step it follows: every 2 steps and at the end.
    assert [x.get("step", f"after {x.get('after_step')}") for x in lines] == [
        0, 1, "after 1", 2, "after 2"]
    reader = PlanReader(checkout / "plans" / "job.arrow")
    assert {int(k) for i in range(3) for k in reader.step(i).group_cp_size} == {1, 2, 4}
    for r in (x for x in lines if "step" in x):
        step = reader.step(r["step"])
        assert r["loss_tokens"] == _loss_tokens(step)
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


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_torchtitan_own_entry_point_example_runs_on_four_ranks(checkout: Path) -> None:
    # docs/torchtitan.md's torchtitan.train example as a user runs it: the folded sample data,
    # the two plans, then torchtitan's own entry point with the registry's llama3_debugmodel on
    # 4 gloo ranks (CP groups of 1, 2 and 4, evaluation after steps 2 and 3, a checkpoint).
    # Equality with the oracle is tests/runtime/adapters/torchtitan/test_registry_dist.py's.
    pytest.importorskip("torchtitan")
    from runtime.data.plan_reader import PlanReader

    run_bash(block("docs/torchtitan.md", "torchtitan's own entry point", "bash"), checkout)
    lines = [json.loads(x) for x in (checkout / "runs" / "titan-debug.jsonl").read_text(
        ).splitlines()]
    assert [x.get("step", f"after {x.get('after_step')}") for x in lines] == [
        0, 1, "after 1", 2, "after 2"]
    reader = PlanReader(checkout / "plans" / "debug.arrow")
    assert {int(k) for i in range(3) for k in reader.step(i).group_cp_size} == {1, 2, 4}
    for r in (x for x in lines if "step" in x):
        step = reader.step(r["step"])
        assert r["loss_tokens"] == _loss_tokens(step)
        assert r["microbatches"] == step.num_microbatches
        assert 0 < r["loss"] < 12
    assert all(x["eval_tokens"] > 0 and math.isfinite(x["eval_loss"])
               for x in lines if "after_step" in x)
    assert (checkout / "runs" / "titan-debug" / "checkpoint" / "step-3" / ".metadata").is_file()
