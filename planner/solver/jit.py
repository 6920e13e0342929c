"""The solver's numba decorator for per-element helpers: compiled without reference counting.

numba counts the references of every array a compiled function receives (an atomic increment
and decrement per array argument and call). A helper the kernels call for every segment with a
dozen arrays spent more time counting than working: half of a placement pass at N = 1024 was
those atomics (perf: NRT_incref / NRT_decref). ``no_refcount`` helpers take arrays, return
scalars and allocate nothing, so they need no counting; ``_nrt`` is numba's own switch for it
(its type stubs do not list it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba

F = TypeVar("F", bound=Callable[..., Any])
_NO_REFCOUNT: dict[str, Any] = {"cache": True, "_nrt": False}


def no_refcount(fn: F) -> F:
    """``numba.njit(cache=True)`` without reference counting (module docstring): only for
    functions that allocate nothing and return no array."""
    return cast(F, numba.njit(**_NO_REFCOUNT)(fn))
