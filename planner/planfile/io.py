"""Plan file I/O: atomic Arrow IPC writer and a memory-mapped reader with O(1) step access.

The writer streams to ``<path>.tmp-<pid>`` in the same directory and renames it over ``path`` only
after the footer is written and fsynced, so a crash or a validation error never leaves a partial
plan under the final name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from numpy.typing import NDArray

from planner.planfile.schema import (
    COLUMN_NAMES,
    COLUMNS,
    HEADER_KEY,
    PlanHeader,
    arrow_schema,
    step_batch,
)
from planner.planfile.validate import validate


def write_plan(path: str | os.PathLike[str], header: PlanHeader,
               steps: Iterable[pa.RecordBatch], *, lengths: NDArray[np.integer] | None = None,
               check: bool = True) -> Path:
    """Validate and write ``steps`` (batch i = step i) with ``header`` to ``path`` atomically.

    Args:
        path: the plan file; its directory is created.
        header: the plan header.
        steps: one record batch per step.
        lengths: the dataset's sample lengths; with them, coverage is checked to the last token.
        check: run ``planfile.validate`` first (the default): an invalid plan raises ValueError and
            nothing is written. ``False`` streams without holding the steps (for callers that
            validated already).

    Returns:
        ``path``.
    """
    path = Path(path)
    if check:
        steps = list(steps)
        validate(header, steps, lengths, source=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    schema = arrow_schema(header)
    try:
        with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, schema) as writer:
            for batch in steps:
                if batch.schema.remove_metadata() != schema.remove_metadata():
                    raise ValueError(f"step batch schema {batch.schema} does not match the plan's")
                writer.write_batch(batch.replace_schema_metadata(schema.metadata))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class PlanFile:
    """A memory-mapped plan: header, step count and O(1) access to one step's record batch."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"{self.path}: no such plan file")
        try:
            self._source = pa.memory_map(str(self.path), "r")
            self._reader = ipc.open_file(self._source)
        except pa.ArrowInvalid as e:
            raise ValueError(f"{self.path}: not an Arrow IPC plan file ({e})") from None
        meta = self._reader.schema.metadata or {}
        if HEADER_KEY not in meta:
            raise ValueError(f"{self.path}: no {HEADER_KEY.decode()} header; not a dcp plan")
        self.header = PlanHeader.from_json(meta[HEADER_KEY], source=str(self.path))
        missing = [c for c in COLUMN_NAMES if c not in self._reader.schema.names]
        if missing:
            raise ValueError(f"{self.path}: plan lacks columns {missing}")

    @property
    def schema(self) -> pa.Schema:
        return self._reader.schema

    @property
    def num_steps(self) -> int:
        return int(self._reader.num_record_batches)

    def __len__(self) -> int:
        return self.num_steps

    def step(self, i: int) -> pa.RecordBatch:
        """Step ``i``'s rows (zero-copy from the memory map)."""
        if not 0 <= i < self.num_steps:
            raise IndexError(f"{self.path}: step {i} out of range 0..{self.num_steps - 1}")
        return self._reader.get_batch(i)

    def __getitem__(self, i: int) -> pa.RecordBatch:
        return self.step(i)

    def table(self) -> pa.Table:
        """All steps as one table (reads the whole file)."""
        return self._reader.read_all()

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> PlanFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Spill:
    """Steps spilled to a header-less Arrow file, read back one batch at a time (not mapped:
    a memory map would count every page read towards the process's resident memory)."""

    def __init__(self, path: Path) -> None:
        self._file = pa.OSFile(str(path), "rb")
        self._reader = ipc.open_file(self._file)

    def __len__(self) -> int:
        return int(self._reader.num_record_batches)

    def __getitem__(self, i: int) -> pa.RecordBatch:
        return self._reader.get_batch(i)

    def close(self) -> None:
        self._file.close()


def write_plan_stream(path: str | os.PathLike[str], steps: Iterable[dict[str, NDArray[Any]]],
                      header: Callable[[], PlanHeader], *,
                      lengths: NDArray[np.integer] | None = None) -> Path:
    """Write a plan whose header is known only after its last step, in bounded memory.

    Each step's columns (``steps`` is consumed once, in order) go to a spill file next to
    ``path`` as they come; then ``header()`` is asked for, the spilled steps are validated
    against it (``planfile.validate``, coverage with ``lengths``) and copied into the plan
    through ``write_plan``. At no point are two steps in memory; the spill is always removed,
    and nothing is written under ``path`` unless the plan is valid.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    spill = path.with_name(f".{path.name}.spill-{os.getpid()}")
    plain = pa.schema([pa.field(n, t, nullable=False) for n, t in COLUMNS])
    try:
        with pa.OSFile(str(spill), "wb") as sink, ipc.new_file(sink, plain) as writer:
            for cols in steps:
                writer.write_batch(step_batch(plain, cols))
        final = header()
        reader = _Spill(spill)
        try:
            validate(final, reader, lengths, source=str(path))
            write_plan(path, final, (reader[i] for i in range(len(reader))), check=False)
        finally:
            reader.close()
    finally:
        spill.unlink(missing_ok=True)
    return path
