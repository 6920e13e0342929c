"""What the predicted gain costs per step: the baselines built and simulated on every step.

Per pool size, on the Wikipedia lengths (C = 16384, global batch 16 x N, ``--long-sequences
split``, bench_scale.py's setting), times the first ``--steps`` steps (after one warm-up step):
our whole step (``assign_step``: search, rows, both baselines), and inside it static CP's layout
and simulation and Megatron's greedy's (``candidates.static_layout_of`` / ``megatron_layout``
then ``Layout.seconds``), which every step now pays to record the gain, and the gain's parts
(``cost.step_terms`` of our rows and of both layouts, issue 33). CPU seconds
(``time.process_time``), so the other jobs on a shared host count less.

Usage:
    .venv/bin/python bench/bench_gain.py --lengths data/workloads/flexsp_wikipedia_lengths.txt.gz
        [--pools 64,256,1024] [--steps 40]
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

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model, step_terms
from planner.plan import PlanStream
from planner.solver.candidates import megatron_layout, static_layout_of
from planner.solver.greedy import assign_step
from planner.sources.lengths import LengthTable


def _lengths(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return np.array(raw.split(), dtype=np.int64)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=Path, required=True, help="one length per line")
    ap.add_argument("--pools", default="64,256,1024", help="pool sizes N")
    ap.add_argument("--steps", type=int, default=40, help="steps timed per pool")
    ap.add_argument("--cost-model", default="default", help="cost-model preset or JSON")
    args = ap.parse_args(argv)
    lengths = _lengths(args.lengths)
    table = LengthTable(path=str(args.lengths), format="text", lengths=lengths,
                        skipped=np.zeros(0, np.int64))
    cost = load_cost_model(args.cost_model)
    print(f"{'N':>5} {'steps':>5} {'segs/step':>9} {'step ms':>8} {'static ms':>9} "
          f"{'megatron ms':>11} {'gain share':>10} {'parts ms':>8} {'parts share':>11}")
    for pool in (int(x) for x in args.pools.split(",")):
        config = PlannerConfig(parallel=ParallelConfig(dp=pool // 4, cp=4),
                               capacity_tokens_per_rank=16384, global_batch_size=16 * pool,
                               long_sequences="split")
        stream = PlanStream(table, config, cost)
        jobs, p = stream.jobs, stream.params
        num = min(args.steps, jobs.num_steps - 1)
        step = static = mega = parts = 0.0
        segments = 0
        for j in range(num + 1):
            a, b = int(jobs.bounds[j]), int(jobs.bounds[j + 1])
            s, o, t = jobs.sample[a:b], jobs.offset[a:b], jobs.tokens[a:b]
            t0 = time.process_time()
            out = assign_step(s, o, t, p)
            t1 = time.process_time()
            lay = static_layout_of(t, pool_size=pool, cp=4, capacity=16384, tp_eff=1,
                                   layout="zigzag", multiple=1)
            if lay is not None:
                lay.seconds(p.cost, pool)
            t2 = time.process_time()
            got = megatron_layout(t, pool_size=pool, capacity=16384, tp_eff=1, sizes=p.sizes)
            if got is not None:
                got.seconds(p.cost, pool)
            t3 = time.process_time()
            step_terms(p.cost, pool, out.microbatch, out.rank_start, out.cp_size,
                       out.padded_tokens, out.num_tokens)
            for built in (lay, got):
                if built is not None:
                    built.terms(p.cost, pool, t)
            t4 = time.process_time()
            if j:  # step 0 pays numba's first calls
                step, static, mega = step + t1 - t0, static + t2 - t1, mega + t3 - t2
                parts += t4 - t3
                segments += b - a
        print(f"{pool:>5} {num:>5} {segments / num:>9.0f} {1e3 * step / num:>8.2f} "
              f"{1e3 * static / num:>9.2f} {1e3 * mega / num:>11.2f} "
              f"{(static + mega) / step:>10.1%} {1e3 * parts / num:>8.3f} "
              f"{parts / step:>11.1%}", flush=True)


if __name__ == "__main__":
    main()
