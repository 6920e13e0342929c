"""Replay a (large) plan as the runtime does and report time and peak RSS: does it scale?

What every rank does at start-up and per step, for all ranks of the pool in one process:
``runtime.data.plan_reader.PlanReader`` (memory-mapped; with ``--validate`` every invariant of
every step, as ``dcp-train`` does by default), ``check_dataset`` against the dataset's lengths
(the fingerprint), then for every step (or ``--steps`` of them, spread over the plan) every pool
rank's group in every microbatch (``StepPlan.group_for``). The replay checks what it reads: when
every step is replayed, each sample's tokens summed over its segments must equal its length
(one epoch, ``--long-sequences split``), so a replay that skipped or repeated rows fails.

Usage:
    .venv/bin/python bench/replay_scale.py PLAN LENGTHS.txt [--steps 200] [--validate]

Prints one line: steps replayed, rows, group lookups, seconds, peak RSS (``ru_maxrss``, this
process). Run it as its own process so the RSS is the replay's alone (bench/bench_scale.py
plans in a child process too).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.sources.lengths import read_lengths
from runtime.data.plan_reader import PlanReader


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("lengths", type=Path, help="the dataset the plan was made from")
    ap.add_argument("--steps", type=int, default=0,
                    help="replay this many steps, evenly spread (0: every step)")
    ap.add_argument("--validate", action="store_true",
                    help="validate every step on open, as dcp-train does by default")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    lengths = np.asarray(read_lengths(args.lengths).lengths, dtype=np.int64)
    t_read = time.perf_counter() - t0
    t1 = time.perf_counter()
    with PlanReader(args.plan, validate=args.validate) as reader:
        reader.check_dataset(lengths)
        t_open = time.perf_counter() - t1
        n = reader.num_steps
        picks = (np.arange(n) if not args.steps or args.steps >= n
                 else np.unique(np.linspace(0, n - 1, args.steps).round().astype(np.int64)))
        pool = reader.pool_size
        rows = lookups = 0
        got = np.zeros(len(lengths), dtype=np.int64)
        t2 = time.perf_counter()
        for i in picks.tolist():
            plan = reader.step(i)
            for m in range(plan.num_microbatches):
                for r in range(pool):
                    g = plan.group_for(m, r)
                    lookups += 1
                    if g.cp_rank == 0:  # every member reads the same rows: count them once
                        real = g.sample_index >= 0
                        np.add.at(got, g.sample_index[real], g.num_tokens[real])
            rows += len(plan.sample_index)
        t_replay = time.perf_counter() - t2
        if len(picks) == n:
            # Every sample the plan holds (one epoch, --long-sequences split) exactly once.
            bad = np.flatnonzero(got != lengths)
            if len(bad):
                s = int(bad[0])
                raise SystemExit(f"sample {s}: replayed {int(got[s])} tokens, has {lengths[s]}")
        elif np.any(got > lengths):
            s = int(np.argmax(got > lengths))
            raise SystemExit(f"sample {s}: replayed {int(got[s])} tokens, has {lengths[s]}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"steps {len(picks)} of {n}  rows {rows:,}  group lookups {lookups:,}  "
          f"read lengths {t_read:.1f} s  open{'+validate' if args.validate else ''}"
          f"+fingerprint {t_open:.1f} s  replay {t_replay:.1f} s "
          f"({t_replay / max(len(picks), 1) * 1e3:.2f} ms/step)  peak RSS {rss:,.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
