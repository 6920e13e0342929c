"""How the planner's cost grows with dataset and pool size: seq/s, peak RSS, time over the bound.

Each run is a whole ``dcp-plan`` process (start-up, reading, planning, validation and writing,
as a user runs it) on the Wikipedia lengths repeated to the dataset size, C = 16384, global batch
16 x N, ``--long-sequences split``; peak RSS is the process's own (``os.wait4``). One warm-up
plan first compiles or loads the numba kernels, so no run pays for compilation.

Usage:
    .venv/bin/python bench/bench_scale.py --lengths FILE [--sizes 1,4,20] [--pools 16,64,256,1024]
        [--efforts balanced,fast] [--workdir DIR]

``--sizes`` are millions of sequences (the file is repeated, then cut); ``--runs`` lists
explicit SIZE:POOL:EFFORT triples instead of the full grid.
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planner.planfile.io import PlanFile


def _dataset(lengths: Path, millions: float, workdir: Path) -> Path:
    out = workdir / f"lengths_{millions:g}M.txt"
    if not out.exists():
        text = (gzip.decompress(lengths.read_bytes()).decode() if lengths.suffix == ".gz"
                else lengths.read_text())
        lines = text.split()
        want = int(millions * 1_000_000)
        with open(out, "w") as f:
            done = 0
            while done < want:
                chunk = lines[:want - done]
                f.write("\n".join(chunk) + "\n")
                done += len(chunk)
    return out


def _run(data: Path, pool: int, effort: str, out: Path) -> tuple[float, float, int]:
    """(wall s, CPU s, peak RSS bytes) of one dcp-plan process."""
    cp = 4 if pool % 4 == 0 else 1
    cmd = [str(Path(sys.executable).with_name("dcp-plan")), str(data), "-o", str(out),
           "--dp", str(pool // cp), "--cp", str(cp), "--max-tokens-per-rank", "16384",
           "--global-batch-size", str(16 * pool), "--long-sequences", "split",
           "--effort", effort, "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"dcp-plan failed: {' '.join(cmd)}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=Path, required=True,
                    help="one length per line (.txt, or .txt.gz)")
    ap.add_argument("--sizes", default="1,4,20", help="dataset sizes, millions of sequences")
    ap.add_argument("--pools", default="16,64,256,1024", help="pool sizes N")
    ap.add_argument("--efforts", default="balanced,fast", help="solver efforts")
    ap.add_argument("--runs", default="", help="SIZE:POOL:EFFORT,... instead of the grid")
    ap.add_argument("--workdir", type=Path, default=None, help="datasets and plans go here")
    args = ap.parse_args(argv)
    if args.runs:
        runs = [(float(s), int(p), e) for s, p, e in (r.split(":") for r in args.runs.split(","))]
    else:
        runs = [(float(s), int(p), e) for s in args.sizes.split(",")
                for p in args.pools.split(",") for e in args.efforts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        warm = _dataset(args.lengths, 0.02, work)
        _run(warm, 16, "balanced", work / "warm.arrow")
        print(f"{'seqs':>5} {'N':>5} {'effort':>8} {'wall s':>7} {'cpu s':>7} {'seq/s':>9} "
              f"{'seq/cpu-s':>9} {'RSS MB':>7} {'T/tight':>8} {'worst step':>10} {'steps':>6}")
        for size, pool, effort in runs:
            data = _dataset(args.lengths, size, work)
            out = work / "plan.arrow"
            wall, cpu, rss = _run(data, pool, effort, out)
            with PlanFile(out) as pf:
                s = pf.header.stats
            n = int(size * 1_000_000)
            print(f"{size:>4g}M {pool:>5} {effort:>8} {wall:>7.1f} {cpu:>7.1f} {n / wall:>9,.0f} "
                  f"{n / cpu:>9,.0f} {rss / 2**20:>7.0f} {s['time_over_tight_bound']:>8.4f} "
                  f"{s['time_over_tight_bound_max']:>10.4f} {s['num_steps']:>6}", flush=True)
            out.unlink()


if __name__ == "__main__":
    main()
