"""Side by side: whole `dcp-plan` processes of an earlier revision and of this checkout.

The machines this project runs on are noisy, so speed changes are measured as ratios within one
run: the planner of ``--base`` (a git revision, exported with ``git archive`` into a temporary
directory and put first on PYTHONPATH) and this checkout's `dcp-plan` run one after the other,
``--repeats`` times each, and the table shows the fastest of each (wall and CPU seconds, whole
process), their CPU ratio, this checkout's sequences per second (wall) and per CPU-second,
both plans' simulated time over the tight bound (stats ``time_over_tight_bound``: the quality
a speed change must keep) and whether the two plans are byte-identical. Each variant first
plans once untimed (the base's export compiles its numba kernels then), and the load average
is printed before and after, to say how busy the host was.

Usage:
    .venv/bin/python bench/bench_ab.py --base REV --lengths FILE [--runs 64:fast,1024:balanced]
        [--repeats 3]

Each run is N:EFFORT: dp N/4 x cp 4 (dp N when N < 4), C = 16384, global batch 16 N,
``--long-sequences split``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.revision import base_variant, check_base, export_planner, this_variant  # noqa: E402


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"bench_ab: failed: {' '.join(cmd)}")
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def _load() -> str:
    """The host's 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--lengths", type=Path, required=True, help="dataset (any dcp-plan input)")
    ap.add_argument("--runs", default="64:fast,256:fast,1024:fast,64:balanced,256:balanced,"
                    "1024:balanced", help="N:EFFORT,...")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        export_planner(args.base, work / "base", "bench_ab")
        check_base(work / "base", "bench_ab")
        variants = {"base": base_variant(work / "base"), "this": this_variant()}
        runs = [(int(n), e) for n, e in (r.split(":") for r in args.runs.split(","))]

        def plan(name: str, pool: int, effort: str) -> tuple[float, float]:
            cmd, env = variants[name]
            out = work / f"{name}.arrow"
            out.unlink(missing_ok=True)
            cp = 4 if pool % 4 == 0 else 1
            return _run(cmd + [str(args.lengths.resolve()), "-o", str(out), "--dp",
                               str(pool // cp), "--cp", str(cp), "--max-tokens-per-rank",
                               "16384", "--global-batch-size", str(16 * pool),
                               "--long-sequences", "split", "--effort", effort, "--quiet"],
                        env, work)

        for name in variants:
            plan(name, *runs[0])
        print(f"load average before: {_load()}")
        print(f"{'N':>5} {'effort':>8} {'base wall':>9} {'base cpu':>8} {'this wall':>9} "
              f"{'this cpu':>8} {'cpu ratio':>9} {'this seq/s':>10} {'seq/cpu-s':>10} "
              f"{'base T/tight':>12} {'this T/tight':>12}  plans")
        from planner.planfile.io import PlanFile

        for pool, effort in runs:
            best = {k: (float("inf"), float("inf")) for k in variants}
            for _ in range(args.repeats):
                for name in variants:
                    wall, cpu = plan(name, pool, effort)
                    best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
            tight = {}
            for name in variants:
                with PlanFile(work / f"{name}.arrow") as pf:
                    samples = pf.header.dataset.num_samples
                    tight[name] = pf.header.stats["time_over_tight_bound"]
            same = (work / "base.arrow").read_bytes() == (work / "this.arrow").read_bytes()
            (bw, bc), (tw, tc) = best["base"], best["this"]
            print(f"{pool:>5} {effort:>8} {bw:>9.2f} {bc:>8.2f} {tw:>9.2f} {tc:>8.2f} "
                  f"{tc / bc:>9.3f} {samples / tw:>10,.0f} {samples / tc:>10,.0f} "
                  f"{tight['base']:>12.6f} {tight['this']:>12.6f}  "
                  f"{'identical' if same else 'DIFFER'}", flush=True)
        print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
