"""Planner throughput and quality on a real length file (default: the FlexSP Wikipedia lengths).

Times each phase (read, make_plan, record batches, write, validate against the written file) and
prints sequences/s per phase and overall, then the plan's quality numbers from its header stats.
A warm-up plan on a small prefix runs first so numba's one-time compilation (cached on disk after
the first run) is not counted.

Usage:
    .venv/bin/python bench/bench_planner.py [--lengths FILE] [--dp 8] [--cp 2] [--capacity 16384]
        [--global-batch 1024] [--long-sequences split] [--effort balanced] [--workers 1]
        [--out plan.arrow]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import WIKIPEDIA_PATH, read_length_file  # noqa: E402
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import PlanFile, write_plan
from planner.planfile.validate import validate
from planner.sources.lengths import LengthTable

DEFAULT_LENGTHS = WIKIPEDIA_PATH


def read_lengths(path: Path) -> LengthTable:
    """One integer per line (plain or .gz text)."""
    lengths = read_length_file(path)
    return LengthTable(path=str(path), format="text", lengths=lengths,
                       skipped=np.zeros(0, dtype=np.int64))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=Path, default=DEFAULT_LENGTHS, help="one length per line")
    ap.add_argument("--dp", type=int, default=8, help="data-parallel size")
    ap.add_argument("--cp", type=int, default=2, help="static CP size (pool = dp x cp)")
    ap.add_argument("--capacity", type=int, default=16384, help="C, tokens per rank")
    ap.add_argument("--global-batch", type=int, default=1024, help="samples per step")
    ap.add_argument("--long-sequences", default="split", help="error, split, truncate, drop")
    ap.add_argument("--effort", default="balanced", help="fast, balanced, max")
    ap.add_argument("--workers", type=int, default=1, help="planner worker processes")
    ap.add_argument("--out", type=Path, default=None, help="plan path (default: a temp dir)")
    args = ap.parse_args(argv)

    config = PlannerConfig(
        parallel=ParallelConfig(dp=args.dp, cp=args.cp), capacity_tokens_per_rank=args.capacity,
        global_batch_size=args.global_batch, long_sequences=args.long_sequences,
        effort=args.effort, workers=args.workers)
    cost = load_cost_model()

    # Warm-up: compile (or load from numba's cache) every kernel before timing.
    warm = read_lengths(args.lengths)
    make_plan(LengthTable(path=warm.path, format=warm.format, lengths=warm.lengths[:5000],
                          skipped=warm.skipped), config, cost)

    # Wall and CPU seconds per phase: on a shared 2-core machine CPU time is the steadier number.
    timings: dict[str, tuple[float, float]] = {}
    clock = (time.perf_counter(), time.process_time())

    def lap(name: str) -> None:
        nonlocal clock
        now = (time.perf_counter(), time.process_time())
        timings[name] = (now[0] - clock[0], now[1] - clock[1])
        clock = now

    begin = clock
    table = read_lengths(args.lengths)
    lap("read")
    plan = make_plan(table, config, cost)
    lap("make_plan")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "plan.arrow"
        batches = list(plan.record_batches())
        lap("batches")
        # check=False: validation is timed on its own below, on the file as written.
        write_plan(out, plan.header, batches, check=False)
        lap("write")
        with PlanFile(out) as pf:
            validate(pf.header, pf, table.lengths, source=str(out))
        lap("validate")
        size_mb = out.stat().st_size / 2**20
    timings["total"] = (time.perf_counter() - begin[0], time.process_time() - begin[1])

    n = len(table.lengths)
    s = plan.header.stats
    print(f"lengths: {args.lengths} ({n:,} samples, {int(table.lengths.sum()):,} tokens)")
    print(f"config: dp={args.dp} cp={args.cp} C={args.capacity} global_batch={args.global_batch}"
          f" long_sequences={args.long_sequences} effort={args.effort} workers={args.workers};"
          f" plan {size_mb:.1f} MiB")
    print(f"{'phase':<10} {'wall s':>8} {'sequences/s':>14} {'cpu s':>8} {'seq/cpu-s':>14}")
    for name, (wall, cpu) in timings.items():
        print(f"{name:<10} {wall:8.3f} {n / wall:14,.0f} {cpu:8.3f} {n / max(cpu, 1e-9):14,.0f}")
    mb = s["microbatches_per_step"]
    print(f"steps {s['num_steps']}, microbatches/step min {mb['min']} mean {mb['mean']:.2f} "
          f"max {mb['max']}")
    print(f"simulated {s['simulated_seconds']:.1f} s, lower bound {s['lower_bound_seconds']:.1f} s,"
          f" ratio {s['simulated_seconds'] / s['lower_bound_seconds']:.4f}; malleable bound "
          f"{s['malleable_lower_bound_seconds']:.1f} s, ratio "
          f"{s['simulated_seconds'] / s['malleable_lower_bound_seconds']:.4f}")
    print(f"slot fill {s['slot_fill']:.4f}, padding overhead {s['padding_overhead']:.6f}, "
          f"alignment padding {s['alignment_padding_tokens']:,} tokens, "
          f"filler rows {s['filler_rows']:,}")
    print(f"groups per size {s['cp_size_groups']}, split samples {len(s['split_samples'])}")


if __name__ == "__main__":
    main()
