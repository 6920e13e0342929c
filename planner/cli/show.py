"""`dcp-plan show PLAN [--steps A:B | --step I | --gain] [--json]`: a plan's per-step table, one
step, or its predicted gain broken down.

``--steps`` is a Python slice of the steps (``-3:`` is the last three); ``--gain`` splits the gain
over each baseline into its parts (planfile/gain.py: ring traffic, load balance, microbatches,
padding). Every view ends with the cost model's provenance (planner/provenance.py). The plan is
validated (checksums and every invariant) before any number is printed.
"""

from __future__ import annotations

import json
from typing import Any

from planner.cli.args import (
    ArgumentParser,
    HelpFormatter,
    add_version,
    glue_negative_values,
    resolve_steps,
    step_bounds,
    step_range,
)

PROG = "dcp-plan"


def cmd_show(argv: list[str]) -> int:
    p = ArgumentParser(prog=f"{PROG} show", formatter_class=HelpFormatter,
                                description="Per-step table of a plan (or one step's rows).")
    add_version(p)
    p.add_argument("plan", help="plan file (.arrow)")
    p.add_argument("--steps", type=step_range, default=None, metavar="A:B",
                   help="steps A..B-1, a Python slice: '-3:' is the last three, '5:' from step "
                   "5, ':3' the first three, '7:8' step 7 alone (a bare number is refused: "
                   "'-3' could be either) (default: the first 50)")
    p.add_argument("--step", type=int, metavar="I",
                   help="print every row of this one step (-1: the last)")
    p.add_argument("--gain", action="store_true",
                   help="the predicted gain over each baseline split into its parts: ring "
                   "traffic avoided, load balance across ranks, fewer microbatches, less "
                   "padding (they add up to the whole)")
    p.add_argument("--json", action="store_true", help="one JSON object per step (JSON lines); "
                   "with --gain, the breakdown as one JSON object")
    args = p.parse_args(glue_negative_values(argv, ("--steps", "--step")))
    if args.gain and (args.step is not None or args.steps is not None):
        p.error("--gain shows the whole plan: give it without --step / --steps")
    from planner.notebook.view import read_plan, step_summary_row
    from planner.planfile.validate import validate

    view = read_plan(args.plan)
    h = view.header
    n = view.num_steps
    # Never show numbers from a damaged or invalid plan: checksums and every invariant first.
    validate(h, view._file, source=args.plan)
    if args.gain:
        return _show_gain(h, n, as_json=args.json)
    if args.step is not None:
        if not -n <= args.step < n:
            raise ValueError(f"--step {args.step} is out of range; the plan has {n} steps "
                             f"({step_bounds(n)})")
        t = view.step(args.step % n)
        if args.json:
            for row in t.to_pylist():
                print(json.dumps(row, sort_keys=True))
        else:
            print(t.to_pandas().to_string(index=False) if _has_pandas() else t)
        return 0
    if args.steps is None:
        steps = range(n if args.json else min(n, 50))
    else:
        steps = resolve_steps("--steps", args.steps, n)
    cost = view.cost_model
    cols = ["step", "microbatches", "groups", "samples", "real_tokens", "slot_fill",
            "simulated_s", "lower_bound_s", "vs_static_cp", "vs_megatron"] + [
                f"groups_cp{k}" for k in h.cp_sizes]
    if args.json:
        for i in steps:
            print(json.dumps(step_summary_row(h, cost, i, view.step_columns(i)), sort_keys=True))
        return 0
    print("  ".join(f"{c:>12}" for c in cols))
    for i in steps:
        r = step_summary_row(h, cost, i, view.step_columns(i))
        print("  ".join(f"{r[c]:>12.4f}" if isinstance(r[c], float) else
                        f"{'-' if r[c] is None else r[c]:>12}" for c in cols))
    if steps.stop < n:
        print(f"... {n - steps.stop} more steps (use --steps)")
    from planner.planfile.gain import gain_text

    # The whole plan's predicted gain below the table (the columns: each step's ratio, '-'
    # where the plan has none; these lines say why).
    for line in gain_text(h.stats, h.parallel.cp):
        print(f"gain: {line}")
    _print_cost(h)
    return 0


def _print_cost(header: Any) -> None:
    """The cost model's mark, and the warning when a deciding term is assumed; a text
    corpus's tokenizer and policies (``dataset.tokenizer``) first."""
    from planner.provenance import of_header

    if header.dataset.tokenizer:
        from planner.sources.textenc import TokenizerSpec

        spec = TokenizerSpec.from_dict(header.dataset.tokenizer)
        print(f"tokenizer: {spec.policy_text()}; field {header.dataset.field or 'text'!r}")
    mark, warning = of_header(header)
    print(f"cost: {mark}")
    if warning:
        print(f"warning: {warning}")


def _show_gain(header: Any, num_steps: int, *, as_json: bool) -> int:
    from planner.planfile.gain import breakdown, breakdown_text
    from planner.provenance import of_header

    if as_json:
        mark, warning = of_header(header)
        print(json.dumps({"gain": breakdown(header.stats, header.parallel.cp),
                          "cost_model": mark, "warning": warning}, sort_keys=True))
        return 0
    for line in breakdown_text(header.stats, header.parallel.cp, num_steps):
        print(line)
    print("(per part: the baseline's extra seconds and their share of the plan's time, which "
          "add up to the ratio less 1; load balance is the rest: the ranks' idle time)")
    _print_cost(header)
    return 0


def _has_pandas() -> bool:
    try:
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True
