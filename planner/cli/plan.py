"""`dcp-plan [plan] DATASET...`: plan a dataset and write the plan file (the default command).

    dcp-plan [plan] DATASET... --dp D [--cp C] --max-tokens-per-rank CAP --global-batch-size B
    dcp-plan DATASET... --eval --dp D [--cp C] --max-tokens-per-rank CAP --global-batch-size B

Its parser is also ``dcp-plan --help``: the usage and the epilog list every command (dispatch.py
picks one). The flags build the frozen configs and call the pure planner. Megatron-LM's names
are aliases of the same flags (``--context-parallel-size`` is ``--cp``): one argparse action
each, so both spellings give byte-identical plans. User errors (bad flags, bad records,
impossible configs) exit with status 2 and a one-line message naming the flag, file or sample,
never a traceback; nothing is written unless the whole plan was made and validated.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from planner.cli.args import (
    EFFORT_HELP,
    ArgumentParser,
    HelpFormatter,
    add_json_arguments,
    add_version,
    emit_summary,
    int_list,
    nonnegative_int,
    positive_int,
    refuse,
    seed_int,
)
from planner.cli.engine import add_engine_arguments, engine_settings
from planner.cli.flags import MEGATRON_REFUSED
from planner.cli.guard import (
    add_dataset_arguments,
    check_outputs,
    dataset_items,
    default_output,
    input_files,
    print_notice,
)
from planner.cli.textargs import add_tokenizer_arguments, encoder_from_args, text_notice
from planner.config import (
    EFFORTS,
    LONG_SEQUENCE_POLICIES,
    ParallelConfig,
    PlannerConfig,
    SolverConfig,
)
from planner.groups import LAYOUTS

if TYPE_CHECKING:
    from planner.memory import MemoryModel

PROG = "dcp-plan"
USAGE = """dcp-plan [plan] DATASET... --dp D [--cp C] --max-tokens-per-rank CAP
                       (--global-batch-size B | --global-batch-tokens T) [options]
       dcp-plan validate PLAN [DATASET...]   check a plan (and its coverage of DATASET)
       dcp-plan show PLAN [--steps A:B]       per-step table ('dcp-plan show --help')
       dcp-plan compare DATASET... --pools 8,16,64 --cp 2,4 --max-tokens-per-rank C,...
                                              compare setups ('dcp-plan compare --help')
       dcp-plan report PLAN -o report.html   the plan as one HTML page
       dcp-plan tokenize TEXT... --tokenizer PATH -o PREFIX
                                              text into a Megatron dataset (PREFIX.bin/.idx)"""
EPILOG = """\
commands:
  plan       (the default) plan DATASET and write the plan file
  validate   check a plan file's invariants, and with DATASET its coverage and fingerprint
  show       print a plan's per-step table, or every row of one step
  compare    which pool and capacity to ask for: setups side by side on one dataset
  report     a plan as one self-contained HTML page (gain, summary, per-step figures)
  tokenize   a text corpus into a Megatron indexed dataset (PREFIX.bin, PREFIX.idx), once

datasets:
  DATASET is one or more files, directories or (quoted) globs, in the order given; a directory's
  or glob's files in sorted path order. Formats: .jsonl (also .jsonl.gz, .jsonl.zst), .parquet,
  .arrow, Megatron .idx/.bin (a prefix), .txt (one length per line); text (a 'text' field or
  column, as Hugging Face datasets hold) with --tokenizer PATH. Megatron's --data-path takes
  optional weights: '--data-path 0.3 a.jsonl 0.7 shards/' draws 30% / 70% of every global batch
  from each entry (deterministic counts per step).

Megatron-LM names work as aliases: --context-parallel-size, --tensor-model-parallel-size,
--pipeline-model-parallel-size, --virtual-pipeline-model-parallel-size,
--max-seqlen-per-dp-cp-rank, --data-path, --global-batch-size, --seed.
"""


def _plan_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG, usage=USAGE, epilog=EPILOG, formatter_class=HelpFormatter,
        description="Plan dynamic context parallelism offline: per microbatch, a partition of "
        "the dp x cp rank pool into CP groups and the sequences each group packs.")
    add_version(p)
    add_dataset_arguments(p, required=True)
    p.add_argument("-o", "--output",
                   help="plan file (default: plans/<first dataset's stem>.arrow); an existing "
                   "plan there is replaced, any other file is refused")
    p.add_argument("--fingerprint", choices=("lengths", "content"), default="lengths",
                   help="what the header fingerprints: lengths (cheap: catches a changed, "
                   "reordered or truncated dataset) or content (also every token, read once "
                   "more now and by the runtime at start: catches tokens edited in place)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output file even if it is not a plan (never an input)")
    par = p.add_argument_group("parallel layout (pool = dp x cp ranks)")
    par.add_argument("--dp", "--data-parallel-size", dest="dp", type=positive_int,
                     required=True, metavar="D", help="data-parallel size")
    par.add_argument("--cp", "--context-parallel-size", dest="cp", type=positive_int, default=1,
                     metavar="C", help="context-parallel size; the pool is dp x cp ranks")
    par.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=positive_int,
                     default=1, metavar="T", help="tensor-parallel size")
    par.add_argument("--sequence-parallel", action="store_true",
                     help="sequence parallelism: pad sequences to multiples of tp too")
    par.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=positive_int,
                     default=1, metavar="P", help="pipeline-parallel size")
    par.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", dest="vpp",
                     type=positive_int, default=1, metavar="V",
                     help="virtual pipeline stages per rank (needs --pp >= 2)")
    par.add_argument("--microbatch-group-size",
                     "--microbatch-group-size-per-virtual-pipeline-stage",
                     dest="microbatch_group_size", type=nonnegative_int, default=0, metavar="G",
                     help="with --vpp > 1, microbatch counts are multiples of this (0: pp)")
    bat = p.add_argument_group("capacity and batches")
    bat.add_argument("--max-tokens-per-rank", "--max-seqlen-per-dp-cp-rank",
                     dest="max_tokens_per_rank", type=positive_int, required=True, metavar="CAP",
                     help="padded tokens one rank may hold in one microbatch")
    g = bat.add_mutually_exclusive_group(required=True)
    g.add_argument("--global-batch-size", type=positive_int, metavar="B",
                   help="samples per optimizer step")
    g.add_argument("--global-batch-tokens", type=positive_int, metavar="T",
                   help="real tokens per optimizer step (samples added in permutation order)")
    bat.add_argument("--memory-per-rank", default="", metavar="SIZE",
                     help="refuse a plan with a microbatch whose estimated peak on one rank "
                     "(planner/memory.py) exceeds SIZE, e.g. 80GB or 80GiB; with "
                     "--long-sequences split, split every sample too long for it into "
                     "segments that fit instead; needs --memory-model")
    bat.add_argument("--memory-model", default="", metavar="SHAPE",
                     help="the model's shape for --memory-per-rank: KEY=VALUE,... of vocab, "
                     "layers, hidden, heads, query-groups, ffn, attention (reference, torch, "
                     "te), device (cpu, cuda), e.g. layers=32,hidden=4096,heads=32,"
                     "query-groups=8,vocab=128256,attention=te")
    bat.add_argument("--drop-last", action="store_true",
                     help="drop each epoch's final partial global batch")
    bat.add_argument("--seed", type=seed_int, default=None,
                     help="seed of the per-epoch permutation (default 0)")
    bat.add_argument("--epochs", type=positive_int, default=None,
                     help="epochs to plan (default 1)")
    bat.add_argument("--eval", action="store_true",
                     help="an evaluation plan: one pass in file order, the last partial batch "
                     "kept, planned with the forward-only cost; the global batch flags set one "
                     "eval step (not with --drop-last, --epochs or --seed)")
    sol = p.add_argument_group("groups and solver")
    sol.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="CP sharding layout")
    sol.add_argument("--pad-to-multiple", type=positive_int, default=1, metavar="N",
                     help="also pad every sequence to a multiple of N (e.g. 16 for FP8 GEMMs); "
                     "the padding counts in --max-tokens-per-rank (1: only the CP/SP rule)")
    sol.add_argument("--cp-sizes", type=int_list, default=(), metavar="LIST",
                     help="allowed group sizes, e.g. 1,2,4,8 (default: Megatron's valid sizes "
                     "for the pool)")
    sol.add_argument("--min-cp", type=positive_int, default=1,
                     help="smallest group size for any sequence")
    sol.add_argument("--long-sequences", choices=LONG_SEQUENCE_POLICIES, default="error",
                     help="a sample longer than the whole pool holds (or, with "
                     "--memory-per-rank, than the limit holds): error, split, truncate, drop")
    sol.add_argument("--cost-model", default="default",
                     help="cost-model preset name or JSON file (see planner/presets)")
    sol.add_argument("--effort", choices=EFFORTS, default="balanced", help=EFFORT_HELP)
    sol.add_argument("--microbatch-tolerance", type=float, default=0.01, metavar="F",
                     help="take more microbatches than the fewest that fit only when that is "
                     "faster by more than F (relative); larger F gives fuller slots")
    add_engine_arguments(sol)
    add_tokenizer_arguments(p, required=False)
    p.add_argument("--no-lengths-cache", action="store_true",
                   help="with --tokenizer: tokenize every file now, neither reading nor writing "
                   "the token-count caches (FILE.<key>.dcplen) kept beside the dataset")
    out = p.add_argument_group("output")
    add_json_arguments(out)
    out.add_argument("--quiet", action="store_true", help="no summary and no progress bar")
    refuse(p, MEGATRON_REFUSED)
    return p


def cmd_plan(argv: list[str]) -> int:
    parser = _plan_parser()
    args = parser.parse_intermixed_args(argv)
    items, weights = dataset_items(parser, args)
    if args.eval:
        given = [flag for flag, value in (("--drop-last", args.drop_last or None),
                                          ("--epochs", args.epochs), ("--seed", args.seed),
                                          ("--data-path weights", weights)) if value is not None]
        if given:
            parser.error(f"--eval plans one pass over the samples in file order, with the last "
                         f"partial batch kept: {', '.join(given)} cannot be used with it")
    if weights is not None and args.global_batch_tokens:
        parser.error("--data-path weights draw a number of samples per step: use "
                     "--global-batch-size with them, not --global-batch-tokens")
    memory = None
    if args.memory_per_rank or args.memory_model:
        if not (args.memory_per_rank and args.memory_model):
            parser.error("--memory-per-rank and --memory-model go together: the limit and the "
                         "model whose peak is held against it")
        from planner.memory import parse_bytes, parse_shape

        try:
            memory = (parse_shape(args.memory_model), parse_bytes(args.memory_per_rank))
        except ValueError as e:
            parser.error(str(e))
    engine = engine_settings(parser, args)  # before reading: Ray there if asked for
    encoder = encoder_from_args(parser, args)
    if encoder is not None and args.fingerprint == "content":
        parser.error("--fingerprint content hashes token ids, which a text corpus does not "
                     "hold: tokenize it once (dcp-plan tokenize DATA --tokenizer PATH -o "
                     "PREFIX) and plan PREFIX with --fingerprint content; a text plan records "
                     "the tokenizer's sha256 and the lengths fingerprint of its token counts")
    from planner import numbacache
    from planner.cli.progress import Progress
    from planner.cli.summary import Compiles, format_summary, plan_summary
    from planner.cost import load_cost_model
    from planner.plan import PlanStream
    from planner.planfile.io import write_plan_stream
    from planner.planfile.schema import PlanHeader
    from planner.sources.lengths import read_lengths
    from planner.sources.text import text_unit

    t0 = time.perf_counter()
    # This process's numba compiles at each phase's end (planner/numbacache.py): the summary
    # reports them apart and counts none in the phases or the speed.
    compiled = {"start": numbacache.compile_totals()}
    parallel = ParallelConfig(dp=args.dp, cp=args.cp, tp=args.tp, pp=args.pp, vpp=args.vpp,
                              sequence_parallel=args.sequence_parallel,
                              microbatch_group_size=args.microbatch_group_size)
    config = PlannerConfig(
        parallel=parallel, capacity_tokens_per_rank=args.max_tokens_per_rank,
        global_batch_size=args.global_batch_size or 0,
        global_batch_tokens=args.global_batch_tokens or 0,
        seed=0 if args.seed is None else args.seed,
        epochs=1 if args.epochs is None else args.epochs, layout=args.layout,
        cp_sizes=args.cp_sizes, kind="eval" if args.eval else "train",
        min_cp=args.min_cp, long_sequences=args.long_sequences, drop_last=args.drop_last,
        pad_to_multiple=args.pad_to_multiple,
        effort=args.effort, cost_model=args.cost_model, **engine,
        blend=tuple(weights or ()),
        solver=SolverConfig(microbatch_tolerance=args.microbatch_tolerance))
    hint = ""
    if memory is not None:  # the longest segment the limit holds (planner/memory.py)
        config, hint = _memory_cap(config, *memory)
    cost = load_cost_model(args.cost_model)
    out = Path(args.output) if args.output else default_output(items[0])
    # Before reading anything: the outputs must not be inputs, nor files of another kind.
    check_outputs(out, args.summary_json, input_files(items, args.cost_model),
                  overwrite=args.overwrite)
    show = not (args.quiet or args.json)
    with Progress("reading", unit="file", enabled=show and len(items) > 1 and not encoder
                  ) as bar, Progress("tokenizing", unit=text_unit(items), enabled=show) as tok_bar:
        table = read_lengths(items, skip_bad_records=args.skip_bad_records, field=args.field,
                             progress=bar, notice=print_notice, megatron_unit=args.megatron_unit,
                             encoder=encoder, use_cache=not args.no_lengths_cache,
                             text_progress=tok_bar)
    if encoder is not None and not (args.quiet or args.json) and text_notice(table):
        print_notice(text_notice(table))
    # Directories and globs expand to files only now: check those too.
    check_outputs(out, args.summary_json, input_files([f.path for f in table.files], ""),
                  overwrite=args.overwrite)
    timings = {"read": time.perf_counter() - t0}
    compiled["read"] = numbacache.compile_totals()
    if args.fingerprint == "content":
        from planner.sources.content import with_content

        with Progress("hashing tokens", unit="file", enabled=show) as bar:
            table = with_content(table, args.field, progress=bar)
        timings["fingerprint"] = time.perf_counter() - t0 - timings["read"]
        compiled["fingerprint"] = numbacache.compile_totals()
    t1 = time.perf_counter()
    planned: list[float] = []
    # Worker processes (--workers, a local Ray) log their compiles to this process.
    with Progress("planning", unit="step", enabled=show) as bar, \
            numbacache.worker_compiles(config.workers != 1 or config.engine == "ray") as workers:
        stream = PlanStream(table, config, cost, progress=bar)

        def header() -> PlanHeader:
            planned.append(time.perf_counter())
            compiled.setdefault("plan", numbacache.compile_totals())
            return stream.header()

        # Steps stream to a spill file as they are planned (memory independent of the number
        # of steps); write_plan_stream then validates them (with the lengths: coverage to the
        # last token) before anything reaches the final path: a plan that breaks an invariant
        # is a bug, and the user must never find a half-right file under the name they asked
        # for.
        steps = stream.steps()
        if memory is not None:  # refused before the plan reaches its path (planner/memory.py)
            from planner.memory import refuse_over

            steps = refuse_over(steps, memory[0], memory[1],
                                f"--memory-per-rank {args.memory_per_rank}", hint)
        write_plan_stream(out, steps, header, lengths=table.lengths,
                          overwrite=args.overwrite)
        compiled["validate+write"] = numbacache.compile_totals()
        in_workers = workers.read()
    t3 = time.perf_counter()
    t2 = planned[0]
    summary = plan_summary(stream.header(), out,
                           {**timings, "plan": t2 - t1, "validate+write": t3 - t2},
                           Compiles.of(list(compiled.items()), in_workers))
    emit_summary(summary, format_summary(summary), as_json=args.json,
                 json_path=args.summary_json, quiet=args.quiet)
    return 0



def _memory_cap(config: PlannerConfig, model: MemoryModel, budget: int
                ) -> tuple[PlannerConfig, str]:
    """With ``--long-sequences split``, ``config`` capped at the longest segment ``budget``
    holds in any group, so the plan passes the limit by construction; else ``config``. And the
    refusal's advice: split (naming the cap) when splitting would help."""
    from planner.longseq import memory_segment_cap, segment_capacity
    from planner.memory import REFUSAL_HINT

    cap = memory_segment_cap(config, model, budget)
    if cap >= segment_capacity(config)[0]:  # the pool's rule is the tighter: nothing to cap
        return config, REFUSAL_HINT
    if not cap:
        return config, ("a group packed full at --max-tokens-per-rank is over it whatever its "
                        "sequences' lengths: lower --max-tokens-per-rank or --cp-sizes' "
                        "largest, or plan for fused attention")
    if config.long_sequences == "split":
        return replace(config, max_segment_tokens=cap), REFUSAL_HINT
    return config, (f"with --long-sequences split, every sample over {cap:,} tokens is split "
                    "into segments that fit; or lower --max-tokens-per-rank, or plan for fused "
                    "attention")
