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
import sys
from pathlib import Path

import pytest

from planner.cli import main
from runtime.train.cli import main as train_main
from tests.reliability.helpers import (
    SAMPLE,
    no_traceback,
)

BIN = Path(sys.executable).parent


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert no_traceback(err)
    return err


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
    err = _err(capsys)
    assert "plan built for world_size=4 (dp=2, cp=2, tp=1, pp=1), got 1: launch torchrun " \
           "--nproc-per-node 4 (dp 2 x cp 2 x tp 1 x pp 1 = 4 processes" in err
