"""``bench/bench_stages.py`` runs end to end and accounts for a run's CPU by stage.

A smoke test, not a measurement: 20,000 lengths (enough steps for the kernel to read above
the printed millisecond), one pool, one repeat, this checkout.
"""

from __future__ import annotations

from pathlib import Path

from tests.bench.helpers import run_bench, write_lengths


def test_bench_stages_prints_every_stage(tmp_path: Path) -> None:
    lengths = write_lengths(tmp_path / "lengths.txt", 20_000)
    out = run_bench("bench_stages.py", "--lengths", str(lengths), "--runs", "8:fast",
                    "--repeats", "1")
    lines = {line[2:30].strip(): line for line in out.splitlines()
             if line.startswith("  ")}
    for stage in ("in-process CPU s", "kernel passes (solve_step)", "validate + copy pass",
                  "- coverage"):
        assert stage in lines, out
    total = float(lines["in-process CPU s"].split()[-1])
    kernel = float(lines["kernel passes (solve_step)"].split()[-1])
    assert 0 < kernel <= total
