"""``bench/bench_scale.py --base`` runs end to end: HEAD's rows beside this checkout's.

A smoke test, not a measurement: 1,000 lengths on a pool of 8, one repeat. Unless the working
tree changed the planner since HEAD, the two plans must be byte-identical and their stats equal.
"""

from __future__ import annotations

from pathlib import Path

from tests.bench.helpers import run_bench, write_lengths


def test_bench_scale_puts_base_rows_beside_this(tmp_path: Path, planner_changed: bool) -> None:
    lengths = write_lengths(tmp_path / "lengths.txt", 1_000)
    out = run_bench("bench_scale.py", "--lengths", str(lengths), "--runs", "0.001:8:fast",
                    "--base", "HEAD", "--workdir", str(tmp_path / "work"))
    rows = [line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("base", "this")]
    assert [r[:4] for r in rows] == [["base", "0.001M", "8", "fast"],
                                     ["this", "0.001M", "8", "fast"]], out
    assert rows[0][9:12] == rows[1][9:12], out  # T/tight, worst step, steps
    if not planner_changed:
        assert rows[1][-1] == "identical", out
