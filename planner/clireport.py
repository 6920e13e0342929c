"""`dcp-plan report PLAN [-o FILE]`: the plan as one self-contained HTML page
(planner/notebook/report.py: the predicted gain, the summary and the per-step figures).

The plan is validated first (checksums and every invariant), as ``show`` does, so the page
never shows numbers of a damaged plan. The output is refused when it is the plan, another plan
or (without ``--overwrite``) any existing file, and written to a temporary beside it, then
renamed (cliguard.write_output).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.cliargs import HelpFormatter, add_json_arguments, add_version, emit_summary

PROG = "dcp-plan report"


def cmd_report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=PROG, formatter_class=HelpFormatter,
                                description="Write a plan's report: one self-contained HTML "
                                "file (no network) with the predicted gain, the summary and "
                                "the per-step figures.")
    add_version(p)
    p.add_argument("plan", help="plan file (.arrow)")
    p.add_argument("-o", "--output", default="",
                   help="HTML file to write (default: the plan's path with .html)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output file (never the plan or another plan)")
    add_json_arguments(p)
    args = p.parse_intermixed_args(argv)
    from planner.cliguard import write_output
    from planner.notebook.view import read_plan
    from planner.planfile.io import check_output_path
    from planner.planfile.validate import validate

    out = Path(args.output) if args.output else Path(args.plan).with_suffix(".html")
    check_output_path(out, inputs=[args.plan], overwrite=args.overwrite)  # before any work
    view = read_plan(args.plan)
    try:
        validate(view.header, view._file, source=args.plan)
        import matplotlib

        matplotlib.use("Agg")  # files only: no display is needed or opened
        from planner.notebook.report import render_report

        page = render_report(view)
    finally:
        view.close()
    write_output(out, page.encode(), inputs=[args.plan], overwrite=args.overwrite)
    result = {"report": str(out), "plan": args.plan, "bytes": len(page.encode())}
    emit_summary(result, f"{out}: report of {args.plan} ({len(page) / 1024:,.0f} KiB)",
                 as_json=args.json, json_path=args.summary_json)
    return 0
