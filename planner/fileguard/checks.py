"""The checks: ``check_output`` (a file to write), ``check_directory`` (a directory to write
into), ``check_input`` (a file to read); see the package docstring for what each refuses."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from planner.fileguard.kinds import KINDS
from planner.fileguard.temps import NAME_MAX, temp_path


def os_error_text(e: OSError) -> str:
    """``No space left on device (ENOSPC)``: the cause and its errno name, without a path."""
    name = errno.errorcode.get(e.errno or 0, "")
    text = e.strerror or str(e)
    return f"{text} ({name})" if name else text


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _stat(path: Path) -> os.stat_result | None:
    """``os.stat`` (following symlinks); None if nothing is there (or a dangling symlink)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path}: a symlink loop ({os_error_text(e)})") from None
        if e.errno in (errno.ENOTDIR, errno.ENAMETOOLONG):
            return None  # a parent is a file, a name too long: reported by _check_place
        raise ValueError(f"{path}: cannot inspect it: {os_error_text(e)}") from None


def check_input(path: str | os.PathLike[str], what: str = "input") -> Path:
    """Refuse an input that is not a regular file (a FIFO would hang or read as empty, a device
    would never end), naming it; a missing file passes (its reader reports it).

    Raises:
        ValueError: a FIFO, device, socket or directory, or a symlink loop.
    """
    p = Path(path)
    st = _stat(p)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{p}: is {_file_type(st.st_mode)}, not a regular file; {what} must "
                         "be a regular file")
    return p


def _same_file(out: Path, given: Path) -> bool:
    if os.path.realpath(out) == os.path.realpath(given):
        return True
    try:
        return os.path.samefile(out, given)
    except OSError:
        return False


def _probe(directory: Path, out: Path) -> None:
    """Create and remove a file in ``directory``: the real cause (EROFS, EACCES, ENOSPC on a
    full inode table) before any work, not after it."""
    probe = directory / temp_path(out, "probe").name
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    except OSError as e:
        raise ValueError(f"{out}: cannot write in {directory}: {os_error_text(e)}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def _check_place(out: Path, *, probe: bool = True) -> None:
    """The names fit, the parent is (or can become) a directory, and it can be written."""
    ancestor = out.parent
    while _stat(ancestor) is None and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    st = _stat(ancestor)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{out}: {ancestor} is not a directory")
    try:
        limit = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = NAME_MAX
    for part in out.parts[len(ancestor.parts):]:  # the names to be created
        if len(os.fsencode(part)) > limit:
            raise ValueError(f"{out}: the name {part[:40]!r}... is {len(os.fsencode(part))} "
                             f"bytes, more than the {limit} this file system allows")
    if probe:
        _probe(ancestor, out)


def check_directory(path: str | os.PathLike[str], *,
                    inputs: Iterable[str | os.PathLike[str]] = (), flag: str = "",
                    probe: bool = True) -> Path:
    """An output directory (a checkpoint root), checked before any work: a directory or one
    that can be created, not an input, not a file or special file (also through a symlink),
    and writable (``probe``: a file created and removed in it, or in its nearest existing
    ancestor, so EROFS or EACCES is known now).

    Raises:
        ValueError: naming ``path`` and what is wrong.
    """
    d = Path(path)
    hint = f"choose another {flag}" if flag else "choose another directory"
    for given in inputs:
        if _same_file(d, Path(given)):
            raise ValueError(f"{d}: is the input {given}, not a place to write ({hint})")
    st = _stat(d)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{d}: exists and is {_file_type(st.st_mode)}, not a directory "
                         f"({hint})")
    _check_place(d / ".probe", probe=probe)
    return d


def check_output(path: str | os.PathLike[str], *, kind: str,
                 inputs: Iterable[str | os.PathLike[str]] = (),
                 others: Mapping[str, str | os.PathLike[str]] | None = None,
                 overwrite: bool = False, flag: str = "") -> Path:
    """Refuse an output path that would destroy something or fail after the work (see the
    module docstring); call it before any work, and again when the inputs are known in full.

    Args:
        path: the output file.
        kind: one of ``KINDS``.
        inputs: every file the run reads (dataset files, plans, a cost model).
        others: the run's other outputs, by flag (``{"-o": plan}``): none may be this one.
        overwrite: a plan may replace a file that is not a plan (never an input, a directory
            or a special file).
        flag: the option that named ``path`` (``--summary-json``), for the hint.

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: naming ``path`` and what is wrong.
    """
    out = Path(path)
    spec = KINDS[kind]
    hint = f"choose another {flag}" if flag else "choose another path"
    for given in inputs:
        if _same_file(out, Path(given)):
            what = "a dataset with a plan" if kind == "plan" else "an input"
            raise ValueError(f"{out}: the output is the input {given}; refusing to overwrite "
                             f"{what} ({hint})")
    for other_flag, other in (others or {}).items():
        if other and _same_file(out, Path(other)):
            raise ValueError(f"{out}: is also this run's {other_flag} output ({hint})")
    st = _stat(out)
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            shown = f"{out} (-> {os.path.realpath(out)})" if out.is_symlink() else str(out)
            noun = "plan file path" if kind == "plan" and stat.S_ISDIR(st.st_mode) else \
                "regular file"
            raise ValueError(f"{shown}: is {_file_type(st.st_mode)}, not a {noun}; refusing "
                             f"to write the {spec.description} there ({hint})")
        if not (overwrite and kind == "plan") and not spec.own(out):
            extra = ", or pass --overwrite" if kind == "plan" else ""
            raise ValueError(f"{out}: exists and {spec.refusal}; refusing to overwrite it "
                             f"(remove it, {hint}{extra})")
    _check_place(out)
    return out
