"""`dcp-plan report PLAN [-o FILE] [--log train.jsonl]`: the plan as one self-contained HTML
page (planner/notebook/report.py: the predicted gain, the summary and the per-step figures;
with ``--log``, the run's measured step times against the plan's: notebook/reportlog.py).

The plan is validated first (checksums and every invariant), as ``show`` does, so the page
never shows numbers of a damaged plan. The output goes through ``planner.fileguard``: checked
before any work (never the plan, a special file or an existing file other than a report),
written to a temporary beside it and renamed.
"""

from __future__ import annotations

from pathlib import Path

from planner.cli.args import (
    ArgumentParser,
    HelpFormatter,
    add_json_arguments,
    add_version,
    emit_summary,
)

PROG = "dcp-plan report"


def cmd_report(argv: list[str]) -> int:
    p = ArgumentParser(prog=PROG, formatter_class=HelpFormatter,
                                description="Write a plan's report: one self-contained HTML "
                                "file (no network) with the predicted gain, the summary and "
                                "the per-step figures.")
    add_version(p)
    p.add_argument("plan", help="plan file (.arrow)")
    p.add_argument("-o", "--output", default="",
                   help="HTML file to write (default: the plan's path with .html); replaces "
                   "only a report, never the plan or another kind of file")
    p.add_argument("--log", default="",
                   help="a run's dcp-train --log-jsonl file: adds a predicted-vs-measured panel "
                   "(each step's simulated seconds against its measured seconds)")
    add_json_arguments(p)
    args = p.parse_intermixed_args(argv)
    from planner.fileguard import check_input, check_output, write_atomic
    from planner.notebook.view import read_plan
    from planner.planfile.validate import validate

    out = Path(args.output) if args.output else Path(args.plan).with_suffix(".html")
    check_input(args.plan, "the plan")
    if args.log:
        check_input(args.log, "the log")
    # Before any work: never the plan, the summary's path, a special file or another kind.
    inputs = [args.plan, *([args.log] if args.log else [])]
    check_output(out, kind="report", inputs=inputs, flag="-o/--output",
                 others={"--summary-json": args.summary_json})
    if args.summary_json:
        check_output(args.summary_json, kind="summary", inputs=inputs,
                     flag="--summary-json", others={"-o/--output": out})
    log = None
    if args.log:
        from planner.prediction import read_step_log

        try:
            log = read_step_log(args.log)
        except OSError as e:
            raise ValueError(f"{args.log}: cannot read the log: {e}") from None
    view = read_plan(args.plan)
    try:
        validate(view.header, view._file, source=args.plan)
        import matplotlib

        matplotlib.use("Agg")  # files only: no display is needed or opened
        from planner.notebook.report import render_report

        page = render_report(view, log, args.log)
    finally:
        view.close()
    write_atomic(out, page, kind="report", inputs=[args.plan])
    result = {"report": str(out), "plan": args.plan, "bytes": len(page.encode()),
              **({"log": args.log} if args.log else {})}
    emit_summary(result, f"{out}: report of {args.plan} ({len(page) / 1024:,.0f} KiB)",
                 as_json=args.json, json_path=args.summary_json)
    return 0
