"""The launcher checks the plan's heaviest microbatch against the host before Megatron-LM's
first step, as ``dcp-train`` does (issue 33, item 5): with no memory available (``probe.py
no-host-memory``) it refuses, naming the step, the microbatch and both figures, before any
iteration runs; ``--no-memory-check`` trains the same job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.adapters.megatron_lm.launch import (
    launch,
    lines,
    make_data,
    need_megatron_training,
    ok,
)

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def test_a_plan_that_does_not_fit_is_refused_before_the_first_iteration(tmp_path: Path) -> None:
    need_megatron_training()
    data = make_data(tmp_path)
    plan, log = data["pool1"], tmp_path / "run.jsonl"
    one = ["--train-iters", "1"]
    run = launch(1, plan, data["data"], log, extra=one, probe="no-host-memory")
    assert run.returncode != 0
    err = run.stderr
    assert f"dcp launcher: error: {plan}: step 0 microbatch " in err, err[-3000:]
    assert "more than this host's available memory shared by its 1 rank(s) (0.00 GiB " \
        "available)" in err
    assert "give the launcher --no-memory-check" in err
    assert "]: Traceback" not in err  # no rank raised (torchrun reports the exit itself)
    assert not log.exists() or lines(log)[0] == []  # no iteration ran
    ok(launch(1, plan, data["data"], log, extra=one, own=["--no-memory-check"],
              probe="no-host-memory"))
    assert [s["step"] for s in lines(log)[0]] == [0]
