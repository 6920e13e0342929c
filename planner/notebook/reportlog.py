"""The report's predicted-vs-measured panel (``dcp-plan report PLAN --log train.jsonl``).

Each step line of a ``dcp-train --log-jsonl`` file is matched to the plan's step of the same
index; the plan's simulated seconds of that step (``view.summary()``'s ``simulated_s``) are the
prediction. A log written against another plan is refused: a step beyond the plan, or a line's
own ``predicted_s`` (what the run's plan predicted) that differs from this plan's. The panel:
the agreement figures (``planner.prediction.agreement``: warm-up named, measured/predicted,
rank correlation), a figure of measured against predicted per step (log-log, warm-up steps
marked) and the ratio per step.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.prediction import WARMUP_STEPS, agreement, agreement_text

if TYPE_CHECKING:
    from planner.notebook.view import PlanView

TITLE = "Predicted against measured"
CAPTION = ("Left: each step's measured seconds (the log) against the plan's simulated seconds "
           "(log-log; hollow: warm-up steps, left out of the figures). Right: measured over "
           "predicted per step; a flat line is a cost model right up to one scale factor.")


def log_pairs(view: PlanView, rows: list[dict[str, Any]], source: str
              ) -> tuple[list[int], list[float], list[float]]:
    """(steps, measured seconds, predicted seconds) of the log's step lines; ValueError naming
    the step when the log cannot be this plan's."""
    simulated = view.summary().column("simulated_s").to_numpy()
    steps, measured, predicted = [], [], []
    for d in rows:
        step = d["step"]
        if type(step) is not int or not 0 <= step < len(simulated):
            raise ValueError(f"{source}: step {step!r} is not a step of {view.path} "
                             f"({len(simulated)} steps): a log of another plan?")
        want = float(simulated[step])
        got = d.get("predicted_s")
        if isinstance(got, (int, float)) and abs(got - want) > 1e-6 * max(want, 1e-12):
            raise ValueError(f"{source}: step {step} was run with a prediction of {got:.6g} s, "
                             f"this plan predicts {want:.6g} s: a log of another plan (or of "
                             f"this plan under another cost model)")
        steps.append(step)
        measured.append(float(d["seconds"]))
        predicted.append(want)
    return steps, measured, predicted


def panel(view: PlanView, rows: list[dict[str, Any]], source: str,
          svg_of: Callable[[Any], str]) -> str:
    """The panel's HTML: a heading, the figures' line and table, and the figure (as inline
    SVG by the report's ``svg_of``)."""
    steps, measured, predicted = log_pairs(view, rows, source)
    a = agreement(steps, measured, predicted, WARMUP_STEPS)
    e = html.escape

    def fmt(v: Any) -> str:
        return "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    table = "".join(f"<tr><th>{e(k)}</th><td>{e(fmt(v))}</td></tr>" for k, v in (
        ("log", source), ("steps in the log", len(steps)),
        ("warm-up steps (left out)", ", ".join(map(str, a["warmup_steps"])) or "none"),
        ("steps compared", a["steps_compared"]),
        ("measured / predicted (totals)", a["measured_over_predicted"]),
        ("per step, min", a["ratio_min"]), ("per step, max", a["ratio_max"]),
        ("rank correlation (Spearman)", a["spearman"])))
    svg = svg_of(_figure(steps, measured, predicted, len(a["warmup_steps"])))
    return (f"<h2 id='measured'>{e(TITLE)}</h2><p id='measured-line'>{e(agreement_text(a))}</p>"
            f"<table id='measured-table'>{table}</table><figure>{svg}"
            f"<figcaption>{e(CAPTION)}</figcaption></figure>")


def _figure(steps: list[int], measured: list[float], predicted: list[float], warm: int) -> Any:
    from planner.notebook.plot import _plt

    fig, (left, right) = _plt().subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    m, p = np.asarray(measured), np.asarray(predicted)
    left.scatter(p[warm:], m[warm:], s=14, color="C0", label="step")
    if warm:
        left.scatter(p[:warm], m[:warm], s=14, facecolors="none", edgecolors="C0",
                     label="warm-up")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("predicted seconds (plan)")
    left.set_ylabel("measured seconds (log)")
    left.legend(fontsize=8, frameon=False)
    ratio = m / np.maximum(p, 1e-300)
    right.plot(steps, ratio, marker=".", color="C1")
    if warm:
        right.axvspan(steps[0] - 0.5, steps[warm - 1] + 0.5, color="0.9", label="warm-up")
        right.legend(fontsize=8, frameon=False)
    right.set_xlabel("step")
    right.set_ylabel("measured / predicted")
    fig.suptitle(TITLE)
    return fig
