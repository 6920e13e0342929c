"""``dcp-plan``'s inputs and outputs: the dataset flags (``plan`` and ``validate``) and the items
they give, the reader's notices, the default output, the files a run reads (its outputs are
refused when they are one of them: ``check_outputs``), and SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and
the other ending signals as an exception (``signals_raise``: so the writer's cleanup runs as on
Ctrl-C; schedulers and torchrun send SIGTERM, a closed terminal SIGHUP)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from planner.fileguard import check_output


def input_files(items: list[str], cost_model: str) -> list[str]:
    """Every file a plan run reads: the dataset items (both files of a Megatron pair) and a
    cost-model file."""
    from planner.sources.lengths import detect_format

    files = list(items)
    for item in items:
        try:
            fmt, source = detect_format(item)
        except ValueError:
            continue  # a directory, a glob or a missing file: read_lengths reports it
        if fmt == "megatron":
            files += [f"{source}.idx", f"{source}.bin"]
    if cost_model and Path(cost_model).suffix:
        files.append(cost_model)
    return files


def check_outputs(plan: str | os.PathLike[str], summary_json: str, inputs: list[str], *,
                  overwrite: bool) -> None:
    """The plan (``-o``) and the ``--summary-json`` file, checked before any work
    (``planner.fileguard.check_output``): neither may be an input, the other, a special file
    or an existing file of another kind."""
    from planner.planfile.io import check_output_path

    check_output_path(plan, inputs=inputs, overwrite=overwrite)
    if summary_json:
        check_output(summary_json, kind="summary", inputs=inputs, others={"-o/--output": plan},
                     flag="--summary-json")


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so that ``finally`` blocks clean up as on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def terminate(signum: int, frame: object) -> None:
    """A signal handler: ``signal.signal(signal.SIGTERM, terminate)``."""
    raise Terminated(signum)


ENDING_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU")
"""The catchable signals whose default action ends the process (SIGINT is Python's
KeyboardInterrupt already; SIGPIPE and SIGXFSZ Python ignores; SIGPROF and SIGVTALRM belong
to profilers)."""


@contextlib.contextmanager
def signals_raise(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Within the block, every one of ``ENDING_SIGNALS`` runs ``handler`` (which raises), so
    ``finally`` blocks clean up (temporaries, spills) as on Ctrl-C: SIGTERM always, the others
    where nobody set a handler (their default would kill the process and skip every cleanup).
    Restored after the block; main thread only (``signal.signal``'s rule)."""
    saved: dict[int, Any] = {}
    for name in ENDING_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        if name == "SIGTERM" or signal.getsignal(sig) == signal.SIG_DFL:
            saved[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def interrupting_signal(e: BaseException) -> int | None:
    """The signal behind ``e``: a ``Terminated`` or ``KeyboardInterrupt``, or one in its chain
    of causes; None for anything else.

    The chain matters for a signal that lands while C code is calling back into Python (numba
    unpickling a cached kernel, ``planner.cost._cheapest``): the handler's exception comes
    out wrapped in ``SystemError("... returned a result with an exception set")``.
    """
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, Terminated):
            return cur.signum
        if isinstance(cur, KeyboardInterrupt):
            return int(signal.SIGINT)
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def add_dataset_arguments(p: argparse.ArgumentParser, *, required: bool) -> None:
    """DATASET..., ``--data-path``, ``--skip-bad-records``, ``--field`` (and, for planning,
    ``--megatron-unit``): for planning (``required``) or for checking a plan's coverage
    (``validate``)."""
    p.add_argument("dataset", nargs="*", metavar="DATASET",
                   help="dataset files, directories or quoted globs, in order (see below)"
                   if required else "the plan's dataset, as given to dcp-plan: also check "
                   "coverage to the last token and the fingerprints")
    p.add_argument("--data-path", nargs="+", metavar="[WEIGHT] PATH", default=None,
                   help="Megatron-style dataset list instead of DATASET, with optional "
                   "weights: 'W1 PATH1 W2 PATH2 ...'")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="skip malformed records (reported) instead of stopping"
                   if required else "skip malformed records (default: as the plan was made: "
                   "a plan that skipped records records it, and validate skips them too)")
    p.add_argument("--field", help="record field (JSONL) or column (Parquet, Arrow) with tokens "
                   "or a length (default: input_ids, tokens, length, num_tokens, the first "
                   "present; with --tokenizer, the text field: text); the plan records it, so "
                   "dcp-train and validate read it too"
                   if required else "record field or column to read (default: the one the "
                   "plan was made with, its header's dataset.field); give it only for a "
                   "dataset whose field was renamed since planning: it is read, with a notice")
    if required:  # validate reads the unit the plan recorded (dataset.megatron_unit)
        add_megatron_unit_argument(p)


def add_megatron_unit_argument(p: argparse.ArgumentParser) -> None:
    """``--megatron-unit`` (dcp-plan, dcp-plan compare): what a sample of a Megatron file is."""
    p.add_argument("--megatron-unit", choices=("document", "sequence"), default="document",
                   help="what a sample of a Megatron .bin/.idx is: a document (its "
                   "sequences' tokens, concatenated: data preprocessed with "
                   "--split-sentences has a sequence per sentence) or one sequence (what "
                   "Megatron-core's GPTDataset samples); the plan records it")


def print_notice(message: str) -> None:
    """``dcp-plan: notice: ...`` on stderr (``read_lengths``'s ``notice`` callback)."""
    print(f"dcp-plan: notice: {message}", file=sys.stderr)


def dataset_items(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  *, required: bool = True) -> tuple[list[str], list[float] | None]:
    """The dataset's items and blend weights from DATASET... or --data-path (not both)."""
    from planner.sources.dataset import parse_data_path

    if args.dataset and args.data_path:
        parser.error("give the dataset as DATASET... or with --data-path, not both")
    if args.data_path:
        try:
            return parse_data_path(args.data_path)
        except ValueError as e:
            parser.error(str(e))
    if required and not args.dataset:
        parser.error("the dataset is required: DATASET... or --data-path PATH...")
    return list(args.dataset), None


def default_output(item: str) -> Path:
    """``plans/<stem>.arrow`` for the first dataset item (compression suffixes looked through)."""
    from planner.sources.compressed import strip_compression

    name = Path(strip_compression(item.rstrip("/")))
    stem = name.stem if name.suffix else name.name
    if set("*?[") & set(item):
        # A glob: its literal part ('shard-*.jsonl' -> shard), else the nearest directory
        # without a pattern ('ds/*.jsonl' -> ds); never a file literally named '*.arrow'.
        stem = re.sub(r"\[[^\]]*\]|[*?\[\]]", "", stem).strip("-_. ")
        parents = [p.name for p in name.parents if p.name and not set("*?[") & set(p.name)]
        stem = stem or (parents[0] if parents else "")
    return Path("plans") / f"{stem or 'plan'}.arrow"
