"""Plan file I/O: atomic, checksummed Arrow IPC writer and a verifying memory-mapped reader.

The writer streams to ``.<name>.tmp-<pid>`` in the same directory, fsyncs it, renames it over
``path`` and fsyncs the directory (``planner.fileguard.atomic_output``), so a crash, a signal or
a validation error never leaves a partial plan under the final name. Temporary files of earlier
runs that were killed (their pid is gone) are removed by the next write to the same path. An
existing file that is not a plan is never replaced unless the caller says ``overwrite``; an
input, a directory or a special file never (``fileguard.check_output``).

The reader (``PlanFile``) checks on open that the header's sha256 matches, that the column types
are exactly the plan's, and that the file's two copies of the schema agree; ``step(i)`` checks
step i's sha256 the first time it is read (format version 2; see ``planner.checksum``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from numpy.typing import NDArray

from planner.fileguard import (
    atomic_output,
    check_input,
    check_output,
    fsync_dir,
    is_plan_file,
    os_error_text,
    remove_stale_temps,
    temp_path,
)
from planner.planfile.checksum import (
    HEADER_CHECKSUM_KEY,
    STEP_CHECKSUM_KEY,
    header_digest,
    step_digest,
)
from planner.planfile.schema import (
    COLUMN_NAMES,
    COLUMNS,
    HEADER_KEY,
    PlanHeader,
    arrow_schema,
    check_schema,
    column_numpy,
    step_batch,
)
from planner.planfile.validate import validate

__all__ = ["PlanFile", "check_output_path", "fsync_dir", "is_plan_file", "write_plan",
           "write_plan_stream"]

_ARROW_ERRORS = (pa.ArrowException, OSError, EOFError)


def check_output_path(path: str | os.PathLike[str], *, inputs: Iterable[str] = (),
                      overwrite: bool = False) -> Path:
    """Refuse a plan output path that would destroy something the user owns
    (``planner.fileguard.check_output`` with ``kind="plan"``).

    Raises:
        ValueError: ``path`` is (resolves to, or is a hard link of) one of ``inputs``; it is a
            directory, a FIFO, a device or a socket (also through a symlink); it exists, is not
            a plan, and ``overwrite`` is False; or its directory cannot be written.
    """
    return check_output(path, kind="plan", inputs=inputs, overwrite=overwrite,
                        flag="-o/--output")


def write_plan(path: str | os.PathLike[str], header: PlanHeader,
               steps: Iterable[pa.RecordBatch], *, lengths: NDArray[np.integer] | None = None,
               check: bool = True, overwrite: bool = False) -> Path:
    """Validate and write ``steps`` (batch i = step i) with ``header`` to ``path`` atomically.

    Args:
        path: the plan file; its directory is created. An existing plan there is replaced.
        header: the plan header.
        steps: one record batch per step.
        lengths: the dataset's sample lengths; with them, coverage is checked to the last token.
        check: run ``planfile.validate`` first (the default): an invalid plan raises ValueError and
            nothing is written. ``False`` streams without holding the steps (for callers that
            validated already).
        overwrite: replace an existing file that is not a plan (refused by default).

    Returns:
        ``path``.

    Raises:
        ValueError: an invalid plan, a path that is not safe to replace, or a failed write (a
            full disk, a read-only directory), naming the path; nothing is left behind.
    """
    path = check_output_path(path, overwrite=overwrite)
    if check:
        steps = list(steps)
        validate(header, steps, lengths, source=str(path))
    with _plan_sink(path, header, overwrite=overwrite) as put:
        for batch in steps:
            put(batch, None)
    return path


@contextlib.contextmanager
def _plan_sink(path: Path, header: PlanHeader, *, overwrite: bool
               ) -> Iterator[Callable[[pa.RecordBatch, dict[str, NDArray[Any]] | None], None]]:
    """``put(batch, columns)`` writes a step into a temporary next to ``path`` (``columns``:
    the batch's as numpy, when the caller has them); a normal exit of the block fsyncs it and
    renames it over ``path``, any exception removes it (ValueError naming the path for I/O)."""
    schema = arrow_schema(header)
    plain = schema.remove_metadata()
    # The writer closes (the file is complete) before atomic_output fsyncs and renames it.
    with atomic_output(path, kind="plan", overwrite=overwrite) as tmp, \
            pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, schema) as writer:
        def put(batch: pa.RecordBatch, cols: dict[str, NDArray[Any]] | None) -> None:
            if batch.schema.remove_metadata() != plain:
                raise ValueError(f"step batch schema {batch.schema} does not match the plan's")
            digest = step_digest([cols[n] if cols is not None else column_numpy(batch, n)
                                  for n in COLUMN_NAMES])
            writer.write_batch(batch.replace_schema_metadata(schema.metadata),
                               custom_metadata={STEP_CHECKSUM_KEY: digest.encode()})
        yield put


class PlanFile:
    """A memory-mapped plan: header, step count and O(1) access to one step's record batch."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = check_input(path, "a plan")
        if not self.path.is_file():
            raise ValueError(f"{self.path}: no such plan file")
        src = str(self.path)
        try:
            self._source = pa.memory_map(src, "r")
            self._reader = ipc.open_file(self._source)
            schema = self._reader.schema
        except _ARROW_ERRORS as e:
            raise ValueError(f"{self.path}: not an Arrow IPC plan file ({e})") from None
        meta = schema.metadata or {}
        if HEADER_KEY not in meta:
            raise ValueError(f"{self.path}: no {HEADER_KEY.decode()} header; not a dcp plan")
        text = meta[HEADER_KEY]
        stored = meta.get(HEADER_CHECKSUM_KEY)
        if stored is not None and stored != header_digest(text).encode():
            raise ValueError(f"{self.path}: header checksum mismatch (the file is damaged)")
        self.header = PlanHeader.from_json(text, source=src)
        if stored is None and self.header.format_version >= 2:
            raise ValueError(f"{self.path}: header has no checksum ({HEADER_CHECKSUM_KEY.decode()}"
                             f"), required by format version {self.header.format_version}")
        check_schema(schema, src)
        self._check_first_schema_copy()
        self._verified: set[int] = set()

    def _check_first_schema_copy(self) -> None:
        # An IPC file holds the schema twice: at the start of its stream and in the footer.
        # pyarrow's file reader reads only the footer, so a damaged first copy would otherwise
        # pass here and break any stream reader of the same bytes.
        try:
            self._source.seek(0)
            buf = self._source.read_buffer(self._source.size())
            first = ipc.open_stream(pa.BufferReader(buf.slice(8))).schema
        except _ARROW_ERRORS as e:
            raise ValueError(f"{self.path}: the schema at the start of the file is damaged "
                             f"({e})") from None
        if not first.equals(self._reader.schema, check_metadata=True):
            raise ValueError(f"{self.path}: the schema at the start of the file differs from "
                             "the footer's copy (the file is damaged)")

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
        try:
            batch, meta = self._reader.get_batch_with_custom_metadata(i)
        except _ARROW_ERRORS as e:
            raise ValueError(f"{self.path}: step {i} is unreadable ({e})") from None
        if i not in self._verified:
            self._verify(i, batch, meta)
        return batch

    def _verify(self, i: int, batch: pa.RecordBatch, meta: pa.KeyValueMetadata | None) -> None:
        stored = (meta or {}).get(STEP_CHECKSUM_KEY)
        if stored is None:
            if self.header.format_version >= 2:
                raise ValueError(f"{self.path}: step {i} has no checksum, required by format "
                                 f"version {self.header.format_version}")
        else:
            try:
                digest = step_digest([column_numpy(batch, n) for n in COLUMN_NAMES])
            except ValueError as e:
                raise ValueError(f"{self.path}: step {i}: {e}") from None
            if stored != digest.encode():
                raise ValueError(f"{self.path}: step {i} checksum mismatch (the file is "
                                 "damaged)")
        self._verified.add(i)

    def __getitem__(self, i: int) -> pa.RecordBatch:
        return self.step(i)

    def table(self) -> pa.Table:
        """All steps as one table (reads the whole file, checking every step's checksum)."""
        return pa.Table.from_batches([self.step(i) for i in range(self.num_steps)],
                                     schema=self._reader.schema)

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
                      lengths: NDArray[np.integer] | None = None,
                      overwrite: bool = False) -> Path:
    """Write a plan whose header is known only after its last step, in bounded memory.

    Each step's columns (``steps`` is consumed once, in order) go to a spill file next to
    ``path`` as they come; then ``header()`` is asked for, and in one pass over the spill every
    step is validated against it (``planfile.validate``, coverage with ``lengths``) and copied
    into the plan's temporary, renamed into place only if all of it is valid. At no point are
    two steps in memory; the spill is always removed, and nothing is written under ``path``
    unless the plan is valid.
    """
    path = check_output_path(path, overwrite=overwrite)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{path}: cannot create its directory {path.parent}: "
                         f"{os_error_text(e)}") from None
    remove_stale_temps(path)
    spill = temp_path(path, "spill")
    plain = pa.schema([pa.field(n, t, nullable=False) for n, t in COLUMNS])
    try:
        try:
            with pa.OSFile(str(spill), "wb") as sink, ipc.new_file(sink, plain) as writer:
                for cols in steps:
                    writer.write_batch(step_batch(plain, cols))
        except OSError as e:  # a full disk while spilling: name the plan, leave nothing
            raise ValueError(f"{path}: cannot write the plan: {os_error_text(e)}") from None
        final = header()
        reader = _Spill(spill)
        try:
            # One pass: each step is checked, then copied into the plan's temporary, which
            # becomes the plan only when every check (coverage at each epoch's end) passed.
            with _plan_sink(path, final, overwrite=overwrite) as put:
                validate(final, reader, lengths, source=str(path), on_step=put)
        finally:
            reader.close()
    finally:
        with contextlib.suppress(OSError):  # never hides the error that got us here
            spill.unlink()
    return path
