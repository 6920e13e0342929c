"""``bench/bench_engines.py`` runs end to end at tiny sizes and its two engines agree.

A smoke test, not a measurement: a few hundred lengths on a pool of 4, one worker. It checks
that the script still runs against the planner's current API (``PlanStream``, ``plan_steps``,
``write_plan_stream``), that ``--engine ray`` and ``--engine local`` wrote byte-identical plans
(the script exits non-zero otherwise) and that both tables are printed. It runs the script in a
fresh process: the driver part starts and stops a local Ray of its own, which must not touch
this test process. Skipped where the ``ray`` extra is not installed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.bench.helpers import run_bench, write_lengths

pytest.importorskip("ray")


@pytest.mark.slow
def test_bench_engines_runs_and_both_engines_write_the_same_bytes(tmp_path: Path) -> None:
    lengths = write_lengths(tmp_path / "lengths.txt", 400)
    work = tmp_path / "work"
    out = run_bench("bench_engines.py", "--lengths", str(lengths), "--workers", "1", "--pool",
                    "4", "--effort", "fast", "--workdir", str(work))
    assert "lengths.txt: 400 sequences, 7 steps, N=4, effort fast, 1 workers" in out
    rows = {m.group(1): m.group(2) for m in re.finditer(
        r"^\s*(local|ray)\s+[\d.]+\s+[\d,.]+\s+[\d,]+\s+(\S+)\s*$", out, re.M)}
    assert rows == {"local": "-", "ray": "True"}, out
    assert re.search(r"^\s*ceiling\s+[\d.]+\s+[\d,]+\s+[\d,]+\s*$", out, re.M), out
    assert (work / "local.arrow").read_bytes() == (work / "ray.arrow").read_bytes()
