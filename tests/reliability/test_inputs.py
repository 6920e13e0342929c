"""Every input checked (issue 22): plans are not data, special files are not data.

Before: a plan file given as a dataset, or a plan written into a dataset directory and picked
up by the next ``dcp-plan DIR``, was read as data (its ``num_tokens`` column); a FIFO input with
data was "empty"; ``validate`` on a FIFO, a directory or a device said "no such plan file"; a
FIFO as the cost model blocked the run.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main as plan_main
from planner.notebook.view import read_plan
from tests.reliability.helpers import PLAN_FLAGS, SAMPLE, no_traceback, run_cli, stderr_of


def test_a_plan_is_never_read_as_a_dataset(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(SAMPLE, shards / "a.jsonl")
    first = shards / "plan.arrow"  # written into the dataset's own directory
    assert plan_main([str(shards), "-o", str(first), *PLAN_FLAGS]) == 0
    capsys.readouterr()
    # The next plan of the directory (and of a glob) leaves the plan out, saying so.
    for item in (str(shards), str(shards / "*")):
        again = tmp_path / "again.arrow"
        assert plan_main([item, "-o", str(again), *PLAN_FLAGS]) == 0
        err = stderr_of(capsys)
        assert f"dcp-plan: notice: {first}: a dcp plan in {item!r}, not a dataset file" in err
        files = read_plan(again).header.dataset.files
        assert [f["path"] for f in files] == [str(shards / "a.jsonl")]
        assert read_plan(again).header.dataset.fingerprint == \
            read_plan(first).header.dataset.fingerprint
    # Named as the dataset: refused.
    assert plan_main([str(first), "-o", str(tmp_path / "x.arrow"), *PLAN_FLAGS]) == 2
    assert f"{first}: is a dcp plan, not a dataset" in stderr_of(capsys)
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(first, only / "p.arrow")
    assert plan_main([str(only), "-o", str(tmp_path / "x.arrow"), *PLAN_FLAGS]) == 2
    assert "holds only dcp plans" in stderr_of(capsys)


def test_special_files_are_refused_as_inputs(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    r = run_cli(str(fifo), "-o", str(tmp_path / "p.arrow"), *PLAN_FLAGS, timeout=60)
    assert r.returncode == 2
    assert f"{fifo}: is a FIFO (named pipe), not a regular file; a dataset file must be" in \
        r.stderr
    assert "empty" not in r.stderr
    cm = tmp_path / "cm.json"
    os.mkfifo(cm)
    r = run_cli(str(SAMPLE), "-o", str(tmp_path / "p.arrow"), *PLAN_FLAGS, "--cost-model",
                str(cm), timeout=60)
    assert r.returncode == 2
    assert f"{cm}: is a FIFO (named pipe), not a regular file; a cost model must be" in r.stderr
    for plan, what in ((tmp_path, "a directory"), (fifo, "a FIFO (named pipe)")):
        assert plan_main(["validate", str(plan)]) == 2
        assert f"{plan}: is {what}, not a regular file; a plan must be" in stderr_of(capsys)
    try:
        os.mknod(tmp_path / "zero.jsonl", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    except OSError:
        return  # not root: no device node (the FIFO cases above are the same check)
    zero = tmp_path / "zero.jsonl"
    assert plan_main([str(zero), "-o", str(tmp_path / "p.arrow"), *PLAN_FLAGS]) == 2
    assert f"{zero}: is a character device, not a regular file" in stderr_of(capsys)
    assert plan_main(["validate", str(zero)]) == 2
    assert "is a character device, not a regular file; a plan must be" in stderr_of(capsys)


def _megatron_with(tmp_path: Path, name: str, edit: str) -> Path:
    """A Megatron pair of 8 int32 sequences whose index is edited: sequence 3's pointer made
    negative, not a multiple of 4, or before sequence 2's end."""
    from planner.sources.lengths import write_megatron_dataset

    prefix = tmp_path / name
    write_megatron_dataset(prefix, [list(range(1, 20 + i)) for i in range(8)], dtype=np.int32)
    idx = Path(f"{prefix}.idx")
    raw = bytearray(idx.read_bytes())
    count = 8
    at = 34 + 4 * count + 8 * 3  # header (9+8+1+8+8 bytes), sizes int32[8], pointer 3
    pointer = int.from_bytes(raw[at:at + 8], "little", signed=True)
    new = {"negative": -4 * 21, "misaligned": pointer + 2, "overlap": pointer - 8}[edit]
    raw[at:at + 8] = new.to_bytes(8, "little", signed=True)
    idx.write_bytes(bytes(raw))
    return prefix


@pytest.mark.parametrize(("edit", "problem"), [
    ("negative", "byte pointer -84 is negative"),
    ("misaligned", "byte pointer 242 is not a multiple of the 4-byte token size (int32)"),
    ("overlap", "starts at byte 232, before sequence 2 ends (byte 240)"),
])
def test_megatron_index_pointers_are_checked(tmp_path: Path, edit: str, problem: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a negative pointer planned and trained on the end of the .bin (numpy's negative
    indexing); a misaligned one was rounded down."""
    from runtime.data.tokens import open_token_source

    prefix = _megatron_with(tmp_path, "ds", edit)
    assert plan_main([str(prefix), "-o", str(tmp_path / "p.arrow"), *PLAN_FLAGS]) == 2
    err = stderr_of(capsys)
    assert f"{prefix}.idx: sequence 3: {problem}" in err
    with pytest.raises(ValueError, match=re.escape(f"sequence 3: {problem}")):
        open_token_source(str(prefix))


def test_blend_weights_near_the_float_limit(tmp_path: Path) -> None:
    """Before: ``--data-path 1e308 A 1e308 B``: 'cannot convert float NaN to integer'."""
    from planner.sources.dataset import blend_counts

    assert blend_counts([1e308, 1e308], 64) == [32, 32]
    assert blend_counts([1e308, 5e307], 3) == [2, 1]
    assert blend_counts([0.3, 0.7], 64) == [19, 45]  # finite sums: the formula as before
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    shutil.copy(SAMPLE, a)
    shutil.copy(SAMPLE, b)
    out = tmp_path / "p.arrow"
    assert plan_main(["--data-path", "1e308", str(a), "1e308", str(b), "-o", str(out),
                      *PLAN_FLAGS]) == 0
    assert read_plan(out).header.global_batch["blend"]["samples_per_step"] == [50, 50]


def test_seeds_outside_64_bits_and_int32_groups_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``--seed 2**64`` aliased seed 0 (taken modulo 2^64), ``--seed -1`` seed 2^64-1;
    a group of 4 x (2^31-1) tokens planned although the runtime's int32 cu_seqlens cannot hold
    it."""
    from planner.config import ParallelConfig, PlannerConfig

    out = tmp_path / "p.arrow"
    for seed in (str(2**64), "-1"):
        with pytest.raises(SystemExit):
            plan_main([str(SAMPLE), "-o", str(out), *PLAN_FLAGS, "--seed", seed])
        assert "expected a seed in 0..2^64-1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seed must be an integer in 0..2"):
        PlannerConfig(parallel=ParallelConfig(dp=1, cp=1), capacity_tokens_per_rank=64,
                      global_batch_size=1, seed=2**64)
    assert plan_main([str(SAMPLE), "-o", str(out), "--dp", "1", "--cp", "4",
                      "--max-tokens-per-rank", str(2**31 - 1), "--global-batch-size", "8",
                      "--quiet"]) == 2
    err = stderr_of(capsys)
    assert "a group of 4 ranks holds up to 4 x 2147483647 = 8589934588 padded tokens, more " \
           "than the 2147483647 that int32 offsets (cu_seqlens) address; lower " \
           "--max-tokens-per-rank to at most 536870911" in err
    assert not out.exists()


def test_engine_ray_without_ray_exits_2(tmp_path: Path) -> None:
    """Before: exit 1 (a SystemExit with a message), not the 2 of every other user error."""
    import subprocess
    import sys

    from tests.reliability.helpers import ROOT

    code = ("import sys; sys.modules['ray'] = None\n"
            "from planner.cli import main\n"
            f"sys.exit(main({[str(SAMPLE), '-o', str(tmp_path / 'x.arrow'), *PLAN_FLAGS]!r}"
            " + ['--engine', 'ray']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "dcp-plan: error: --engine ray needs Ray, which is not installed" in proc.stderr
    assert no_traceback(proc.stderr)
