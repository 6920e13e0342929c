"""How the planner's cost grows with dataset and pool size: seq/s, peak RSS, time over the bound.

Each run is a whole ``dcp-plan`` process (start-up, reading, planning, validation and writing,
as a user runs it) on the Wikipedia lengths repeated to the dataset size, C = 16384, global batch
16 x N, ``--long-sequences split``; peak RSS is the process's own (``os.wait4``). One warm-up
plan first compiles or loads the numba kernels, so no run pays for compilation.

``--base REV`` puts an earlier revision's rows beside this checkout's, in the same run: each row
runs the base's ``dcp-plan`` (its ``planner/`` exported with ``git archive``, bench/revision.py)
and then this checkout's, ``--repeats`` times alternately, keeping the fastest wall and CPU time
of each; the "plans" column says whether the two plans are byte-identical. The load average is
printed before and after.

Usage:
    .venv/bin/python bench/bench_scale.py --lengths FILE [--sizes 1,4,20] [--pools 16,64,256,1024]
        [--efforts balanced,fast] [--workdir DIR] [--base REV] [--repeats 1]

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

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.revision import base_variant, check_base, export_planner, this_variant  # noqa: E402
from planner.planfile.io import PlanFile  # noqa: E402

Variant = tuple[list[str], dict[str, str]]


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


def _run(variant: Variant, data: Path, pool: int, effort: str,
         out: Path) -> tuple[float, float, int]:
    """(wall s, CPU s, peak RSS bytes) of one dcp-plan process."""
    cp = 4 if pool % 4 == 0 else 1
    cmd = [*variant[0], str(data), "-o", str(out),
           "--dp", str(pool // cp), "--cp", str(cp), "--max-tokens-per-rank", "16384",
           "--global-batch-size", str(16 * pool), "--long-sequences", "split",
           "--effort", effort, "--quiet"]
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=variant[1])
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
    ap.add_argument("--base", default="", help="git revision whose rows go beside these")
    ap.add_argument("--repeats", type=int, default=1, help="processes per row and revision")
    args = ap.parse_args(argv)
    if args.runs:
        runs = [(float(s), int(p), e) for s, p, e in (r.split(":") for r in args.runs.split(","))]
    else:
        runs = [(float(s), int(p), e) for s in args.sizes.split(",")
                for p in args.pools.split(",") for e in args.efforts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        variants: dict[str, Variant] = {"this": this_variant()}
        if args.base:
            export_planner(args.base, Path(tmp) / "base", "bench_scale")
            check_base(Path(tmp) / "base", "bench_scale")
            variants = {"base": base_variant(Path(tmp) / "base"), **variants}
        warm = _dataset(args.lengths, 0.02, work)
        for variant in variants.values():
            for effort in sorted({e for _, _, e in runs}):
                _run(variant, warm, 16, effort, work / "warm.arrow")
        print(f"load average before: {_load()}")
        print(f"{'rev':>4} {'seqs':>5} {'N':>5} {'effort':>8} {'wall s':>7} {'cpu s':>7} "
              f"{'seq/s':>9} {'seq/cpu-s':>9} {'RSS MB':>7} {'T/tight':>8} {'worst step':>10} "
              f"{'steps':>6}" + ("  plans" if args.base else ""))
        for size, pool, effort in runs:
            data = _dataset(args.lengths, size, work)
            best = {k: (float("inf"), float("inf"), 0) for k in variants}
            for _ in range(args.repeats):
                for name, variant in variants.items():
                    wall, cpu, rss = _run(variant, data, pool, effort, work / f"{name}.arrow")
                    w, c, r = best[name]
                    best[name] = (min(w, wall), min(c, cpu), max(r, rss))
            same = ""
            if args.base:
                same = ("  identical" if (work / "base.arrow").read_bytes()
                        == (work / "this.arrow").read_bytes() else "  DIFFER")
            n = int(size * 1_000_000)
            for name in variants:
                with PlanFile(work / f"{name}.arrow") as pf:
                    s = pf.header.stats
                wall, cpu, rss = best[name]
                print(f"{name:>4} {size:>4g}M {pool:>5} {effort:>8} {wall:>7.1f} {cpu:>7.1f} "
                      f"{n / wall:>9,.0f} {n / cpu:>9,.0f} {rss / 2**20:>7.0f} "
                      f"{s['time_over_tight_bound']:>8.4f} {s['time_over_tight_bound_max']:>10.4f} "
                      f"{s['num_steps']:>6}" + (same if name == "this" else ""), flush=True)
            for name in variants:
                (work / f"{name}.arrow").unlink()
        print(f"load average after: {_load()}")


def _load() -> str:
    """The host's 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
