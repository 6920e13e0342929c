"""The ``dcp-plan`` command: one module per subcommand, and the command-line helpers they share.

``planner/`` outside this package is the library a notebook or a script imports; everything
that parses flags or prints for a terminal lives here. Subcommands: ``plan`` (the default),
``validate``, ``show``, ``compare``, ``report``; ``dispatch`` picks one from the command line
and turns user errors into a one-line message and exit status 2. Helpers: ``args`` (the
conventions every command shares, ``dcp-train`` and ``dcp-calibrate`` too), ``flags``,
``guard``, ``engine``, ``summary`` and ``progress`` (the only tqdm import).

``main`` and ``entry`` load lazily (PEP 562): the runtime imports ``planner.cli.args`` and
``planner.cli.progress`` on every rank, and importing this package must not pay for the planning
stack (numpy, numba, pyarrow, ortools); only calling ``dcp-plan`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.lazy import lazy_exports

_EXPORTS = {
    "main": "planner.cli.dispatch",
    "entry": "planner.cli.dispatch",
}

__all__ = ["entry", "main"]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from planner.cli.dispatch import entry, main


__getattr__ = lazy_exports(__name__, _EXPORTS)
