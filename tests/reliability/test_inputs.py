"""Every input checked (issue 22): plans are not data, special files are not data.

Before: a plan file given as a dataset, or a plan written into a dataset directory and picked
up by the next ``dcp-plan DIR``, was read as data (its ``num_tokens`` column); a FIFO input with
data was "empty"; ``validate`` on a FIFO, a directory or a device said "no such plan file"; a
FIFO as the cost model blocked the run.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from planner.cli import main as plan_main
from planner.notebook.view import read_plan
from tests.reliability.helpers import PLAN_FLAGS, SAMPLE, no_traceback, run_cli


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert no_traceback(err)
    return err


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
        err = _err(capsys)
        assert f"dcp-plan: notice: {first}: a dcp plan in {item!r}, not a dataset file" in err
        files = read_plan(again).header.dataset.files
        assert [f["path"] for f in files] == [str(shards / "a.jsonl")]
        assert read_plan(again).header.dataset.fingerprint == \
            read_plan(first).header.dataset.fingerprint
    # Named as the dataset: refused.
    assert plan_main([str(first), "-o", str(tmp_path / "x.arrow"), *PLAN_FLAGS]) == 2
    assert f"{first}: is a dcp plan, not a dataset" in _err(capsys)
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(first, only / "p.arrow")
    assert plan_main([str(only), "-o", str(tmp_path / "x.arrow"), *PLAN_FLAGS]) == 2
    assert "holds only dcp plans" in _err(capsys)


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
        assert f"{plan}: is {what}, not a regular file; a plan must be" in _err(capsys)
    try:
        os.mknod(tmp_path / "zero.jsonl", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    except OSError:
        return  # not root: no device node (the FIFO cases above are the same check)
    zero = tmp_path / "zero.jsonl"
    assert plan_main([str(zero), "-o", str(tmp_path / "p.arrow"), *PLAN_FLAGS]) == 2
    assert f"{zero}: is a character device, not a regular file" in _err(capsys)
    assert plan_main(["validate", str(zero)]) == 2
    assert "is a character device, not a regular file; a plan must be" in _err(capsys)
