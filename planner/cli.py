"""`dcp-plan`: plan a dataset, validate a plan, show a plan.

    dcp-plan DATASET --dp D --cp C --max-tokens-per-rank CAP --global-batch-size B [...]
    dcp-plan DATASET --eval --dp D --cp C --max-tokens-per-rank CAP --global-batch-size B
    dcp-plan validate PLAN [DATASET]
    dcp-plan show PLAN [--steps A:B]

Only this module uses argparse; it builds the frozen configs and calls the pure planner.
User errors (bad flags, bad records, impossible configs) exit with a one-line message, never a
traceback; nothing is written unless the whole plan was made and validated.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from planner.config import (
    EFFORTS,
    LONG_SEQUENCE_POLICIES,
    ParallelConfig,
    PlannerConfig,
    SolverConfig,
)
from planner.groups import LAYOUTS
from planner.planfile.schema import PlanHeader


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of ints, got {text!r}") from None


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dcp-plan",
        description="Plan dynamic context parallelism offline: per microbatch, a partition of "
        "the dp x cp rank pool into CP groups and the sequences each group packs. "
        "Subcommands: 'dcp-plan validate PLAN [DATASET]', 'dcp-plan show PLAN'.",
    )
    p.add_argument("dataset", help="JSONL, Parquet, Arrow, Megatron .idx/.bin prefix, or .txt "
                   "(one length per line)")
    p.add_argument("-o", "--output", help="plan file (default: plans/<dataset stem>.arrow)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument("--cp", type=int, required=True, help="context-parallel size; pool = dp x cp")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism: pad sequences to multiples of tp too")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per rank")
    p.add_argument("--microbatch-group-size", type=int, default=0,
                   help="with vpp > 1, microbatch counts are multiples of this (default: pp)")
    p.add_argument("--max-tokens-per-rank", type=int, required=True, metavar="CAP",
                   help="padded tokens one rank may hold in one microbatch")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--global-batch-size", type=int, default=0, metavar="B",
                   help="samples per optimizer step")
    g.add_argument("--global-batch-tokens", type=int, default=0, metavar="T",
                   help="real tokens per optimizer step (samples added in permutation order)")
    p.add_argument("--drop-last", action="store_true",
                   help="drop each epoch's final partial global batch")
    p.add_argument("--seed", type=int, default=None, help="seed of the per-epoch permutation "
                   "(default 0)")
    p.add_argument("--epochs", type=int, default=None, help="epochs to plan (default 1)")
    p.add_argument("--eval", action="store_true",
                   help="an evaluation plan: one pass in file order, the last partial batch "
                   "kept, planned with the forward-only cost; the global batch flags set one "
                   "eval step (not with --drop-last, --epochs or --seed)")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="CP sharding layout")
    p.add_argument("--pad-to-multiple", type=int, default=1, metavar="N",
                   help="also pad every sequence to a multiple of N (e.g. 16 for FP8 GEMMs); "
                   "the padding counts in --max-tokens-per-rank (default 1: only the CP/SP rule)")
    p.add_argument("--cp-sizes", type=_int_list, default=(), metavar="LIST",
                   help="allowed group sizes, e.g. 1,2,4,8 (default: Megatron's valid sizes)")
    p.add_argument("--min-cp", type=int, default=1, help="smallest group size for any sequence")
    p.add_argument("--long-sequences", choices=LONG_SEQUENCE_POLICIES, default="error",
                   help="a sample longer than the whole pool holds: error, split, truncate, drop")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="skip malformed records (reported) instead of stopping")
    p.add_argument("--field", help="record field with tokens or a length (default: input_ids, "
                   "tokens, length, num_tokens, the first present)")
    p.add_argument("--cost-model", default="default",
                   help="cost-model preset name or JSON file (see planner/presets)")
    p.add_argument("--effort", choices=EFFORTS, default="balanced", help="solver effort")
    p.add_argument("--microbatch-tolerance", type=float, default=0.01, metavar="F",
                   help="take more microbatches than the fewest that fit only when that is "
                   "faster by more than F (relative); larger F gives fuller slots")
    p.add_argument("--workers", type=int, default=1,
                   help="processes that plan steps in parallel (the plan is the same for any N)")
    p.add_argument("--quiet", action="store_true", help="no summary and no progress bar")
    return p


class _Progress:
    """A minimal progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        width = 40
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\rplanning [{'#' * fill}{'.' * (width - fill)}] {done}/{total} steps")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _fmt_rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f} sequences/s" if seconds > 0 else "inf sequences/s"


def cmd_plan(argv: list[str]) -> int:
    parser = _plan_parser()
    args = parser.parse_args(argv)
    if args.eval:
        given = [flag for flag, value in (("--drop-last", args.drop_last or None),
                                          ("--epochs", args.epochs), ("--seed", args.seed))
                 if value is not None]
        if given:
            parser.error(f"--eval plans one pass over the samples in file order, with the last "
                         f"partial batch kept: {', '.join(given)} cannot be used with it")
    from planner.cost import load_cost_model
    from planner.plan import make_plan
    from planner.planfile.io import write_plan
    from planner.sources.lengths import read_lengths

    t0 = time.perf_counter()
    parallel = ParallelConfig(dp=args.dp, cp=args.cp, tp=args.tp, pp=args.pp, vpp=args.vpp,
                              sequence_parallel=args.sequence_parallel,
                              microbatch_group_size=args.microbatch_group_size)
    config = PlannerConfig(
        parallel=parallel, capacity_tokens_per_rank=args.max_tokens_per_rank,
        global_batch_size=args.global_batch_size, global_batch_tokens=args.global_batch_tokens,
        seed=0 if args.seed is None else args.seed,
        epochs=1 if args.epochs is None else args.epochs, layout=args.layout,
        cp_sizes=args.cp_sizes, min_cp=args.min_cp, long_sequences=args.long_sequences,
        drop_last=args.drop_last, pad_to_multiple=args.pad_to_multiple,
        effort=args.effort, cost_model=args.cost_model, workers=args.workers,
        kind="eval" if args.eval else "train",
        solver=SolverConfig(microbatch_tolerance=args.microbatch_tolerance))
    cost = load_cost_model(args.cost_model)
    out = Path(args.output) if args.output else Path("plans") / f"{Path(args.dataset).stem}.arrow"

    table = read_lengths(args.dataset, skip_bad_records=args.skip_bad_records, field=args.field)
    t1 = time.perf_counter()
    plan = make_plan(table, config, cost, progress=_Progress(not args.quiet))
    t2 = time.perf_counter()
    # write_plan validates (with the lengths: coverage to the last token) before anything reaches
    # the final path: a plan that breaks an invariant is a bug, and the user must never find a
    # half-right file under the name they asked for.
    write_plan(out, plan.header, plan.record_batches(), lengths=table.lengths)
    t3 = time.perf_counter()
    if not args.quiet:
        print(format_summary(plan.header, out, table.num_samples,
                             {"read": t1 - t0, "plan": t2 - t1, "validate+write": t3 - t2}))
    return 0


def format_summary(header: PlanHeader, out: Path, num_samples: int,
                   phases: dict[str, float]) -> str:
    """The end-of-run summary: shape, padding, fill, simulated time against the bound, speed."""
    s = header.stats
    p = header.parallel
    total = sum(phases.values())
    ratio = s["simulated_seconds"] / max(s["lower_bound_seconds"], 1e-12)
    lines = [
        f"plan      {out}",
        f"dataset   {header.dataset.path}: {header.dataset.num_samples:,} samples, "
        f"{header.dataset.num_tokens:,} tokens ({header.dataset.format})",
        f"pool      dp {p.dp} x cp {p.cp} = {p.pool_size} ranks (tp {p.tp}, pp {p.pp}, "
        f"vpp {p.vpp}), cap {header.capacity_tokens_per_rank:,} tokens/rank, "
        f"sizes {list(header.cp_sizes)}, {header.layout}",
        f"steps     {s['num_steps']:,} ({_passes(header)}), microbatches per step "
        f"{s['microbatches_per_step']['min']}-{s['microbatches_per_step']['max']} "
        f"(mean {s['microbatches_per_step']['mean']:.2f})",
        "groups    " + ", ".join(f"cp{k}: {v:,}" for k, v in sorted(
            s["cp_size_groups"].items(), key=lambda kv: int(kv[0]))),
        f"padding   {100 * s['padding_overhead']:.3f}% of real tokens "
        f"(alignment {100 * s['alignment_padding']:.3f}%)",
        f"slot fill {s['slot_fill']:.3f} (real tokens / (N x CAP x microbatches))",
        f"time      {s['simulated_seconds']:.2f} s simulated vs lower bound "
        f"{s['lower_bound_seconds']:.2f} s ({ratio:.3f}x) [{header.cost_model.get('name')}]",
    ]
    policy = [f"{len(s.get(key, []))} {key.split('_')[0]}" for key in
              ("split_samples", "truncated_samples", "dropped_samples") if s.get(key)]
    if s.get("skipped_bad_records"):
        policy.append(f"{s['skipped_bad_records']} bad records skipped")
    if policy:
        lines.append("long/bad  " + ", ".join(policy))
    detail = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
    lines.append(f"speed     {_fmt_rate(num_samples * len(header.epochs), total)} in "
                 f"{total:.2f} s ({detail})")
    return "\n".join(lines)


def _passes(header: PlanHeader) -> str:
    if header.kind == "eval":
        return "eval: one pass in file order"
    return f"{len(header.epochs)} epoch(s)"


def cmd_validate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dcp-plan validate",
                                description="Check every invariant of a plan file.")
    p.add_argument("plan", help="plan file (.arrow)")
    p.add_argument("dataset", nargs="?", help="dataset: also check coverage to the last token "
                   "and the fingerprint")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="read the dataset as the plan was made with --skip-bad-records")
    p.add_argument("--field", help="record field, as given to dcp-plan")
    args = p.parse_args(argv)
    from planner.planfile.io import PlanFile
    from planner.planfile.validate import validate

    with PlanFile(args.plan) as f:
        lengths = None
        if args.dataset:
            from planner.sources.lengths import read_lengths

            lengths = read_lengths(args.dataset, skip_bad_records=args.skip_bad_records,
                                   field=args.field).lengths
        validate(f.header, f, lengths, source=args.plan)
        what = "and dataset coverage " if lengths is not None else ""
        print(f"{args.plan}: valid {f.header.kind} plan ({f.num_steps} steps, format "
              f"{f.header.format_version}; "
              f"invariants {what}checked)")
    return 0


def cmd_show(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dcp-plan show", description="Per-step table of a plan.")
    p.add_argument("plan", help="plan file (.arrow)")
    p.add_argument("--steps", default="", help="A:B range of steps (default: all, max 50 shown)")
    p.add_argument("--step", type=int, help="print every row of this one step")
    args = p.parse_args(argv)
    from planner.notebook.view import read_plan, step_summary_row

    view = read_plan(args.plan)
    h = view.header
    if args.step is not None:
        t = view.step(args.step)
        print(t.to_pandas().to_string(index=False) if _has_pandas() else t)
        return 0
    a, _, b = args.steps.partition(":")
    lo = int(a) if a else 0
    hi = int(b) if b else min(view.num_steps, lo + 50)
    cost = view.cost_model
    cols = ["step", "microbatches", "groups", "samples", "real_tokens", "slot_fill",
            "simulated_s", "lower_bound_s"] + [f"groups_cp{k}" for k in h.cp_sizes]
    print("  ".join(f"{c:>12}" for c in cols))
    for i in range(lo, min(hi, view.num_steps)):
        r = step_summary_row(h, cost, i, view.step_columns(i))
        print("  ".join(f"{r[c]:>12.4f}" if isinstance(r[c], float) else f"{r[c]:>12}"
                        for c in cols))
    if hi < view.num_steps:
        print(f"... {view.num_steps - hi} more steps (use --steps)")
    return 0


def _has_pandas() -> bool:
    try:
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"validate": cmd_validate, "show": cmd_show, "plan": cmd_plan}
    cmd = cmd_plan
    if argv and argv[0] in commands:
        cmd = commands[argv.pop(0)]
    try:
        return cmd(argv)
    except (ValueError, OSError) as e:
        print(f"dcp-plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
