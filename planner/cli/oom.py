"""Memory that ran out, as one line: under an address-space limit (``ulimit -v``) or on a full
host, numpy, pyarrow, OR-Tools, llvmlite or pandas fail with their own ``MemoryError``, or an
``ImportError`` whose shared object could not be mapped, deep inside a traceback. ``dcp-plan``
says instead that the memory ran out, where (the library being loaded, or the planner's own
function that asked), and the limit the process runs under."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

_MAP_FAILED = ("failed to map segment", "cannot allocate memory")
"""What the dynamic loader says of a shared object it could not map (ENOMEM)."""
_NO_THREAD = ("failed to launch worker thread", "can't start new thread")
"""pyarrow's and Python's words for a thread whose stack could not be mapped (EAGAIN)."""
_PACKAGE = Path(__file__).resolve().parents[1]
"""planner/: frames here are the planner's own."""


PLAN_HINT = "a small plan maps about 0.8 GiB with its libraries"
"""dcp-plan's figure: ``ulimit -v 800000`` plans the Quickstart, 700000 does not (2026-12-04)."""


def out_of_memory(e: BaseException, hint: str = "") -> str | None:
    """The message for ``e`` when it is memory that ran out (anywhere in its chain); else None.
    ``hint``: what the program needs at least, said in parentheses."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if _is_oom(cur):
            return (f"out of memory {_where(cur)}{_limit()}; free memory or raise the limit"
                    + (f" ({hint})" if hint else ""))
        cur = cur.__cause__ or cur.__context__
    return None


def reporting(prog: str, fn: Callable[[], int]) -> int:
    """``fn()``, with memory that ran out (``out_of_memory``) said in one line as ``PROG:
    error: ...`` and exit status 2 (``dcp-train`` and ``dcp-calibrate``: torch's import alone
    maps more than a small ``ulimit -v``). The process then ends at once: the exception has run
    every cleanup on its way here, and the interpreter's teardown could crash for want of
    memory (seen: exit 139 after the message)."""
    try:
        return fn()
    except (MemoryError, ImportError, OSError) as e:
        message = out_of_memory(e)
        if message is None:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(2)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    if isinstance(e, OSError) and e.errno == errno.ENOMEM:
        return True
    text = str(e).lower()
    if any(m in text for m in _NO_THREAD):
        return _limit() != ""  # under an address-space limit: its stack did not fit
    # The loader's own words; llvmlite re-raises them as a bare OSError (its cause holds them).
    return isinstance(e, (ImportError, OSError)) and any(m in text for m in _MAP_FAILED)


def _where(e: BaseException) -> str:
    """Where it ran out: ``while loading PACKAGE (imported at FILE:LINE)`` in an import (the
    package of the innermost library frame, or of the shared object the error names), ``in
    PACKAGE (called at FILE:LINE)`` inside a library, else ``in FUNCTION (FILE:LINE)`` of the
    innermost planner frame, else ``while starting``."""
    package = ""
    importing = isinstance(e, (ImportError, OSError))
    ours: tuple[str, str] | None = None
    tb: TracebackType | None = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = Path(code.co_filename)
        if path.is_relative_to(_PACKAGE):
            ours = (code.co_name, f"{path.relative_to(_PACKAGE.parent)}:{tb.tb_lineno}")
        package = _package_of(code.co_filename) or package
        importing = importing or code.co_name == "_find_and_load"
        tb = tb.tb_next
    if isinstance(e, (ImportError, OSError)):
        name = getattr(e, "name", None) or ""  # ImportError's module
        package = _package_of(str(e).split(":")[0]) or package or name.split(".")[0]
    if package:
        verb, at = ("while loading", "imported") if importing else ("in", "called")
        return f"{verb} {package}" + (f" ({at} at {ours[1]})" if ours else "")
    return f"in {ours[0]} ({ours[1]})" if ours else "while starting"


def _package_of(path: str) -> str:
    """``pandas`` of ``.../site-packages/pandas/_libs/x.so``; "" outside site-packages."""
    parts = Path(path).parts
    for where in ("site-packages", "dist-packages"):
        if where in parts and parts.index(where) + 1 < len(parts):
            return parts[parts.index(where) + 1]
    return ""


def _limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return ""
    return f" (this process may map {soft / 2**30:.2f} GiB: ulimit -v {soft // 1024})"
