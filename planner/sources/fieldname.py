"""Which record field a plan's dataset is read with: the one the plan recorded, or an override.

``dcp-plan --field NAME`` reads lengths (and so the runtime's tokens) from field ``NAME`` of
every JSONL record, or column ``NAME`` of a Parquet/Arrow file; the plan records it as
``dataset.field`` (docs/PLAN_FORMAT.md). Everything that reads the dataset for a plan
(``dcp-plan validate PLAN DATASET``, ``runtime.data.plan_source.open_plan_source`` and so every
engine of ``dcp-train``) reads that field, so replaying a plan needs no repeated flag.

An override (``--field`` of ``dcp-train`` or ``dcp-plan validate``) is for a dataset whose field
was renamed since planning. It wins, with a one-line notice when it differs from the recorded
field, rather than a refusal: the plan's fingerprints (lengths always, tokens with
``--fingerprint content``) still check what is read, so a wrong override is refused by them, not
trained on, while a rename needs no re-planning.

Example: a plan made with ``--field ids`` reads ``ids``; ``--field input_ids`` reads
``input_ids`` and says so; a plan with no ``dataset.field`` reads the default fields
(``input_ids``, then ``tokens``; lengths also from ``length`` / ``num_tokens``).
"""

from __future__ import annotations

from planner.sources.formats import DEFAULT_FIELDS

__all__ = ["field_hint", "override_notice", "replay_field"]


def replay_field(recorded: str, given: str | None) -> str | None:
    """The field to read: ``given`` when not None, else the plan's ``recorded`` one (None: the
    default fields)."""
    if given is not None:
        return given
    return recorded or None


def override_notice(recorded: str, given: str | None, plan: str, *, flag: str = "--field") -> str:
    """One line for a user whose ``flag`` overrides the field ``plan`` was made with; empty
    when there is no override or it names the recorded field."""
    if given is None or given == recorded:
        return ""
    made = f"field {recorded!r}" if recorded else "the default fields (no --field)"
    return (f"notice: reading field {given!r} ({flag}), not {made} that {plan} was made with; "
            "the plan's fingerprints still check what is read")


def field_hint(message: str, recorded: str, given: str | None, plan: str) -> str:
    """``message`` (an error reading the dataset) with where the field came from, when the
    error is about that field and the user did not name it."""
    if given is not None:
        return message
    if recorded and repr(recorded) in message:
        if "no token list under" in message or "not a list-of-integers column" in message:
            # The field holds lengths, not tokens.
            return (f"{message}; {plan} was made with --field {recorded!r}, which holds "
                    "lengths: such a plan trains on the tokenized dataset with the same samples "
                    "(--dataset TOKENIZED --field ITS_TOKEN_FIELD)")
        return (f"{message}; {plan} was made with --field {recorded!r} (its header's "
                "dataset.field): if the dataset's tokens now sit under another field, give "
                "--field NAME")
    if not recorded and any(repr(f) in message for f in DEFAULT_FIELDS):
        return (f"{message}; {plan} records no --field (planned on the default fields, or by a "
                "dcp-plan that did not record it): if it was planned with --field NAME, give "
                "the same --field NAME")
    return message
