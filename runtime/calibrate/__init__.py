"""``dcp-calibrate``: measure the planner's cost model on a GPU for one model shape (``run``),
with its timing grids (``timing``), the fit (``fit``) and the command line (``cli``).

The names load lazily (PEP 562) and ``main`` answers ``--version`` before importing torch
(issue 29)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.lazy import lazy_exports

_EXPORTS = {
    "CalibrateConfig": "runtime.calibrate.run",
    "Calibration": "runtime.calibrate.run",
    "calibrate": "runtime.calibrate.run",
}

__all__ = ["CalibrateConfig", "Calibration", "calibrate", "main"]
assert sorted(__all__) == sorted([*_EXPORTS, "main"])

if TYPE_CHECKING:
    from runtime.calibrate.run import CalibrateConfig, Calibration, calibrate


def main(argv: Sequence[str] | None = None) -> int:
    """``dcp-calibrate`` (``runtime.calibrate.cli.main``); returns the process exit status."""
    from planner.cli.args import exit_on_version

    exit_on_version("dcp-calibrate", None if argv is None else list(argv))
    from planner.cli.oom import reporting

    def run() -> int:
        from runtime.calibrate.cli import main as cli_main

        return cli_main(argv)

    return reporting("dcp-calibrate", run)


__getattr__ = lazy_exports(__name__, _EXPORTS)
