"""`dcp-plan compare DATASET... --pools LIST --cp LIST --max-tokens-per-rank LIST
(--global-batch-size B | --global-batch-tokens T)`: which pool and capacity to ask for, before
a cluster is booked.

One table over every setup (pool N x capacity C; planner/compare.py): the mean simulated step
time (with its sampling error), tokens/s (whole job and per GPU), the speed-up over static CP
at each listed cp and over Megatron's greedy, padding, idle share and microbatches per step.
Text, ``--json`` (one object) and ``--figure FILE`` (PNG, or SVG/PDF by extension). A setup
that cannot plan this dataset (a capacity below the padding multiple, or no group size holding
a sample under ``--long-sequences error``) is listed with the planner's reason; a static cp
that does not divide a pool has no number there, with the reason; the command fails only when
no setup remains.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from planner.cli.args import (
    EFFORT_HELP,
    ArgumentParser,
    HelpFormatter,
    add_json_arguments,
    add_version,
    emit_summary,
    flag_message,
    int_list,
    nonnegative_int,
    positive_int,
    seed_int,
)
from planner.cli.flags import FLAGS
from planner.cli.guard import add_megatron_unit_argument
from planner.cli.textargs import add_tokenizer_arguments, encoder_from_args
from planner.config import EFFORTS, LONG_SEQUENCE_POLICIES

PROG = "dcp-plan compare"


def _positive_list(text: str) -> tuple[int, ...]:
    """argparse ``type``: a comma-separated list of integers >= 1 (``8,16,64``)."""
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers >= 1 "
                                         f"such as 8,16,64, got {text!r}")
    return values
DEFAULT_SAMPLE = 1000
"""Steps planned per setup by default: every step of a million Wikipedia lengths at a global
batch of 1024 (977), a sample of larger plans (BENCHMARKS.md measures the error it leaves)."""


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG, formatter_class=HelpFormatter,
        description="Compare candidate setups (pool size, static cp, capacity per rank) on one "
        "dataset: simulated time per step, tokens/s, speed-up over static CP and Megatron's "
        "greedy, padding and idle share. Every setup plans the same global batches.")
    add_version(p)
    p.add_argument("dataset", nargs="+", metavar="DATASET",
                   help="dataset files, directories or quoted globs (as for dcp-plan)")
    p.add_argument("--field", help="record field or column to read (as for dcp-plan)")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="skip malformed records (reported) instead of stopping")
    add_megatron_unit_argument(p)
    p.add_argument("--pools", type=_positive_list, required=True, metavar="LIST",
                   help="pool sizes N = dp x cp to compare, e.g. 8,16,64")
    p.add_argument("--cp", type=_positive_list, default=(1,), metavar="LIST",
                   help="static CP sizes to compare against (what the job runs today), e.g. "
                   "2,4,8; the dynamic plan of a pool does not depend on them")
    p.add_argument("--max-tokens-per-rank", "--max-seqlen-per-dp-cp-rank", type=_positive_list,
                   required=True, metavar="LIST", dest="capacities",
                   help="capacities per rank to compare, e.g. 8192,16384")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--global-batch-size", type=positive_int, metavar="B",
                   help="samples per optimizer step (the same for every setup)")
    g.add_argument("--global-batch-tokens", type=positive_int, metavar="T",
                   help="real tokens per optimizer step (the same for every setup)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (all setups)")
    p.add_argument("--sequence-parallel", action="store_true", help="pad to multiples of tp too")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    p.add_argument("--cost-model", default="default",
                   help="cost-model preset name or JSON file (see planner/presets)")
    p.add_argument("--long-sequences", choices=LONG_SEQUENCE_POLICIES, default="error",
                   help="a sample longer than the whole pool holds: error (that setup is "
                   "refused), split, truncate, drop")
    p.add_argument("--effort", choices=EFFORTS, default="balanced", help=EFFORT_HELP)
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the permutation")
    p.add_argument("--sample-steps", type=nonnegative_int, default=DEFAULT_SAMPLE, metavar="K",
                   help="plan at most K steps per setup, drawn by a seeded permutation (the "
                   "same for every setup) when a setup has more; 0 plans every step")
    p.add_argument("--sample-seed", type=nonnegative_int, default=0, metavar="S",
                   help="which steps are sampled")
    p.add_argument("--figure", metavar="FILE", default="",
                   help="also draw the comparison (PNG; .svg or .pdf by extension); replaces "
                   "only a figure, never an input or another kind of file")
    add_tokenizer_arguments(p, required=False)
    add_json_arguments(p)
    return p


def cmd_compare(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    encoder = encoder_from_args(parser, args)  # a text corpus: its token counts (cached)
    from planner.compare import Setup, evaluate, expand
    from planner.config import ParallelConfig, PlannerConfig
    from planner.cost import load_cost_model
    from planner.sources.lengths import read_lengths

    t0 = time.perf_counter()
    cost = load_cost_model(args.cost_model)
    inputs = [*args.dataset, *([args.cost_model] if "." in args.cost_model else [])]
    from planner.fileguard import check_output

    # Every output checked before any work (planner.fileguard: never an input, the other
    # output, a special file, or an existing file of another kind).
    if args.figure:
        from pathlib import Path

        check_output(args.figure, kind="figure", inputs=inputs, flag="--figure",
                     others={"--summary-json": args.summary_json})
        if Path(args.figure).suffix.lower() not in ("", ".png", ".svg", ".pdf"):
            raise ValueError(f"--figure {args.figure}: give a .png, .svg or .pdf file")
    if args.summary_json:
        check_output(args.summary_json, kind="summary", inputs=inputs, flag="--summary-json")
    table = read_lengths(args.dataset, skip_bad_records=args.skip_bad_records, field=args.field,
                         encoder=encoder, megatron_unit=args.megatron_unit)
    setups = expand(args.pools, args.capacities)
    base = PlannerConfig(
        parallel=ParallelConfig(dp=1, cp=1, tp=args.tp, pp=args.pp,
                                sequence_parallel=args.sequence_parallel),
        capacity_tokens_per_rank=1, global_batch_size=args.global_batch_size or 0,
        global_batch_tokens=args.global_batch_tokens or 0, seed=args.seed,
        long_sequences=args.long_sequences, effort=args.effort, cost_model=args.cost_model)
    results = []
    reasons: list[tuple[Setup, str]] = []
    for s in setups:
        try:
            results.append(evaluate(table, s, base, cost, cps=args.cp,
                                    sample=args.sample_steps, sample_seed=args.sample_seed))
        except ValueError as e:
            # The planner's hint names dcp-plan's --cp-sizes, which compare has not: here a
            # setup's largest group is its pool.
            why = str(e).replace("or limit --cp-sizes", "or compare smaller --pools")
            reasons.append((s, flag_message(why, FLAGS)))
    if not results:
        raise ValueError("no setup can plan this dataset:\n  " + "\n  ".join(
            f"{_name(s)}: {why}" for s, why in reasons))
    doc = _document(table, args, cost.name, results, reasons, time.perf_counter() - t0)
    # The cost model's provenance and, when a deciding term is assumed, the warning
    # (planner/provenance.py): the ring terms decide wherever CP > 1 runs, here static CP at
    # a listed cp > 1 and a dynamic plan of a pool > 1.
    from planner import provenance

    ring = [f"static CP {c}" for c in args.cp if c > 1] + (
        ["dynamic plans of pools > 1"] if any(r.setup.pool_size > 1 for r in results) else [])
    doc["cost_model_provenance"] = cost.provenance
    doc["cost_model_mark"] = provenance.mark(cost.name, cost.provenance)
    doc["cost_model_warning"] = provenance.warning(cost.provenance, cost.parameters,
                                                   ring_used=", ".join(ring))
    if args.figure:
        from planner.fileguard import write_atomic
        from planner.notebook.plotcompare import compare_figure

        write_atomic(args.figure, compare_figure(doc, args.figure), kind="figure",
                     inputs=inputs)
    emit_summary(doc, _text(doc), as_json=args.json, json_path=args.summary_json)
    return 0


def _name(s: Any) -> str:
    return f"pool {s.pool_size}, cap {s.capacity:,}"


def _document(table: Any, args: argparse.Namespace, cost_name: str, results: list[Any],
              reasons: list[tuple[Any, str]], seconds: float) -> dict[str, Any]:
    first = results[0]
    batch = (f"{args.global_batch_size} samples" if args.global_batch_size
             else f"{args.global_batch_tokens:,} tokens")
    return {
        "dataset": {"path": str(table.path), "num_samples": int(len(table.lengths)),
                    "num_tokens": int(table.lengths[table.lengths > 0].sum()),
                    **({"megatron_unit": table.megatron_unit} if table.megatron_unit else {})},
        "global_batch": batch, "cost_model": cost_name, "effort": args.effort,
        "num_steps": first.num_steps, "sampled_steps": first.sampled_steps,
        "static_cp": list(args.cp),
        "sampled": any(r.sampled_steps < r.num_steps for r in results),
        "setups": [{"pool_size": r.setup.pool_size,
                    "capacity_tokens_per_rank": r.setup.capacity, "gpus": r.gpus,
                    "num_steps": r.num_steps, "sampled_steps": r.sampled_steps,
                    "step_seconds": r.step_seconds, "step_seconds_error": r.step_seconds_error,
                    "tokens_per_second": r.tokens_per_second,
                    "tokens_per_second_per_gpu": r.tokens_per_second_per_gpu,
                    "vs_static_cp": {str(c): v for c, v in r.vs_static_cp.items()},
                    "static_cp_notes": {str(c): v for c, v in r.static_notes.items()},
                    "vs_megatron": r.vs_megatron, "megatron_note": r.megatron_note,
                    "padding": r.padding, "idle": r.idle,
                    "microbatches_per_step": r.microbatches_per_step} for r in results],
        "refused": [{"pool_size": s.pool_size, "capacity_tokens_per_rank": s.capacity,
                     "reason": why} for s, why in reasons],
        "seconds": seconds,
    }


def _ratio(x: float | None, note: str | None = None) -> str:
    partial = bool(note) and "cannot run" in str(note)
    if x is None:
        return "n/a" if partial else "-"
    return f"{x:.3f}x" + ("*" if partial else "")


def _text(doc: dict[str, Any]) -> str:
    d = doc["dataset"]
    rows = doc["setups"]
    cps = [str(c) for c in doc["static_cp"]]
    unit = f" ({d['megatron_unit']}s of Megatron files)" if d.get("megatron_unit") else ""
    lines = [f"dataset   {d['path']}: {d['num_samples']:,} samples{unit}, "
             f"{d['num_tokens']:,} tokens; "
             f"global batch {doc['global_batch']}; cost model {doc['cost_model']}"]
    if doc["sampled"]:
        lines.append(f"sampled   {doc['sampled_steps']} of {doc['num_steps']:,} steps per setup "
                     "(the same steps where setups have the same steps); +- is the 95% "
                     "sampling error of the mean step time")
    else:
        lines.append(f"steps     every step planned ({doc['num_steps']:,} per setup)")
    head = (f"{'pool':>5} {'cap/rank':>9} {'GPUs':>5} {'s/step':>9} {'+-':>6} {'tokens/s':>11} "
            f"{'tok/s/GPU':>10} " + " ".join(f"{'vs cp' + c:>9}" for c in cps)
            + f" {'vs Megatron':>11} {'padding':>8} {'idle':>6} {'mb/step':>7}")
    lines += [head, "-" * len(head)]
    for r in rows:
        static = " ".join(f"{_ratio(r['vs_static_cp'][c], r['static_cp_notes'].get(c)):>9}"
                          for c in cps)
        lines.append(
            f"{r['pool_size']:>5} {r['capacity_tokens_per_rank']:>9,} {r['gpus']:>5} "
            f"{r['step_seconds']:>9.3f} {100 * r['step_seconds_error']:>5.1f}% "
            f"{r['tokens_per_second']:>11,.0f} {r['tokens_per_second_per_gpu']:>10,.0f} "
            f"{static} {_ratio(r['vs_megatron'], r['megatron_note']):>11} "
            f"{100 * r['padding']:>7.2f}% {100 * r['idle']:>5.1f}% "
            f"{r['microbatches_per_step']:>7.2f}")
    lines.append("vs cpC    static CP C's simulated time over the plan's, on the same steps; "
                 "*: over the steps it can run (some hold a sequence longer than C x cap; "
                 "--json counts them); n/a: it can run none; -: C does not divide the pool")
    for why in sorted({r["megatron_note"] for r in rows if r["megatron_note"]}):
        lines.append(f"Megatron  {why}")
    for r in doc["refused"]:
        lines.append(f"refused   pool {r['pool_size']}, cap {r['capacity_tokens_per_rank']:,}: "
                     f"{r['reason']}")
    fastest = max(rows, key=lambda r: r["tokens_per_second"])
    thrifty = max(rows, key=lambda r: r["tokens_per_second_per_gpu"])
    lines.append(f"fastest   pool {fastest['pool_size']}, cap "
                 f"{fastest['capacity_tokens_per_rank']:,}: {fastest['tokens_per_second']:,.0f} "
                 "tokens/s")
    lines.append(f"per GPU   pool {thrifty['pool_size']}, cap "
                 f"{thrifty['capacity_tokens_per_rank']:,}: "
                 f"{thrifty['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU")
    lines.append(f"cost      {doc['cost_model_mark']}")
    if doc["cost_model_warning"]:
        lines.append(f"warning   {doc['cost_model_warning']}")
    lines.append(f"took      {doc['seconds']:.1f} s")
    return "\n".join(lines)
