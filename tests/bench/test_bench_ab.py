"""``bench/bench_ab.py`` runs end to end: HEAD's planner against this checkout's, same plan.

A smoke test, not a measurement: a few hundred lengths on pools of 4 and 8, one repeat. The
base is ``HEAD`` exported with ``git archive``, so unless the working tree changed the planner
since HEAD, both plans must be byte-identical (the table says so per run).
"""

from __future__ import annotations

from pathlib import Path

from tests.bench.helpers import run_bench, write_lengths


def test_bench_ab_compares_whole_processes(tmp_path: Path, planner_changed: bool) -> None:
    lengths = write_lengths(tmp_path / "lengths.txt", 400)
    out = run_bench("bench_ab.py", "--base", "HEAD", "--lengths", str(lengths),
                    "--runs", "4:fast,8:balanced", "--repeats", "1")
    rows = [line.split() for line in out.splitlines()
            if line.split() and line.split()[0].isdigit()]
    assert [r[:2] for r in rows] == [["4", "fast"], ["8", "balanced"]]
    if not planner_changed:
        assert all(r[-1] == "identical" for r in rows), out
