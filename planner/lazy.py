"""Lazy package exports (PEP 562): a package's public names imported only when first used.

``planner``, ``planner.planfile``, ``planner.cli``, ``runtime``, ``runtime.train`` and
``runtime.calibrate`` keep ``--version`` / ``--help`` and light imports from loading numba,
pyarrow or torch: each maps a name to the module that defines it and sets
``__getattr__ = lazy_exports(__name__, _EXPORTS)``. Standard library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` and returns its ``name``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)
    return __getattr__
