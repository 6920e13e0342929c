"""Host time to build one rank's microbatches from a plan (runtime.data.batch), per token source.

For each step size S (sequences per step) the benchmark draws S lengths from the FlexSP Wikipedia
length file, plans them as one step with ``planner.plan.make_plan`` (pool of dp x cp ranks,
capacity C tokens per rank, long samples split), writes the dataset in each format with random
token ids, and times, for every pool rank, ``StepPlan.group_for`` + ``build_microbatch`` of each
of its microbatches (both pipeline ends: tokens, positions, labels and loss mask). Reported per
(S, source): microbatches per rank, mean rows and padded tokens per group, the median / p90 / max
milliseconds per microbatch, the median in buckets of group size, and a rank's whole step
(``reader.step`` plus all its microbatches, the slowest rank).

Usage:
    .venv/bin/python bench/bench_batch.py [--sizes 1024 8192 65536] [--dp 4] [--cp 2]
        [--capacity 8192] [--formats memory megatron arrow parquet jsonl]
        [--max-format-samples 8192] [--lengths FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from bench.workloads import WIKIPEDIA_PATH, read_length_file  # noqa: E402
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import LengthTable
from planner.sources.megatron import write_megatron_dataset
from runtime.data.batch import build_microbatch
from runtime.data.plan_reader import PlanReader
from runtime.data.tokens import ArrayTokens, TokenSource, open_token_source

LENGTHS_FILE = WIKIPEDIA_PATH
BUCKETS = ((0, 16384), (16384, 32768), (32768, 65536), (65536, 1 << 40))


def write_dataset(fmt: str, seqs: list[np.ndarray], tmp: Path) -> TokenSource:
    if fmt == "memory":
        return ArrayTokens.from_sequences(seqs)
    if fmt == "megatron":
        write_megatron_dataset(tmp / "d", seqs, dtype=np.uint16)
        return open_token_source(tmp / "d.bin")
    if fmt in ("arrow", "parquet"):
        offsets = np.r_[0, np.cumsum([len(s) for s in seqs])].astype(np.int64)
        col = pa.LargeListArray.from_arrays(pa.array(offsets),
                                            pa.array(np.concatenate(seqs).astype(np.int32)))
        table = pa.table({"input_ids": col})
        if fmt == "arrow":
            with pa.OSFile(str(tmp / "d.arrow"), "wb") as sink, \
                    ipc.new_file(sink, table.schema) as w:
                w.write_table(table, max_chunksize=4096)
            return open_token_source(tmp / "d.arrow")
        pq.write_table(table, str(tmp / "d.parquet"), row_group_size=1024)
        return open_token_source(tmp / "d.parquet")
    if fmt == "jsonl":
        with open(tmp / "d.jsonl", "w") as f:
            for s in seqs:
                f.write(json.dumps({"input_ids": s.tolist()}) + "\n")
        return open_token_source(tmp / "d.jsonl")
    raise ValueError(f"unknown format {fmt}")


def bench_one(reader: PlanReader, source: TokenSource) -> dict[str, float]:
    times, tokens, rows, step_ms = [], [], [], []
    for rank in range(reader.pool_size):
        t0 = time.perf_counter()
        step = reader.step(0)
        for m in range(step.num_microbatches):
            t1 = time.perf_counter()
            g = step.group_for(m, rank)
            build_microbatch(g, source, layout=reader.layout)
            times.append(time.perf_counter() - t1)
            tokens.append(int(g.padded_tokens.sum()))
            rows.append(len(g.sample_index))
        step_ms.append((time.perf_counter() - t0) * 1e3)
    t = np.array(times) * 1e3
    tok = np.array(tokens)
    out = dict(mb=step.num_microbatches, rows=float(np.mean(rows)), tokens=float(tok.mean()),
               p50=float(np.median(t)), p90=float(np.percentile(t, 90)), max=float(t.max()),
               step_ms=float(max(step_ms)))
    for lo, hi in BUCKETS:
        sel = (tok >= lo) & (tok < hi)
        out[f"b{lo}"] = float(np.median(t[sel])) if sel.any() else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 65536],
                    help="sequences per step")
    ap.add_argument("--dp", type=int, default=4, help="data-parallel size")
    ap.add_argument("--cp", type=int, default=2, help="static CP size (pool = dp x cp)")
    ap.add_argument("--capacity", type=int, default=8192, help="padded tokens per rank")
    ap.add_argument("--formats", nargs="+",
                    default=["memory", "megatron", "arrow", "parquet", "jsonl"],
                    help="token sources to time")
    ap.add_argument("--max-format-samples", type=int, default=8192,
                    help="largest step size timed for arrow/parquet/jsonl (writing them is slow)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the length draw and tokens")
    ap.add_argument("--lengths", type=Path, default=LENGTHS_FILE,
                    help="one sample length per line; step lengths are drawn from it")
    args = ap.parse_args()

    all_lengths = read_length_file(args.lengths)
    rng = np.random.default_rng(args.seed)
    cost = load_cost_model()
    parallel = ParallelConfig(dp=args.dp, cp=args.cp)
    head = (f"{'seqs':>6} {'source':>8} {'mb/rank':>7} {'rows/g':>6} {'tok/g':>7} "
            f"{'p50 ms':>7} {'p90 ms':>7} {'max ms':>7} {'<16K':>6} {'16-32K':>6} "
            f"{'32-64K':>6} {'64K+':>6} {'step ms':>8}")
    print(f"pool {parallel.pool_size} (dp {args.dp} x cp {args.cp}), C={args.capacity}, "
          f"lengths {args.lengths.name}; ms per microbatch per rank, zigzag, both stages")
    print(head)
    for size in args.sizes:
        lengths = rng.choice(all_lengths, size=size)
        table = LengthTable(path="bench", format="text", lengths=lengths,
                            skipped=np.zeros(0, np.int64))
        config = PlannerConfig(parallel=parallel, capacity_tokens_per_rank=args.capacity,
                               global_batch_size=size, long_sequences="split", effort="fast")
        plan = make_plan(table, config, cost)
        seqs = [rng.integers(0, 50_000, size=int(n), dtype=np.int64) for n in lengths]
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            path = write_plan(tmp / "plan.arrow", plan.header, plan.record_batches())
            reader = PlanReader(path)
            for fmt in args.formats:
                if fmt not in ("memory", "megatron") and size > args.max_format_samples:
                    continue
                d = tmp / fmt
                d.mkdir()
                r = bench_one(reader, write_dataset(fmt, seqs, d))
                print(f"{size:>6} {fmt:>8} {r['mb']:>7} {r['rows']:>6.1f} {r['tokens']:>7.0f} "
                      f"{r['p50']:>7.3f} {r['p90']:>7.3f} {r['max']:>7.2f} "
                      + " ".join(f"{r[f'b{lo}']:>6.3f}" for lo, _ in BUCKETS)
                      + f" {r['step_ms']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
