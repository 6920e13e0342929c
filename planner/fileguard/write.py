"""Writing an output: atomically (a temporary, fsync, rename, fsync of the directory) or, for
a log, by appending."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from planner.fileguard.checks import check_output, os_error_text
from planner.fileguard.kinds import KINDS
from planner.fileguard.temps import fsync_dir, remove_stale_temps, temp_path


def _discard(p: Path) -> None:
    """Remove a temporary; its own failure never replaces the error being raised."""
    with contextlib.suppress(OSError):
        p.unlink()


def _fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], *, kind: str, overwrite: bool = False,
                  inputs: Iterable[str | os.PathLike[str]] = ()) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for the caller to write (with any library); on a
    normal exit it is fsynced and renamed over ``path``, on any exception removed.

    ``check_output`` runs again first (the file may have changed since the run's start); the
    parent directories are created. An ``OSError`` (a full disk, a quota, EIO) becomes
    ``ValueError("PATH: cannot write the KIND: CAUSE")`` naming ``path``, not the temporary.
    """
    out = check_output(path, kind=kind, overwrite=overwrite, inputs=inputs)
    description = KINDS[kind].description
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{out}: cannot create its directory {out.parent}: "
                         f"{os_error_text(e)}") from None
    remove_stale_temps(out)
    tmp = temp_path(out)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:  # pyarrow's ArrowIOError is an OSError too
        _discard(tmp)
        raise ValueError(f"{out}: cannot write the {description}: {os_error_text(e)}") from None
    except BaseException:
        _discard(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, kind: str,
                 inputs: Iterable[str | os.PathLike[str]] = ()) -> Path:
    """Check ``path`` (``check_output``) and write ``data`` to it atomically."""
    raw = data.encode() if isinstance(data, str) else data
    with atomic_output(path, kind=kind, inputs=inputs) as tmp, open(tmp, "wb") as f:
        f.write(raw)
    return Path(path)


def open_log(path: str | os.PathLike[str], *,
             inputs: Iterable[str | os.PathLike[str]] = ()) -> IO[str]:
    """Open an append-only JSON-lines log (``check_output(kind="log")``: an empty file or a log
    of this tool, never an input or a special file); a log whose last line lost its newline (a
    killed writer) gets one first, so every record stays on a line of its own."""
    out = check_output(path, kind="log", inputs=inputs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "ab+") as raw:
            end = raw.seek(0, os.SEEK_END)
            torn = end > 0 and raw.seek(end - 1) >= 0 and raw.read(1) != b"\n"
        f = open(out, "a", encoding="utf-8")  # noqa: SIM115 - the caller closes it
        if torn:
            f.write("\n")
    except OSError as e:
        raise ValueError(f"{out}: cannot open the log: {os_error_text(e)}") from None
    return f
