"""``dcp-calibrate --from-log train.jsonl --plan PLAN -o cm.json``: the cost model fitted to a
training run's own step times (planner/fitlog.py), written as a cost-model JSON that plans like
any other (``dcp-plan --cost-model cm.json``) and says ``fitted from train.jsonl``
(planner/provenance.py: the ``fitted`` block's ``log``, ``date`` and ``terms``).

The file holds every term: the fitted ones, and the plan's own values for the terms the log
could not determine (marked assumed, each with its reason under ``fitted.refused``). The
printed table gives each term's value and standard error, or why it was refused.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

from planner.cli.args import ArgumentParser, HelpFormatter, add_json_arguments, emit_summary

PROG = "dcp-calibrate --from-log"


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, formatter_class=HelpFormatter,
                       description="Fit the plan's cost model to a dcp-train run's measured step "
                       "times (its --log-jsonl file).")
    p.add_argument("--from-log", required=True, metavar="LOG",
                   help="dcp-train --log-jsonl file of a run of --plan")
    p.add_argument("--plan", required=True, help="the plan the run trained")
    p.add_argument("--output", "-o", required=True, help="cost-model JSON file to write")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="leading steps left out (default: planner.prediction.WARMUP_STEPS)")
    add_json_arguments(p)
    return p


def document(fit: dict[str, Any], log: str, plan: str) -> dict[str, Any]:
    """The cost-model JSON of a fit (``planner.fitlog.fit_log``)."""
    model = fit["model"]
    terms = [t for t in model.parameters if t in fit["values"]]
    return {
        "name": f"fitted-{model.name}",
        "description": f"{model.name} fitted to the step times of {log} ({len(fit['steps'])} "
                       f"steps of {plan}); terms not determined keep the plan's values",
        "parameters": model.parameters,
        "forward_fraction": model.forward_fraction,
        "fitted": {"log": log, "plan": plan,
                   "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
                   "terms": terms,
                   "errors": {t: fit["errors"][t] for t in terms},
                   "refused": fit["refused"],
                   "step_s": fit["values"].get("step_s"),
                   "step_s_error": fit["errors"].get("step_s"),
                   "relative_rms": fit["relative_rms"], "steps": fit["steps"],
                   "warmup_steps": fit["warmup_steps"], "cp_sizes": fit["cp_sizes"],
                   "per_cp_size": fit["per_cp_size"]},
    }


def table(doc: dict[str, Any]) -> str:
    f = doc["fitted"]
    lines = [f"{'term':<24} {'value':>12} {'error':>10}"]
    for t, v in doc["parameters"].items():
        if t in f["terms"]:
            lines.append(f"{t:<24} {v:>12.4g} {f['errors'][t]:>10.2g}")
        else:
            lines.append(f"{t:<24} {v:>12.4g}   refused: {f['refused'].get(t, '')} (kept "
                         "the plan's value)")
    if f["step_s"] is not None:
        lines.append(f"{'step_s (not in model)':<24} {f['step_s']:>12.4g} "
                     f"{f['step_s_error']:>10.2g}")
    for k, d in f["per_cp_size"].items():
        parts = [f"{t} {x['value']:.3g} +- {x['error']:.2g}" if "value" in x else
                 f"{t} refused ({x['refused']})" for t, x in d.items()]
        lines.append(f"CP {k}: " + ", ".join(parts))
    lines.append(f"relative rms residual {f['relative_rms']:.3g} over {len(f['steps'])} steps "
                 f"(warm-up left out: {f['warmup_steps']})")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    a = _parser().parse_args(argv)
    from planner.fileguard import check_input, check_output, write_atomic
    from planner.fitlog import fit_log
    from planner.prediction import WARMUP_STEPS, read_step_log

    try:
        check_input(a.from_log, "the log")
        check_input(a.plan, "the plan")
        check_output(a.output, kind="cost-model", inputs=[a.from_log, a.plan],
                     flag="-o/--output")
        rows = read_step_log(a.from_log)
        fit = fit_log(a.plan, rows, warmup=WARMUP_STEPS if a.warmup is None else a.warmup)
        doc = document(fit, a.from_log, a.plan)
        write_atomic(a.output, json.dumps(doc, indent=2) + "\n", kind="cost-model",
                     inputs=[a.from_log, a.plan])
    except (ValueError, OSError) as e:
        print(f"dcp-calibrate: error: {e}", file=sys.stderr)
        return 2
    emit_summary(doc, f"{table(doc)}\nwrote {a.output}", as_json=a.json,
                 json_path=a.summary_json)
    return 0
