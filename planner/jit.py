"""The planner's numba kernels: Python until compiling them is worth it.

Compiling the kernels a plan needs costs about 23 CPU-s (140 compiles on the Quickstart's plan),
while that plan's kernels run in 0.2 CPU-s as plain Python over numpy, and give the same bytes.
So a kernel (``kernel``, ``no_refcount``) is a numba dispatcher that decides per call:

- **compiled** when numba's on-disk cache already holds it (loading costs milliseconds), when the
  process has spent ``BUDGET_S`` CPU-seconds in kernels run as Python (a large job: compiling now
  pays for itself), or when this call alone is expected to take more than the budget left (its
  array arguments' elements times the kernel's measured Python seconds per element; 1 us
  before its first call);
- **Python** (its ``py_func``) otherwise. A kernel called from a kernel running as Python runs as
  Python too unless it is compiled already, and only the outermost call's time counts.

``DCP_PLANNER_JIT`` overrides the choice for the process: ``auto`` (the default), ``always``
(compile every kernel on its first call, as plain ``numba.njit(cache=True)``; the test suite runs
so, testing the compiled kernels) or ``never`` (Python only; tests compare the two modes' plans
byte for byte). Both modes compute the same thing: the kernels use numpy scalars and arrays of
fixed dtypes, so integer and IEEE float arithmetic agree bit for bit.

``no_refcount``: numba counts the references of every array a compiled function receives (an
atomic increment and decrement per array argument and call). A helper the kernels call for every
segment with a dozen arrays spent more time counting than working: half of a placement pass at
N = 1024 was those atomics (perf: NRT_incref / NRT_decref). ``no_refcount`` helpers take arrays,
return scalars and allocate nothing, so they need no counting; ``_nrt`` is numba's own switch for
it (its type stubs do not list it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
from numba.core.registry import CPUDispatcher

__all__ = ["BUDGET_S", "MODES", "charge", "kernel", "mode", "no_refcount", "python_seconds",
           "set_mode"]

F = TypeVar("F", bound=Callable[..., Any])
BUDGET_S = 2.0
"""CPU-seconds a process spends in kernels run as Python before it compiles them."""
FIRST_RATE_S = 1e-6
"""Python seconds per array element expected of a kernel before its first call is measured."""
NOTED_CALLS = 8
"""Calls per kernel whose signatures ``Kernel.note`` keeps (a kernel's calls share one or two)."""
MODES = ("auto", "always", "never")
ENV = "DCP_PLANNER_JIT"


class _State:
    """The process's choice: Python seconds spent, whether the budget is gone, the call depth."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.compiling = False
        self.depth = 0
        self.mode = ""


_STATE = _State()


def mode() -> str:
    """``DCP_PLANNER_JIT`` of this process (read once), checked."""
    if not _STATE.mode:
        m = os.environ.get(ENV, "auto") or "auto"
        if m not in MODES:
            raise ValueError(f"{ENV}={m!r}: expected one of {', '.join(MODES)}")
        _STATE.mode = m
        _STATE.compiling = m == "always"
    return _STATE.mode


def set_mode(m: str) -> None:
    """Set the process's mode (tests and benchmarks; users set ``DCP_PLANNER_JIT``) and start a
    new budget."""
    if m not in MODES:
        raise ValueError(f"jit mode {m!r}: expected one of {', '.join(MODES)}")
    _STATE.mode, _STATE.compiling, _STATE.spent = m, m == "always", 0.0
    _PENDING.clear()
    for d in _ALL:
        _lazy(d)


def python_seconds() -> float:
    """CPU-seconds this process has spent in kernels run as Python."""
    return _STATE.spent


def _elements(args: tuple[Any, ...]) -> int:
    return sum(a.size for a in args if isinstance(a, np.ndarray))


class Kernel(CPUDispatcher):
    """A kernel compiled in this process (or loaded from the cache): numba's dispatcher as it
    is, its C call path untouched."""

    _dcp_sigs: set[tuple[Any, ...]]
    _dcp_notes: int

    def runs_compiled(self, python_s: float) -> bool:
        """Whether a call expected to take ``python_s`` as Python would run compiled: for a
        caller with a Python way of its own (``planner.sources.jsonl``: ``json.loads`` per line)
        that then ``charge``s its time."""
        return True

    def note(self, *args: Any) -> None:
        """Remember this call's signature, run as Python (or in the caller's own Python way), to
        compile it once the budget is spent: a large job then leaves every kernel it used in
        the cache, and the next run of its size runs them all compiled from the start."""
        self._dcp_notes += 1
        if self._dcp_notes > NOTED_CALLS:  # typing every call's arguments would cost more
            return
        sig = tuple(self.typeof_pyval(a) for a in args)
        if sig not in self._dcp_sigs:
            self._dcp_sigs.add(sig)
            _PENDING.append((self, sig))


class _Lazy(Kernel):
    """A kernel not compiled yet in this process: decides per call (module docstring), and
    becomes a ``Kernel`` the first time it runs compiled."""

    _dcp_cached: bool | None
    _dcp_rate: float
    _dcp_measured: bool

    def runs_compiled(self, python_s: float) -> bool:
        state = _STATE
        m = state.mode or mode()
        if state.compiling:
            return True
        if m == "never":
            return False
        if self._dcp_cached is None:
            # numba's cache index for this function (empty: nothing cached, or stale)
            index = self._cache._cache_file._load_index()  # type: ignore[attr-defined]
            self._dcp_cached = bool(index)
        if self._dcp_cached:
            return True
        if state.spent + python_s > BUDGET_S:  # the job is large: compile from now on
            _spend_all()
            return True
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = _STATE
        if state.depth:  # inside a kernel running as Python
            return self.py_func(*args, **kwargs)
        m = state.mode or mode()
        if self.runs_compiled(_elements(args) * self._dcp_rate):
            self.__class__ = Kernel  # type: ignore[assignment]  # compiled from now on
            return CPUDispatcher.__call__(self, *args, **kwargs)
        if m == "auto":
            self.note(*args)
        t = time.process_time()
        state.depth = 1
        try:
            return self.py_func(*args, **kwargs)
        finally:
            state.depth = 0
            dt = time.process_time() - t
            state.spent += dt
            if m == "auto":
                rate = dt / max(_elements(args), 1)
                self._dcp_rate = max(self._dcp_rate, rate) if self._dcp_measured else rate
                self._dcp_measured = True
                charge(0.0)


_PENDING: list[tuple[Kernel, tuple[Any, ...]]] = []
"""Signatures run as Python in this process, compiled when the budget is spent."""


def charge(seconds: float) -> None:
    """Count ``seconds`` of Python work done instead of a kernel against the budget; once it is
    spent, compile (and so cache) what ran as Python (``Kernel.note``)."""
    _STATE.spent += seconds
    if (_STATE.mode or mode()) == "auto" and not _STATE.compiling and _STATE.spent > BUDGET_S:
        _spend_all()


def _spend_all() -> None:
    """The budget is gone: every kernel compiles from now on, and what ran as Python does now."""
    _STATE.compiling = True
    while _PENDING:
        k, sig = _PENDING.pop(0)
        k.compile(sig)


_ALL: list[Kernel] = []


def _lazy(d: Any) -> None:
    d.__class__ = _Lazy  # same layout: the subclasses add no slots
    d._dcp_cached = None
    d._dcp_rate = FIRST_RATE_S
    d._dcp_measured = False


def _make(fn: Callable[..., Any], options: dict[str, Any]) -> Any:
    d = numba.njit(cache=True, **options)(fn)
    _lazy(d)
    d._dcp_sigs = set()
    d._dcp_notes = 0
    _ALL.append(d)
    return d


def kernel(fn: F) -> F:
    """``numba.njit(cache=True)``, run as Python until compiling pays (module docstring)."""
    return cast(F, _make(fn, {}))


def no_refcount(fn: F) -> F:
    """``kernel`` without reference counting (module docstring): only for functions that
    allocate nothing and return no array."""
    return cast(F, _make(fn, {"_nrt": False}))
