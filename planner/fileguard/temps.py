"""Temporary names beside an output, and the removal of those a killed writer left."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
from pathlib import Path

NAME_MAX = 255
"""Bytes in one file name on the file systems we write to (ext4, xfs, tmpfs, NFS)."""
_TAGS = ("tmp", "spill", "probe")


def temp_path(path: str | os.PathLike[str], tag: str = "tmp", pid: int | None = None) -> Path:
    """``.<name>.<tag>-<pid>`` beside ``path``; a name too long for that keeps a prefix of it
    and 8 hex digits of its sha256, so the temporary fits ``NAME_MAX`` bytes."""
    p = Path(path)
    return p.with_name(f"{_temp_stem(p.name)}.{tag}-{os.getpid() if pid is None else pid}")


def _temp_stem(name: str) -> str:
    stem = f".{name}"
    if len(os.fsencode(stem)) + 24 <= NAME_MAX:
        return stem
    prefix = os.fsencode(name)[: NAME_MAX - 24 - 10].decode("utf-8", "ignore")
    return f".{prefix}~{hashlib.sha256(os.fsencode(name)).hexdigest()[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries beside ``path`` (``temp_path`` names) whose process is gone."""
    p = Path(path)
    pattern = re.compile(rf"^{re.escape(_temp_stem(p.name))}\.(?:{'|'.join(_TAGS)})-(\d+)$")
    removed: list[Path] = []
    if not p.parent.is_dir():
        return removed
    for q in p.parent.iterdir():
        m = pattern.match(q.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                q.unlink()
                removed.append(q)
    return removed


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so that a rename inside it survives a power loss (POSIX)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # not supported here (e.g. Windows): the rename is still atomic
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on a directory
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
