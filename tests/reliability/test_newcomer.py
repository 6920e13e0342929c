"""A newcomer's first day (issue 23): what a new user met on a fresh clone, each now fixed.

Before: nothing said how many processes a plan needs, and dcp-train's world-size error did not
say what to launch; ``dcp-plan validate`` forgot a plan's ``--skip-bad-records``;
``--effort``'s help said "solver effort"; a blend's summary hid that 582 of an entry's 1,000
samples are never drawn; ``--resume`` said nothing of where it continued; a missing dataset was a
raw ``[Errno 2]``; ``validate --version`` and ``show --version`` demanded arguments; ``show --steps
-3`` silently showed one step; torchtitan runs printed upstream warnings on every rank.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from runtime.train.cli import main as train_main
from tests.reliability.helpers import (
    ROOT,
    SAMPLE,
    TRAIN_FLAGS,
    no_traceback,
    pool1_plan,
    stderr_of,
    write_token_jsonl,
)

BIN = Path(sys.executable).parent


def test_the_summary_says_how_to_launch_and_the_mismatch_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "p.arrow"
    flags = [str(SAMPLE), "-o", str(plan), "--dp", "1", "--cp", "2", "--tp", "2", "--pp", "2",
             "--max-tokens-per-rank", "8192", "--global-batch-size", "64", "--long-sequences",
             "split"]
    assert main(flags) == 0
    text = capsys.readouterr().out
    assert "launch    torchrun --nproc-per-node 8 (dp 1 x cp 2 x tp 2 x pp 2 = 8 processes; " \
           "on several nodes: --nnodes N --nproc-per-node 8/N)" in text.splitlines()
    assert main([*flags, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["world_size"], summary["launch"]) == (8, "torchrun --nproc-per-node 8")
    # dcp-train in one process (no torchrun) on a plan for 4: the error says what to launch.
    pool4 = tmp_path / "pool4.arrow"
    assert main([str(SAMPLE), "-o", str(pool4), "--dp", "2", "--cp", "2",
                 "--max-tokens-per-rank", "8192", "--global-batch-size", "64",
                 "--long-sequences", "split", "--quiet"]) == 0
    assert train_main(["--plan", str(pool4), "--dataset", str(SAMPLE), "--vocab-size", "32000",
                       "--steps", "1", "--quiet"]) == 2
    err = stderr_of(capsys)
    # The hint is a command that runs (issue 32: it left out -m runtime.train).
    assert "plan built for world_size=4 (dp=2, cp=2, tp=1, pp=1), got 1: launch torchrun " \
           "--nproc-per-node 4 -m runtime.train ARGS (dp 2 x cp 2 x tp 1 x pp 1 = 4 processes" \
           in err


def test_validate_reads_the_plans_skip_policy(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = write_token_jsonl(tmp_path / "d.jsonl", bad_lines=(3, 9))
    plan = pool1_plan(main, data, tmp_path / "p.arrow", "--skip-bad-records")
    capsys.readouterr()
    # No flag: the plan recorded that it skipped records (as it records --field).
    assert main(["validate", str(plan), str(data)]) == 0
    assert "invariants and dataset coverage checked" in capsys.readouterr().out
    assert main(["validate", str(plan), str(data), "--skip-bad-records"]) == 0
    capsys.readouterr()
    # A plan made without skipping still stops at a bad line: it recorded no skip policy.
    clean = write_token_jsonl(tmp_path / "c.jsonl")
    plan2 = pool1_plan(main, clean, tmp_path / "p2.arrow")
    lines = clean.read_text().splitlines()
    clean.write_text("\n".join([lines[0], '{"input_ids": [1, 2,', *lines[1:]]) + "\n")
    assert main(["validate", str(plan2), str(clean)]) == 2
    assert f"{clean}:2" in stderr_of(capsys)


def test_effort_help_quotes_the_measured_cost() -> None:
    """``--effort``'s help gives the numbers of BENCHMARKS.md's effort table (N = 64, 256)."""
    text = " ".join(subprocess.run([str(BIN / "dcp-plan"), "--help"], capture_output=True,
                                   text=True, timeout=120, check=True).stdout.split())
    section = (ROOT / "BENCHMARKS.md").read_text().split("### What `--effort` costs", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = {(int(n), effort): (float(cpu), ratio) for n, effort, _, cpu, ratio in re.findall(
        r"^\| (\d+) \| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", section, re.M)}
    for n in (64, 256):
        quoted = "; ".join(f"{e} {rows[(n, e)][0]:g} s {rows[(n, e)][1]}x"
                           for e in ("fast", "balanced", "max"))
        got = re.search(rf"N = {n}: (.*?)(?:;|\.) (?:N =|max costs)", text)
        assert got is not None, text
        assert [float(x) for x in re.findall(r"[\d.]+", got.group(1))] == [
            float(x) for x in re.findall(r"[\d.]+", quoted)], (got.group(1), quoted)
    assert "max costs ~10x for plans ~0.05% faster" in text


def test_the_readme_says_what_the_first_plan_costs() -> None:
    """The README promised 10-15 s for the first plan's compile, then quoted 46 s; it quotes
    BENCHMARKS.md's measured CPU seconds of the first plans (the Quickstart's, 1M's) instead."""
    section = (ROOT / "BENCHMARKS.md").read_text().split(
        "### The first plan after an install: kernels as Python", 1)[1].split("\n### ", 1)[0]
    cpu = {}
    for name in ("Quickstart", "1M Wikipedia"):
        got = re.search(rf"^\| {name}, first plan \(empty cache\) \| [\d.]+ \+ [\d.]+ = [\d.]+ "
                        r"\| [\d.]+ \+ [\d.]+ = ([\d.]+) \|", section, re.M)
        assert got is not None, section
        cpu[name] = float(got.group(1))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"the Quickstart's first plan costs about {max(1, round(cpu['Quickstart']))} s of "
            "CPU") in readme
    assert f"(about {round(cpu['1M Wikipedia'])} s of CPU, once, for 1M sequences)" in readme
    assert "10-15 s" not in readme
    assert "about 46 s" not in readme


def test_a_blend_summary_shows_drawn_and_undrawn_samples(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two entries of 1,000 samples, weights 0.3 / 0.7 of 64: 19 and 45 a step; entry 1 runs
    # out after 22 steps, so entry 0 gives 22 x 19 = 418 and 582 are never drawn.
    entries = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"length": 100 + i % 50}) + "\n"
                                for i in range(1000)))
        entries += [path]
    argv = ["--data-path", "0.3", str(entries[0]), "0.7", str(entries[1]), "--dp", "2",
            "--cp", "2", "--max-tokens-per-rank", "4096", "--global-batch-size", "64", "-o",
            str(tmp_path / "p.arrow")]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("blend "))
    assert lines[at + 1:at + 4] == [
        "  entry 0 418 of 1,000 samples drawn, 582 never drawn",
        "  entry 1 990 of 1,000 samples drawn, 10 never drawn",
        "          (an epoch ends when entry 1 has fewer than the 45 samples a step draws from "
        "it)"]
    assert main([*argv, "--json", "--epochs", "2"]) == 0
    entry0 = json.loads(capsys.readouterr().out)["blend_entries"][0]
    assert (entry0["samples"], entry0["drawn_per_epoch"], entry0["undrawn_per_epoch"]) == (
        1000, [418, 418], [582, 582])


def test_resume_says_from_which_checkpoint_and_step(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = write_token_jsonl(tmp_path / "d.jsonl")
    plan = pool1_plan(main, data, tmp_path / "p.arrow")
    ckpt = tmp_path / "ckpt"
    base = ["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS, "--save", str(ckpt)]
    for reference in ([], ["--reference"]):  # the replayed run and its oracle
        capsys.readouterr()
        assert train_main([*base, "--steps", "2", *reference]) == 0
        assert "resuming" not in stderr_of(capsys)
        assert train_main([*base, "--steps", "3", "--resume", str(ckpt), *reference]) == 0
        assert f"dcp-train: resuming from {ckpt}/step-00000002 at step 2\n" in stderr_of(capsys)
        for f in sorted(ckpt.iterdir()):
            if f.is_dir():
                for g in f.iterdir():
                    g.unlink()
                f.rmdir()
            else:
                f.unlink()


def test_a_missing_dataset_is_named_not_an_errno(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    data = write_token_jsonl(tmp_path / "d.jsonl")
    plan = pool1_plan(main, data, tmp_path / "p.arrow")
    capsys.readouterr()
    for extra in ([], ["--reference"]):
        assert train_main(["--plan", str(plan), "--dataset", str(tmp_path / "nope.jsonl"),
                           *TRAIN_FLAGS, *extra]) == 2
        err = stderr_of(capsys)
        assert "Errno" not in err
        assert f"dcp-train: error: {tmp_path}/nope.jsonl: no such file; {plan} was made from " \
               f"{data}: give that dataset with --dataset" in err
    # An eval plan's dataset names its own flag.
    eval_plan = tmp_path / "e.arrow"
    assert main([str(data), "--eval", "-o", str(eval_plan), "--dp", "1",
                 "--max-tokens-per-rank", "256", "--global-batch-size", "6", "--quiet"]) == 0
    assert train_main(["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS,
                       "--eval-plan", str(eval_plan), "--eval-dataset",
                       str(tmp_path / "gone.jsonl")]) == 2
    assert f"{tmp_path}/gone.jsonl: no such file; {eval_plan} was made from {data}: give that " \
           "dataset with --eval-dataset" in stderr_of(capsys)
    # A cost model file that is not there (a preset is a name without a suffix).
    assert main([str(data), "--dp", "1", "--max-tokens-per-rank", "256", "--global-batch-size",
                 "6", "-o", str(tmp_path / "c.arrow"), "--cost-model", "cm.json"]) == 2
    assert "cm.json: no such cost model file (a JSON file, e.g. from dcp-calibrate, or a " \
           "preset name: dense-7b-h200, " in stderr_of(capsys)
    assert not (tmp_path / "c.arrow").exists()
    # The plan's own files (the default dataset) moved away: the same message.
    data.rename(tmp_path / "moved.jsonl")
    assert train_main(["--plan", str(plan), *TRAIN_FLAGS]) == 2
    assert f"{data}: no such file" in stderr_of(capsys)


@pytest.mark.parametrize("command", ["validate", "show", "compare", "report", "tokenize"])
def test_every_subcommand_prints_its_version_alone(command: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"dcp-plan {command} 0.")


def test_show_refuses_a_bare_step_number(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``show --steps -3`` showed step 29 alone where the README promised the last three (and
    ``--steps 3`` is step 3 while ``dcp-train --steps 3`` trains three): a bare number is refused
    with each spelling."""
    plan = tmp_path / "p.arrow"
    assert main([str(SAMPLE), "-o", str(plan), "--dp", "4", "--cp", "2",
                 "--max-tokens-per-rank", "4096", "--global-batch-size", "64", "--quiet"]) == 0
    capsys.readouterr()
    for bare, words in (("-3", "'-3:' the last 3; '-3:-2' is step -3 alone"),
                        ("3", "':3' the first 3, '3:' from step 3; '3:4' is step 3 alone"),
                        ("-1", "'-1:' the last 1; '-1:' is step -1 alone")):
        with pytest.raises(SystemExit) as e:
            main(["show", str(plan), "--steps", bare, "--json"])
        assert e.value.code == 2
        out = capsys.readouterr()
        assert out.out == ""
        assert no_traceback(out.err)
        assert f"argument --steps: expected a step range A:B, got '{bare}', a bare number: " \
               f"{words} (--step I prints one step's rows)" in out.err, out.err
    assert main(["show", str(plan), "--steps", "-3:", "--json"]) == 0
    out = capsys.readouterr()
    assert [json.loads(x)["step"] for x in out.out.splitlines()] == [29, 30, 31]
    assert out.err == ""
    # The planning page's comment says so too (the README's said "-3: the last 3").
    page = (ROOT / "docs" / "planning.md").read_text()
    assert "--steps 0:10            # per-step table ('-3:' is the last 3)" in page


def test_counts_are_refused_when_negative(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "p.arrow"
    for argv, flag in ((["--steps", "-3"], "--steps/--train-iters"),
                       (["--eval-steps", "-1"], "--eval-steps"),
                       (["--eval-interval", "-2"], "--eval-interval"),
                       (["--save-every", "-1"], "--save-every/--save-interval")):
        with pytest.raises(SystemExit) as e:
            train_main(["--plan", str(plan), *argv])
        assert e.value.code == 2
        assert f"argument {flag}: expected an integer >= 0, got -" in stderr_of(capsys)
    for argv, flag in ((["--pad-to-multiple", "-1"], "--pad-to-multiple"),
                       (["--epochs", "-1"], "--epochs")):
        with pytest.raises(SystemExit) as e:
            main([str(SAMPLE), "--dp", "2", "--max-tokens-per-rank", "4096",
                  "--global-batch-size", "32", "-o", str(plan), *argv])
        assert e.value.code == 2
        assert f"argument {flag}: expected a positive integer, got -1" in stderr_of(capsys)


@pytest.mark.slow
def test_torchtitan_runs_quiet_unless_verbose(tmp_path: Path) -> None:
    """Known upstream warnings (runtime.adapters.torchtitan.titan.KNOWN_WARNINGS) are off by
    default and shown with --verbose; a one-process torchtitan run with an evaluation, then a
    resume, prints three of them otherwise (init_distributed, validation steps, get_lr)."""
    pytest.importorskip("torchtitan")
    data = write_token_jsonl(tmp_path / "d.jsonl")
    plan = pool1_plan(main, data, tmp_path / "p.arrow")
    eval_plan = tmp_path / "e.arrow"
    assert main([str(data), "--eval", "-o", str(eval_plan), "--dp", "1",
                 "--max-tokens-per-rank", "256", "--global-batch-size", "6", "--quiet"]) == 0
    ckpt = tmp_path / "ckpt"
    base = [str(BIN / "dcp-train"), "--framework", "torchtitan", "--plan", str(plan),
            "--dataset", str(data), *TRAIN_FLAGS, "--save", str(ckpt), "--eval-plan",
            str(eval_plan), "--eval-dataset", str(data), "--eval-steps", "1"]

    def run(*extra: str) -> str:
        out = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return out.stderr

    quiet = run("--steps", "1")
    verbose = run("--steps", "2", "--resume", str(ckpt), "--verbose")
    from runtime.adapters.torchtitan.titan import KNOWN_WARNINGS

    for known in KNOWN_WARNINGS:
        assert not re.search(known.message, quiet), known.message
        assert re.search(known.message, verbose), known.message
    assert f"dcp-train: resuming from {ckpt}/step-1 at step 1" in verbose


@pytest.mark.slow
def test_megatron_runs_quiet_unless_verbose(tmp_path: Path) -> None:
    """Megatron's known warnings (runtime.adapters.megatron.compat.known_warnings) are off by
    default and shown with --verbose: a resumed one-process Megatron run prints three otherwise
    (torch's load_state_dict and ShardedTensor deprecations from dist_checkpointing's load), and
    says where it continues."""
    pytest.importorskip("megatron.core")
    data = write_token_jsonl(tmp_path / "d.jsonl")
    plan = pool1_plan(main, data, tmp_path / "p.arrow")
    ckpt = tmp_path / "ckpt"
    base = [str(BIN / "dcp-train"), "--framework", "megatron", "--plan", str(plan),
            "--dataset", str(data), *TRAIN_FLAGS]

    def run(*extra: str) -> str:
        out = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return out.stderr

    assert "Warning" not in run("--steps", "1", "--save", str(ckpt))
    quiet = run("--steps", "2", "--resume", str(ckpt))   # no --save: the next run resumes alike
    verbose = run("--steps", "2", "--resume", str(ckpt), "--verbose")
    from runtime.adapters.megatron.compat.known_warnings import KNOWN_WARNINGS

    for known in KNOWN_WARNINGS:
        assert not re.search(known.message, quiet), known.message
        assert re.search(known.message, verbose), known.message
    assert "Warning" not in quiet, quiet
    for err in (quiet, verbose):
        assert f"dcp-train: resuming from {ckpt}/step-00000001 at step 1\n" in err
