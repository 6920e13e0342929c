"""The predicted gain a plan records: its simulated time against static CP and Megatron's greedy.

Per step the solver scores both baselines on the step's own segments, under the plan's cost
model (solver/candidates.py); ``GainAccumulator`` sums those times step by step, as the other
header stats are summed, and ``result`` gives the header's keys (docs/PLAN_FORMAT.md, "Stats"):

- ``vs_static_cp``, ``vs_megatron``: a baseline's total simulated seconds over the plan's
  (1.31: the baseline would take 31% longer), or null when it is not scored (the options
  exclude it, ``baselines.<name>.not_scored`` says why) or cannot run some step
  (``infeasible_steps``);
- ``baselines.<name>``: ``seconds`` (its total), ``quantiles`` of the per-step ratio (min, p05,
  p25, p50, p75, p95, max) and ``per_step``, every step's ratio rounded to 4 decimals (null on
  a step it cannot run): what the notebook's per-step columns and the plots read.

``describe`` reads those keys from any header (older plans have none: "not recorded") into
one shape that every reader (summary, show, notebook, report) renders.
"""

from __future__ import annotations

from typing import Any

import numpy as np

STATIC = "static-cp"
MEGATRON = "megatron-greedy"
KEYS = {STATIC: "vs_static_cp", MEGATRON: "vs_megatron"}
"""Baseline name -> the stats key of its total ratio."""
QUANTILES = (("min", 0), ("p05", 5), ("p25", 25), ("p50", 50), ("p75", 75), ("p95", 95),
             ("max", 100))
DIGITS = 4
"""Per-step ratios and quantiles are rounded to this many decimals (the header stays small:
about 7 bytes a step and baseline)."""
NOT_RECORDED = "not recorded: the plan was made before dcp-plan recorded the predicted gain"


class GainAccumulator:
    """Per-baseline sums and per-step ratios, one step at a time (``add``), then ``result``."""

    def __init__(self, not_scored: dict[str, str], static_cp: int) -> None:
        self.not_scored = dict(not_scored)
        self.static_cp = static_cp
        self.plan = 0.0
        self.total = {name: 0.0 for name in KEYS}
        self.ratios: dict[str, list[float | None]] = {name: [] for name in KEYS}

    def add(self, seconds: float, static_seconds: float, megatron_seconds: float) -> None:
        """One step: the plan's simulated seconds and each baseline's (nan: not scored, inf:
        the baseline cannot run the step)."""
        self.plan += seconds
        for name, t in ((STATIC, static_seconds), (MEGATRON, megatron_seconds)):
            if name in self.not_scored or np.isnan(t):
                continue
            if np.isinf(t):
                self.ratios[name].append(None)
                continue
            self.total[name] += t
            ratio = t / seconds if seconds > 0 else 1.0
            self.ratios[name].append(round(ratio, DIGITS))

    def result(self) -> dict[str, Any]:
        """The stats keys (module docstring)."""
        out: dict[str, Any] = {}
        baselines: dict[str, Any] = {}
        for name, key in KEYS.items():
            info: dict[str, Any] = {"cp": self.static_cp} if name == STATIC else {}
            per_step = self.ratios[name]
            if name in self.not_scored or not per_step:
                info["not_scored"] = self.not_scored.get(name, "not scored")
                out[key] = None
                baselines[name] = info
                continue
            feasible = np.array([r for r in per_step if r is not None], dtype=np.float64)
            infeasible = len(per_step) - len(feasible)
            out[key] = (self.total[name] / self.plan if self.plan > 0 else 1.0) \
                if not infeasible else None
            info.update({
                "seconds": self.total[name] if not infeasible else None,
                "infeasible_steps": infeasible,
                "quantiles": {q: round(float(np.percentile(feasible, p)), DIGITS)
                              for q, p in QUANTILES} if len(feasible) else None,
                "per_step": per_step,
            })
            baselines[name] = info
        out["baselines"] = baselines
        return out


def label(name: str, stats: dict[str, Any], cp: int) -> str:
    """``static CP 4`` or ``Megatron's greedy``: how texts name a baseline."""
    if name == STATIC:
        return f"static CP {stats.get('baselines', {}).get(STATIC, {}).get('cp', cp)}"
    return "Megatron's greedy"


def describe(stats: dict[str, Any], cp: int) -> dict[str, dict[str, Any]]:
    """Per baseline: ``label``, ``ratio`` (float or None), ``note`` (why there is no ratio, or
    None), ``quantiles`` and ``per_step`` (None when absent), from any plan's stats."""
    out = {}
    recorded = stats.get("baselines")
    for name, key in KEYS.items():
        info = recorded.get(name, {}) if isinstance(recorded, dict) else {}
        ratio = stats.get(key) if recorded is not None else None
        note = None
        if recorded is None:
            note = NOT_RECORDED
        elif "not_scored" in info:
            note = str(info["not_scored"])
        elif ratio is None:
            n = len(info.get("per_step", ()))
            note = (f"cannot run {info.get('infeasible_steps', 0)} of {n} steps ("
                    + ("a sequence longer than cp x its capacity per rank)" if name == STATIC
                       else "2N padding past the pool, or a size the plan may not use)"))
        out[name] = {"label": label(name, stats, cp), "ratio": ratio, "note": note,
                     "quantiles": info.get("quantiles"), "per_step": info.get("per_step")}
    return out


def gain_text(stats: dict[str, Any], cp: int) -> list[str]:
    """One line per baseline: ``1.312x over static CP 4 (per step: min 1.05x, median 1.30x,
    max 1.60x)`` (its time over the plan's), or why there is no number."""
    if stats.get("baselines") is None:
        return [NOT_RECORDED]
    lines = []
    for d in describe(stats, cp).values():
        q = d["quantiles"] or {}
        if d["ratio"] is None:
            lines.append(f"{d['label']}: {d['note']}" + (
                f"; on the steps it can run, median {q['p50']:.2f}x" if q else ""))
            continue
        spread = (f" (per step: min {q['min']:.2f}x, median {q['p50']:.2f}x, max "
                  f"{q['max']:.2f}x)" if q else "")
        lines.append(f"{d['ratio']:.3f}x over {d['label']}{spread}")
    return lines


def gain_errors(stats: dict[str, Any], num_steps: int) -> list[str]:
    """What is wrong with the gain keys' shape (``validate``; the values themselves depend on
    the drawn order, which the rows do not keep). Absent keys (older plans) are fine."""
    recorded = stats.get("baselines")
    if recorded is None:
        return []
    if not isinstance(recorded, dict):
        return ["header: stats baselines is not an object"]
    out = []
    for name, key in KEYS.items():
        info = recorded.get(name)
        total = stats.get(key)
        if not isinstance(info, dict):
            out.append(f"header: stats baselines has no {name!r} entry")
        elif "not_scored" in info:
            if total is not None:
                out.append(f"header: stats {key} is {total!r} for a baseline not scored")
        elif not isinstance(per := info.get("per_step"), list) or len(per) != num_steps:
            n = len(per) if isinstance(per, list) else "no"
            out.append(f"header: stats baselines.{name}.per_step holds {n} steps, the plan "
                       f"has {num_steps}")
        elif any(r is not None and not (isinstance(r, (int, float)) and r >= 1.0) for r in per):
            out.append(f"header: stats baselines.{name}.per_step holds a ratio below 1 (a step "
                       "slower than the baseline it was chosen over) or not a number")
        elif (total is None) != (None in per) or (
                total is not None and not (isinstance(total, (int, float)) and total >= 1.0)):
            out.append(f"header: stats {key} {total!r} does not match its per-step ratios")
    return out
