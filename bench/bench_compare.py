"""How far ``dcp-plan compare``'s sampled figures are from planning every step.

For each setup (pool x capacity), plans every step once (``--sample-steps 0``) and then
``--sample`` steps under ``--seeds`` different samples, and prints per figure the mean and the
largest relative error over the samples, and how often the reported 95% interval of the mean
step time held the full plan's value.

Usage:
    .venv/bin/python bench/bench_compare.py --lengths data/workloads/flexsp_wikipedia_lengths.txt.gz
        [--setups 16:16384,64:16384,256:32768] [--cp 4,8] [--sample 128] [--seeds 10]
"""

from __future__ import annotations

import argparse
import gzip
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from planner.compare import Result, Setup, evaluate
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.sources.lengths import LengthTable


def _figures(r: Result, cps: tuple[int, ...]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"s/step": r.step_seconds, "tokens/s": r.tokens_per_second,
                                    "vs Megatron": r.vs_megatron, "padding": r.padding,
                                    "idle": r.idle}
    for c in cps:  # over the steps static CP can run (the planned steps' share of those)
        out[f"vs cp{c}"] = r.vs_static_cp[c]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=Path, required=True, help="one length per line")
    ap.add_argument("--setups", default="16:16384,64:16384,256:32768", help="N:C,...")
    ap.add_argument("--cp", default="4,8", help="static CP sizes")
    ap.add_argument("--global-batch-size", type=int, default=1024)
    ap.add_argument("--sample", type=int, default=128, help="steps per sampled run")
    ap.add_argument("--seeds", type=int, default=10, help="samples per setup")
    args = ap.parse_args(argv)
    raw = gzip.decompress(args.lengths.read_bytes()) if args.lengths.suffix == ".gz" \
        else args.lengths.read_bytes()
    lengths = np.array(raw.split(), dtype=np.int64)
    table = LengthTable(path=str(args.lengths), format="text", lengths=lengths,
                        skipped=np.zeros(0, np.int64))
    cost = load_cost_model("default")
    cps = tuple(int(c) for c in args.cp.split(","))
    base = PlannerConfig(parallel=ParallelConfig(dp=1, cp=1), capacity_tokens_per_rank=1,
                         global_batch_size=args.global_batch_size, long_sequences="split")
    print(f"{'setup':>12} {'figure':>12} {'full':>12} {'mean |err|':>10} {'max |err|':>10} "
          f"{'in 95% CI':>9} {'full s':>7} {'sampled s':>9}")
    for item in args.setups.split(","):
        n, c = (int(x) for x in item.split(":"))
        setup = Setup(pool_size=n, capacity=c)
        t0 = time.process_time()
        full = evaluate(table, setup, base, cost, cps=cps, sample=0)
        t_full = time.process_time() - t0
        runs = []
        t0 = time.process_time()
        for seed in range(args.seeds):
            runs.append(evaluate(table, setup, base, cost, cps=cps, sample=args.sample,
                                 sample_seed=seed))
        t_sample = (time.process_time() - t0) / args.seeds
        want = _figures(full, cps)
        held = sum(abs(r.step_seconds / full.step_seconds - 1) <= r.step_seconds_error
                   for r in runs)
        for name, value in want.items():
            got = [_figures(r, cps)[name] for r in runs]
            if value is None or any(g is None for g in got):
                print(f"{item:>12} {name:>12} {'n/a':>12}")
                continue
            # padding and idle are shares: their error is in points; the rest relative.
            if name in ("padding", "idle"):
                err = [abs(g - value) for g in got if g is not None]
                unit = " pt"
                scale = 100.0
            else:
                err = [abs(g / value - 1) for g in got if g is not None]
                unit = "%"
                scale = 100.0
            ci = f"{held}/{len(runs)}" if name == "s/step" else ""
            print(f"{item:>12} {name:>12} {value:>12.4g} {scale * np.mean(err):>8.2f}{unit:<2} "
                  f"{scale * np.max(err):>8.2f}{unit:<2} {ci:>9} {t_full:>7.1f} "
                  f"{t_sample:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
