"""``dcp-plan``'s inputs and outputs: the dataset items of the command line, the default output,
the files a run reads (its outputs are refused when they are one of them: ``check_outputs``),
and SIGTERM as an exception (so the writer's cleanup runs as on Ctrl-C; schedulers and torchrun
send SIGTERM)."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

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
    return Path("plans") / f"{stem or 'plan'}.arrow"
