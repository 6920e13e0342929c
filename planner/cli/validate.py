"""`dcp-plan validate PLAN [DATASET...]`: check a plan file.

Every invariant of the plan format, and the header against the steps where the steps determine
it (``validate(..., thorough=True)``); with the plan's dataset, also coverage to the last token
and the fingerprints (every token, for a plan made with ``--fingerprint content``). The dataset
is read as the plan was made: its recorded field and skip policy, unless ``--field`` or
``--skip-bad-records`` overrides them.
"""

from __future__ import annotations

import sys

from planner.cli.args import ArgumentParser, HelpFormatter, add_version, emit_summary
from planner.cli.guard import add_dataset_arguments, dataset_items, print_notice

PROG = "dcp-plan"


def cmd_validate(argv: list[str]) -> int:
    p = ArgumentParser(prog=f"{PROG} validate", formatter_class=HelpFormatter,
                                description="Check every invariant of a plan file; with its "
                                "dataset, also coverage to the last token and the fingerprints.")
    add_version(p)
    p.add_argument("plan", help="plan file (.arrow)")
    add_dataset_arguments(p, required=False)
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="a text plan's tokenizer.json (or its folder) where it has moved "
                   "(default: the path its header records; its sha256 must match)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_intermixed_args(argv)
    items, _ = dataset_items(p, args, required=False)
    from planner.planfile.io import PlanFile
    from planner.planfile.validate import validate

    with PlanFile(args.plan) as f:
        lengths = None
        recorded = f.header.dataset.field
        if items:
            from planner.sources.fieldname import field_hint, override_notice, replay_field
            from planner.sources.lengths import read_lengths

            # The field the plan was made with (dataset.field), unless --field overrides it.
            field = replay_field(recorded, args.field)
            notice = override_notice(recorded, args.field, args.plan)
            if notice:
                print(f"{PROG} validate: {notice}", file=sys.stderr)
            # The skip policy the plan was made with (its header's skipped_bad_records), as
            # the field: the flag is needed only for a plan that recorded none.
            skip = args.skip_bad_records or f.header.skips_bad_records
            encoder = None
            if args.tokenizer is not None and not f.header.dataset.tokenizer:
                raise ValueError(f"--tokenizer {args.tokenizer}: {args.plan} is a plan of token "
                                 "ids (its header records no tokenizer); give it without")
            if f.header.dataset.tokenizer:  # a text plan: count with its tokenizer
                from planner.sources.textenc import plan_encoder

                encoder = plan_encoder(f.header.dataset.tokenizer, args.tokenizer,
                                       source=args.plan)
            try:
                # The Megatron unit the plan was made with (none recorded: sequences).
                table = read_lengths(items, skip_bad_records=skip, field=field,
                                     notice=print_notice, encoder=encoder,
                                     megatron_unit=f.header.dataset.replay_megatron_unit)
            except ValueError as e:
                raise ValueError(field_hint(str(e), recorded, args.field, args.plan)) from None
            lengths = table.lengths
        # Thorough: the header's description of the steps (seed, global batch, stats) too.
        validate(f.header, f, lengths, source=args.plan, thorough=True)
        content = False
        if lengths is not None:  # the lengths match: with content fingerprints, every token
            from planner.sources.content import check_content

            content = check_content(f.header.dataset.files, table, field, source=args.plan)
        result = {"plan": args.plan, "valid": True, "kind": f.header.kind,
                  "num_steps": f.num_steps,
                  "format_version": f.header.format_version,
                  "coverage_checked": lengths is not None, "content_checked": content}
    what = ("and dataset coverage " if lengths is not None else "") + (
        "and token content " if content else "")
    emit_summary(result, f"{args.plan}: valid {result['kind']} plan ({result['num_steps']} "
                 f"steps, format "
                 f"{result['format_version']}; invariants {what}checked)",
                 as_json=args.json, json_path="")
    return 0
