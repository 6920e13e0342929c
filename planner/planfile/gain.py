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
  a step it cannot run): what the notebook's per-step columns and the plots read;
- ``baselines.<name>.parts``: the seconds the baseline spends beyond the plan, split by what
  they are (``PARTS``), over the steps it can run (``parts_of``: their count, the plan's and
  the baseline's seconds on them). Per step, from ``cost.step_terms`` of both layouts:
  ``ring`` = ring rank-seconds / N avoided, ``microbatches`` = microbatch rank-seconds / N
  (fewer microbatches), ``padding`` = padded-token compute / N, and ``balance`` = the rest of
  the step-time difference: the critical path's excess over the mean rank's work (idle ranks),
  since real compute is the same for both. So the four sum to baseline - plan seconds exactly
  (to float rounding); a part may be negative where the plan spends there to save more
  elsewhere.

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
PARTS = {"ring": "ring traffic avoided", "balance": "load balance across ranks",
         "microbatches": "fewer microbatches", "padding": "less padding"}
"""The gain's parts (module docstring), in the order texts list them."""
PARTS_NOT_RECORDED = ("parts not recorded: the plan was made before dcp-plan split the gain "
                      "into its parts")


class GainAccumulator:
    """Per-baseline sums and per-step ratios, one step at a time (``add``), then ``result``."""

    def __init__(self, not_scored: dict[str, str], static_cp: int) -> None:
        self.not_scored = dict(not_scored)
        self.static_cp = static_cp
        self.plan = 0.0
        self.total = {name: 0.0 for name in KEYS}
        self.ratios: dict[str, list[float | None]] = {name: [] for name in KEYS}
        self.parts = {name: dict.fromkeys(PARTS, 0.0) for name in KEYS}
        self.parts_plan = dict.fromkeys(KEYS, 0.0)
        self.with_parts = True

    def add(self, seconds: float, static_seconds: float, megatron_seconds: float, *,
            terms: np.ndarray | None = None) -> None:
        """One step: the plan's simulated seconds and each baseline's (nan: not scored, inf:
        the baseline cannot run the step); ``terms``: the step's (3, 3) ``cost.step_terms`` of
        the plan's rows and each baseline's (``StepAssignment.terms``), for the parts."""
        self.plan += seconds
        if terms is None:
            self.with_parts = False
        for row, (name, t) in enumerate(((STATIC, static_seconds),
                                         (MEGATRON, megatron_seconds)), start=1):
            if name in self.not_scored or np.isnan(t):
                continue
            if np.isinf(t):
                self.ratios[name].append(None)
                continue
            self.total[name] += t
            if terms is not None:
                parts = self.parts[name]
                pad, ring, micro = (float(x) for x in terms[row] - terms[0])
                parts["ring"] += ring
                parts["microbatches"] += micro
                parts["padding"] += pad
                # The rest is imbalance: real compute is the same for both (cost.step_terms).
                parts["balance"] += (t - seconds) - (pad + ring + micro)
                self.parts_plan[name] += seconds
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
            if self.with_parts and len(feasible):
                info["parts"] = dict(self.parts[name])
                info["parts_of"] = {"steps": int(len(feasible)),
                                    "plan_seconds": self.parts_plan[name],
                                    "baseline_seconds": self.total[name]}
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


def breakdown(stats: dict[str, Any], cp: int) -> dict[str, dict[str, Any]]:
    """Per baseline: ``label``, ``note`` (why there are no parts, or None) and, with parts,
    ``steps``, ``plan_seconds``, ``baseline_seconds``, ``ratio`` (over those steps) and
    ``parts``: per ``PARTS`` key its ``label``, ``seconds`` and ``share`` (seconds over the
    plan's: the shares sum to ratio - 1)."""
    out = {}
    for name, d in describe(stats, cp).items():
        info = (stats.get("baselines") or {}).get(name, {})
        parts, basis = info.get("parts"), info.get("parts_of")
        # No parts: why there is no gain at all, or (a gain without them) an older plan.
        unscored = stats.get("baselines") is None or "not_scored" in info
        entry: dict[str, Any] = {"label": d["label"],
                                 "note": d["note"] if unscored else PARTS_NOT_RECORDED}
        if parts and basis:  # also when it cannot run some steps: the parts are of the others
            plan = float(basis["plan_seconds"])
            entry.update({
                "note": None,
                "steps": int(basis["steps"]), "plan_seconds": plan,
                "baseline_seconds": float(basis["baseline_seconds"]),
                "ratio": float(basis["baseline_seconds"]) / plan if plan > 0 else 1.0,
                "parts": {k: {"label": label, "seconds": float(parts[k]),
                              "share": float(parts[k]) / plan if plan > 0 else 0.0}
                          for k, label in PARTS.items()}})
        out[name] = entry
    return out


def breakdown_text(stats: dict[str, Any], cp: int, num_steps: int) -> list[str]:
    """``dcp-plan show --gain``: per baseline a line with its ratio, then one per part (its
    seconds, and its share of the plan's time: the shares add up to the ratio less 1)."""
    lines = []
    for d in breakdown(stats, cp).values():
        if "parts" not in d:
            lines.append(f"{d['label']}: {d['note']}")
            continue
        over = (f"over all {num_steps} steps" if d["steps"] == num_steps else
                f"over the {d['steps']} of {num_steps} steps it can run")
        extra = d["baseline_seconds"] - d["plan_seconds"]
        lines.append(f"{d['label']}: {d['ratio']:.3f}x {over}: {d['baseline_seconds']:.3f} s "
                     f"against the plan's {d['plan_seconds']:.3f} s ({extra:+.3f} s)")
        for part in d["parts"].values():
            lines.append(f"  {part['label']:<27} {part['seconds']:+10.3f} s "
                         f"{part['share']:+8.3f}x")
        lines.append(f"  {'total':<27} {extra:+10.3f} s {d['ratio'] - 1:+8.3f}x "
                     f"(= {d['ratio']:.3f}x - 1)")
    return lines


def _parts_errors(name: str, info: dict[str, Any]) -> list[str]:
    """The parts' shape, and that they add up to the baseline's seconds less the plan's."""
    parts, basis = info["parts"], info.get("parts_of")
    if not (isinstance(parts, dict) and set(parts) == set(PARTS)
            and all(type(v) in (int, float) for v in parts.values())
            and isinstance(basis, dict)
            and all(type(basis.get(k)) in (int, float)
                    for k in ("steps", "plan_seconds", "baseline_seconds"))):
        return [f"header: stats baselines.{name}.parts must hold numbers {', '.join(PARTS)} "
                "and parts_of steps, plan_seconds and baseline_seconds"]
    whole = float(basis["baseline_seconds"]) - float(basis["plan_seconds"])
    total = float(sum(parts.values()))
    if abs(total - whole) > 1e-6 * max(abs(float(basis["baseline_seconds"])), 1e-9):
        return [f"header: stats baselines.{name}.parts sum to {total!r} s, not the baseline's "
                f"seconds less the plan's ({whole!r} s)"]
    return []


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
        elif "parts" in info:
            out += _parts_errors(name, info)
    return out
