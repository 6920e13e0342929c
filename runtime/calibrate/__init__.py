"""``dcp-calibrate``: measure the planner's cost model on a GPU for one model shape (``run``),
with its timing grids (``timing``), the fit (``fit``) and the command line (``cli``)."""

from __future__ import annotations

from runtime.calibrate.cli import main
from runtime.calibrate.run import CalibrateConfig, Calibration, calibrate

__all__ = ["CalibrateConfig", "Calibration", "calibrate", "main"]
