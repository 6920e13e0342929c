"""Where the planner's numba kernels are cached, and how long this process spent compiling them.

Why a directory of the planner's own: numba's ``cache=True`` writes beside the source
(``__pycache__``) whenever that directory is writable, and only otherwise falls back to
``~/.cache/numba``. So the install tree is written by whoever runs the planner first if they
can (root in a container or CI, the owner of a shared prefix): files ``pip uninstall`` leaves
behind, an image layer that changes after the build, and, under root, no way to tell a
read-only install from a writable one. The planner therefore always caches its own kernels
per user: in ``$NUMBA_CACHE_DIR`` when it is set (numba's own locator, as numba documents),
else in ``$XDG_CACHE_HOME/dcp-planner/numba`` (``~/.cache/dcp-planner/numba``). An entry's
folder is named by its source directory's absolute path (numba's
``get_suitable_cache_subpath``), so a checkout, a wheel and two virtualenvs never share or
evict each other's entries; numba checks each entry against the source's stamp (its content
hash in numba 0.68, its mtime and size in older releases), so an edited source recompiles.
Deleting the folder is always safe: the next run compiles again.

How: numba picks a function's cache locator when the function is decorated
(``njit(cache=True)``, when its module is imported), from the list
``CacheImpl._locator_classes`` (private; ``_CacheImpl`` in older releases); ``install`` puts
``PlannerLocator`` first (a numba with neither name keeps its own choice). It answers only for
files under this package, so other libraries' numba caches are left where numba puts them.
``planner/__init__`` calls ``prepare``, which must not import numba itself (a runtime rank that
imports ``planner.planfile.schema`` only must not pay 0.2 s for it): with numba loaded it
installs at once, else right after ``numba.core.caching`` is first executed (a one-shot
meta-path hook), which is before any kernel can be decorated.

Compile time: numba emits a ``numba:compile`` event around every real compile, never around a
cache load (the dispatcher tries the cache first). A kernel's compile compiles the kernels it
calls inside its own event, so only the outermost events' durations add up to wall time; an
event of a ``cache=True`` function is one compiled signature (numba's own jitted implementations
of numpy functions compile inside them and are not counted). A spawned worker (``--workers``,
local Ray) appends its totals to the file named by ``COMPILE_LOG_ENV`` (``worker_compiles``), so
the driver can report them.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["COMPILE_LOG_ENV", "CompileTotals", "cache_dir", "compile_totals", "install",
           "prepare", "worker_compiles"]

COMPILE_LOG_ENV = "DCP_PLANNER_COMPILE_LOG"
"""``DRIVER_PID:PATH``: every planner process but the driver appends ``pid seconds
signatures`` to PATH after each of its top-level compiles (``worker_compiles`` sets it)."""
_PACKAGE = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
_HOOKED = "numba.core.caching"


@dataclass(frozen=True, slots=True)
class CompileTotals:
    """Numba compiles of one process: wall seconds of the top-level compiles, and the
    signatures of ``cache=True`` functions compiled (each one cache entry)."""

    seconds: float = 0.0
    signatures: int = 0

    def __sub__(self, other: CompileTotals) -> CompileTotals:
        return CompileTotals(seconds=self.seconds - other.seconds,
                             signatures=self.signatures - other.signatures)


def cache_dir() -> Path:
    """The per-user folder of the planner's numba cache when ``NUMBA_CACHE_DIR`` is unset.

    ``XDG_CACHE_HOME`` counts only when absolute (the XDG spec says to ignore a relative one).
    """
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "dcp-planner" / "numba"


class _Clock:
    """The process's compile totals (module docstring); fed by the numba event listener."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = 0.0
        self.totals = CompileTotals()

    def start(self) -> None:
        if self.depth == 0:
            self.started = time.perf_counter()
        self.depth += 1

    def end(self, cached: bool) -> None:
        # A failed compile counts too (it took the time; numba raises it to the caller).
        # Event.is_failed cannot tell: in numba 0.68 it is inverted (true when the compile
        # succeeded: it tests that no exception was given).
        self.depth -= 1
        seconds = self.totals.seconds
        if self.depth == 0:
            seconds += time.perf_counter() - self.started
        self.totals = CompileTotals(seconds=seconds,
                                    signatures=self.totals.signatures + cached)
        if self.depth == 0:
            _log_to_driver(self.totals)


_CLOCK = _Clock()
_installed = False


def compile_totals() -> CompileTotals:
    """This process's numba compiles so far (none before ``install``: the planner's kernels
    cannot compile before it)."""
    return _CLOCK.totals


def _log_to_driver(totals: CompileTotals) -> None:
    """Append this process's totals to the driver's log, if a driver asked and it is another
    process. ``O_APPEND`` without ``O_CREAT``: a Ray task on another node, where the path does
    not exist, writes nothing; one short write per line, so lines of processes never mix."""
    path = os.environ.get(COMPILE_LOG_ENV, "")
    if not path:
        return
    driver, _, path = path.partition(":")
    if driver == str(os.getpid()):
        return
    line = f"{os.getpid()} {totals.seconds:.6f} {totals.signatures}\n".encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _locator_class(caching: ModuleType, config: ModuleType) -> type:
    """``PlannerLocator``, built on numba's own source-file locator (stamp, disambiguator,
    the writability check that makes numba fall back to its next locator)."""

    class PlannerLocator(caching._SourceFileBackedLocatorMixin,  # type: ignore[name-defined,misc]
                         caching._CacheLocator):  # type: ignore[name-defined,misc]
        """The per-user cache folder (``cache_dir``) for functions of this package."""

        def __init__(self, py_func: Any, py_file: str) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(cache_dir() / self.get_suitable_cache_subpath(py_file))

        def get_cache_path(self) -> str:
            return self._cache_path

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            # NUMBA_CACHE_DIR wins (numba's first locator takes it); other packages' functions
            # go where numba puts them; no home directory: numba's own choice.
            if config.CACHE_DIR or not os.path.realpath(py_file).startswith(_PACKAGE + os.sep):
                return None
            try:
                return super().from_function(py_func, py_file)
            except (RuntimeError, KeyError):  # Path.home() without HOME or a passwd entry
                return None

    return PlannerLocator


def install() -> None:
    """Put the planner's locator first in numba's list and start the compile clock; once.

    Imports numba: call it before any planner kernel is decorated (``prepare`` does).
    """
    global _installed
    if _installed:
        return
    _installed = True
    from numba.core import caching, config
    from numba.core import event as ev

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    if impl is not None and hasattr(caching, "_SourceFileBackedLocatorMixin"):
        impl._locator_classes.insert(0, _locator_class(caching, config))

    class Listener(ev.Listener):
        def on_start(self, event: Any) -> None:
            _CLOCK.start()

        def on_end(self, event: Any) -> None:
            # Signatures of cache=True functions only: the implementations of numpy functions
            # that numba compiles inside a kernel's event (about as many again) cache nowhere.
            dispatcher = (event.data or {}).get("dispatcher")
            cache = getattr(dispatcher, "_cache", None)
            _CLOCK.end(cached=getattr(cache, "cache_path", None) is not None)

    ev.register("numba:compile", Listener())  # type: ignore[no-untyped-call]


class _AfterImport:
    """A meta-path finder that finds nothing itself: it runs ``install`` right after
    ``numba.core.caching`` has been executed, then leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != _HOOKED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            # Removed only now: importlib iterates sys.meta_path while it asks the finders.
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            install()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def prepare() -> None:
    """Make the planner's kernels cache per user (module docstring), without importing numba."""
    if _HOOKED in sys.modules:
        install()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


@dataclass(frozen=True, slots=True)
class WorkerCompiles:
    """What the processes started under ``worker_compiles`` compiled, per process."""

    path: str

    def read(self) -> list[CompileTotals]:
        """Each process's last totals (its lines are cumulative), in pid order."""
        last: dict[int, CompileTotals] = {}
        if not self.path:
            return []
        try:
            text = Path(self.path).read_text()
        except OSError:
            return []
        for line in text.splitlines():
            pid, seconds, signatures = line.split()
            last[int(pid)] = CompileTotals(seconds=float(seconds), signatures=int(signatures))
        return [last[pid] for pid in sorted(last)]


@contextmanager
def worker_compiles(enabled: bool = True,
                    folder: str | Path | None = None) -> Iterator[WorkerCompiles]:
    """Processes started inside (spawned workers, a local Ray) report their compiles.

    The environment variable is inherited by the processes started while it is set; it and
    the log (in ``folder``, default the temporary directory) are removed on exit. Not
    ``enabled`` (a run in one process): nothing is set, and ``read`` finds nothing.
    """
    import tempfile

    if not enabled:
        yield WorkerCompiles("")
        return
    fd, path = tempfile.mkstemp(prefix="dcp-compile-", suffix=".log", dir=folder)
    os.close(fd)
    before = os.environ.get(COMPILE_LOG_ENV)
    os.environ[COMPILE_LOG_ENV] = f"{os.getpid()}:{path}"
    try:
        yield WorkerCompiles(path)
    finally:
        if before is None:
            os.environ.pop(COMPILE_LOG_ENV, None)
        else:
            os.environ[COMPILE_LOG_ENV] = before
        os.unlink(path)
