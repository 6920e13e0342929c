"""The plan's prediction held against a run's measurement: each step's simulated seconds
(``StepPrediction``, written as ``predicted_s`` beside ``seconds`` on every step line of
``dcp-train``), and how well they agree (``agreement``, in the run's summary and in
``dcp-plan report PLAN --log train.jsonl``).

The prediction of step i is ``planner.cost.simulate_step`` of its rows under the cost model
the header records: the same number as ``dcp-plan show``'s ``simulated_s`` column, to the bit.

Warm-up: the first ``WARMUP_STEPS`` steps a run logs (allocator growth, kernel selection,
first-touch of the dataset's pages; on CUDA, lazy initialisation) are left out of the figures,
counted and named as warm-up. Over the rest:

- ``measured_over_predicted``: total measured seconds over total predicted seconds. It is the
  cost model's scale error on this machine (a preset for an H200 run on a CPU gives thousands);
  a ratio far from 1 says the absolute times are wrong, not that the plan is.
- ``ratio_min`` / ``ratio_max``: the same ratio per step, its range;
- ``spearman``: the rank correlation of predicted against measured step times, what decides
  whether the plan ranked its steps (and so its choices) right; None with fewer than 3 steps or
  when either side is constant (no ranking to compare).

Trade-off: the warm-up is a fixed count, not detected; a detector would drop a slow step that
the plan predicted slow. Two steps cover the CPU and GPU runs measured here.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from planner.planfile.io import PlanFile
from planner.planfile.schema import PlanHeader, column_numpy

if TYPE_CHECKING:
    from planner.cost import CostModel

WARMUP_STEPS = 2
"""Steps at the start of a run left out of the agreement figures (module docstring)."""


class StepPrediction:
    """Each step's simulated seconds under the plan's own cost model (opened once, O(1) a step).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from planner.cost import CostModel

        self._file = PlanFile(path)
        self.header: PlanHeader = self._file.header
        cm = self.header.cost_model
        self.cost: CostModel | None = None
        """None: the header holds no usable cost model (a hand-made plan): no prediction."""
        with contextlib.suppress(ValueError):
            self.cost = CostModel.from_dict({"name": cm.get("name", "plan"),
                                             "parameters": cm.get("parameters", {})})

    def __call__(self, step: int) -> float | None:
        """Step ``step``'s simulated seconds (``dcp-plan show``'s ``simulated_s``); None
        without a cost model."""
        from planner.cost import simulate_step

        if self.cost is None:
            return None
        batch = self._file.step(step)
        return simulate_step(self.cost, self.header.parallel.pool_size,
                             column_numpy(batch, "microbatch"), column_numpy(batch, "rank_start"),
                             column_numpy(batch, "cp_size"),
                             column_numpy(batch, "padded_tokens"))

    def close(self) -> None:
        self._file.close()


def spearman(x: NDArray[np.float64], y: NDArray[np.float64]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None below 3 points or when
    either side is constant."""
    if len(x) < 3 or len(x) != len(y):
        return None
    rx, ry = _ranks(np.asarray(x, np.float64)), _ranks(np.asarray(y, np.float64))
    dx, dy = rx - rx.mean(), ry - ry.mean()
    den = float(np.sqrt((dx * dx).sum() * (dy * dy).sum()))
    return float((dx * dy).sum() / den) if den > 0 else None


def _ranks(v: NDArray[np.float64]) -> NDArray[np.float64]:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v), np.float64)
    ranks[order] = np.arange(len(v), dtype=np.float64)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return np.asarray(sums[inverse] / counts[inverse], np.float64)


def agreement(steps: Sequence[int], measured: Sequence[float],
              predicted: Sequence[float | None],
              warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """Measured against predicted over the logged steps after the first ``warmup``; steps
    without a prediction are left out (module docstring for each figure)."""
    pairs = [(s, m, p) for s, m, p in zip(steps, measured, predicted, strict=True)
             if p is not None]
    skip = pairs[:warmup]
    kept = pairs[warmup:]
    out: dict[str, Any] = {"warmup_steps": [s for s, _, _ in skip], "steps_compared": len(kept),
                           "measured_over_predicted": None, "ratio_min": None,
                           "ratio_max": None, "spearman": None}
    if not kept:
        return out
    m = np.array([x for _, x, _ in kept], np.float64)
    p = np.array([x for _, _, x in kept], np.float64)
    total = float(p.sum())
    if total > 0:
        out["measured_over_predicted"] = float(m.sum()) / total
    if (p > 0).all():
        ratio = m / p
        out["ratio_min"], out["ratio_max"] = float(ratio.min()), float(ratio.max())
    out["spearman"] = spearman(p, m)
    return out


def agreement_text(a: dict[str, Any]) -> str:
    """One line of ``agreement``'s figures."""
    warm = a["warmup_steps"]
    first = (f"steps {warm[0]}-{warm[-1]}" if len(warm) > 1 else f"step {warm[0]}") if warm \
        else "none"
    if a["measured_over_predicted"] is None:
        return f"no step to compare after the warm-up ({first})"
    rho = a["spearman"]
    span = (f" (per step {a['ratio_min']:.3g}-{a['ratio_max']:.3g})"
            if a["ratio_min"] is not None else "")
    return (f"measured/predicted {a['measured_over_predicted']:.3g}{span}, rank correlation "
            + (f"{rho:+.3f}" if rho is not None else "n/a (under 3 steps or a constant side)")
            + f" over {a['steps_compared']} steps after warm-up ({first})")


def read_step_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The step lines of a ``dcp-train --log-jsonl`` file (evaluation lines are skipped);
    ValueError naming the line when one is not JSON or a step line lacks ``seconds``."""
    rows = []
    text = Path(path).read_text()
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not a JSON line ({e})") from None
        if not isinstance(d, dict) or "step" not in d:
            continue  # an evaluation line, or another record
        if not isinstance(d.get("seconds"), (int, float)):
            raise ValueError(f"{path}:{i}: a step line without 'seconds'")
        rows.append(d)
    if not rows:
        raise ValueError(f"{path}: no step lines (a dcp-train --log-jsonl file?)")
    return rows
