"""``--engine ray`` against ``--engine local`` at the same worker count, and the driver's ceiling.

Part 1, whole ``dcp-plan`` processes as a user runs them (start-up, read, plan, validate, write;
Ray's start and shutdown included), the same flags for both engines; the two plans must be
byte-identical (the table says so). Part 2, the driver alone, in this process: what it does per
step whatever the cluster's size, from steps planned beforehand:

- receive: ``ray.get`` of a task's result (``MAX_STEPS_PER_TASK`` steps) from the object store;
- stream: the step's columns, header stats, checksum-free spill (``PlanStream.steps`` +
  ``write_plan_stream``'s spill loop);
- finish: the header, validation with coverage, the final copy (once per plan, after the last
  step);

and, apart, a local Ray's start and shutdown (what ``--engine ray`` pays once per run).

Ceiling = steps / (receive + stream + finish): the rate no number of Ray workers can beat.

Usage:
    .venv/bin/python bench/bench_engines.py [--lengths FILE] [--workers 2] [--pool 64]
        [--effort balanced] [--workdir DIR]

Default data: the 1M Wikipedia lengths (data/workloads/), C = 16384, global batch 16 x N,
dp N/4 x cp 4, ``--long-sequences split``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

import planner.plan
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import PlanStream
from planner.planfile.io import write_plan_stream
from planner.solver.parallel import plan_steps
from planner.solver.ray_engine import MAX_STEPS_PER_TASK
from planner.sources.lengths import read_lengths

ROOT = Path(__file__).resolve().parents[1]
WIKIPEDIA = ROOT / "data" / "workloads" / "flexsp_wikipedia_lengths.txt.gz"


def _flags(pool: int, effort: str) -> list[str]:
    return ["--dp", str(pool // 4), "--cp", "4", "--max-tokens-per-rank", "16384",
            "--global-batch-size", str(16 * pool), "--long-sequences", "split",
            "--effort", effort, "--quiet"]


def _whole_process(data: Path, out: Path, flags: list[str]) -> float:
    cmd = [str(Path(sys.executable).with_name("dcp-plan")), str(data), "-o", str(out), *flags]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def _driver(data: Path, out: Path, pool: int, effort: str, workers: int) -> dict[str, float]:
    """Seconds of the driver's work per phase, from steps planned beforehand (part 2)."""
    table = read_lengths([str(data)])
    config = PlannerConfig(parallel=ParallelConfig(dp=pool // 4, cp=4),
                           capacity_tokens_per_rank=16384, global_batch_size=16 * pool,
                           long_sequences="split", effort=effort, workers=workers)
    cost = load_cost_model()
    stream = PlanStream(table, config, cost)
    t0 = time.perf_counter()
    steps = list(plan_steps(stream.jobs, stream.params, workers))
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=workers, include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False)
    start_s = time.perf_counter() - t0
    try:
        refs = [ray.put(steps[a:a + MAX_STEPS_PER_TASK])
                for a in range(0, len(steps), MAX_STEPS_PER_TASK)]
        del steps
        t0 = time.perf_counter()
        received = [s for ref in refs for s in ray.get(ref)]
        receive_s = time.perf_counter() - t0
    finally:
        t0 = time.perf_counter()
        ray.shutdown()
        start_s += time.perf_counter() - t0

    def precomputed(*_args: Any, **_kwargs: Any) -> Iterator[Any]:
        yield from received

    marks: list[float] = []

    def timed(it: Iterator[Any]) -> Iterator[Any]:
        yield from it
        marks.append(time.perf_counter())

    # The stream's own plan_steps replaced by the steps already planned: what is left is the
    # driver's per-step work (columns, stats, spill) and the end (header, validate, copy).
    real = planner.plan.plan_steps
    planner.plan.plan_steps = precomputed  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        write_plan_stream(out, timed(stream.steps()), stream.header, lengths=table.lengths,
                          overwrite=True)
        t1 = time.perf_counter()
    finally:
        planner.plan.plan_steps = real
    return {"plan": plan_s, "ray_start_stop": start_s, "receive": receive_s,
            "stream": marks[0] - t0, "finish": t1 - marks[0], "steps": float(stream.num_steps),
            "seqs": float(len(table.lengths))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=Path, default=WIKIPEDIA, help="dataset (default: 1M "
                    "Wikipedia lengths)")
    ap.add_argument("--workers", type=int, default=2, help="processes / Ray CPUs for both")
    ap.add_argument("--pool", type=int, default=64, help="pool size N (dp N/4 x cp 4)")
    ap.add_argument("--effort", default="balanced", help="solver effort")
    ap.add_argument("--workdir", type=Path, default=None, help="plans go here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        flags = _flags(args.pool, args.effort)
        # Warm-up: the numba kernels compiled or loaded from cache before anything is timed.
        _whole_process(ROOT / "data" / "sample.jsonl", work / "warm.arrow",
                       ["--dp", "4", "--cp", "2", "--max-tokens-per-rank", "4096",
                        "--global-batch-size", "64", "--quiet"])
        d = _driver(args.lengths, work / "driver.arrow", args.pool, args.effort, args.workers)
        steps, seqs = d["steps"], d["seqs"]
        print(f"{args.lengths.name}: {seqs:,.0f} sequences, {steps:,.0f} steps, N={args.pool}, "
              f"effort {args.effort}, {args.workers} workers")
        print(f"\n{'engine':>8} {'wall s':>8} {'steps/s':>9} {'seq/s':>10} {'same bytes':>10}")
        digests = {}
        for engine in ("local", "ray"):
            out = work / f"{engine}.arrow"
            wall = _whole_process(args.lengths, out, [*flags, "--engine", engine,
                                                      "--workers", str(args.workers)])
            digests[engine] = hashlib.sha256(out.read_bytes()).hexdigest()
            same = "-" if engine == "local" else str(digests["ray"] == digests["local"])
            print(f"{engine:>8} {wall:>8.1f} {steps / wall:>9,.1f} {seqs / wall:>10,.0f} "
                  f"{same:>10}", flush=True)
        driver_s = d["receive"] + d["stream"] + d["finish"]
        print(f"\ndriver, per plan ({steps:,.0f} steps): receive {d['receive']:.2f} s, stream "
              f"(columns, stats, spill) {d['stream']:.2f} s, finish (header, validate, copy) "
              f"{d['finish']:.2f} s; planning the same steps with {args.workers} workers "
              f"{d['plan']:.1f} s; a local Ray's start + shutdown {d['ray_start_stop']:.1f} s")
        print(f"{'':>8} {'ms/step':>8} {'steps/s':>9} {'seq/s':>10}")
        for name, s in (("stream", d["receive"] + d["stream"]), ("ceiling", driver_s)):
            print(f"{name:>8} {1000 * s / steps:>8.3f} {steps / s:>9,.0f} {seqs / s:>10,.0f}")
        if digests["ray"] != digests["local"]:
            raise SystemExit("the ray plan differs from the local plan")


if __name__ == "__main__":
    main()
