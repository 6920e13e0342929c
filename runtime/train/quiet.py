"""Known upstream warnings, off by default: ``dcp-train --verbose`` shows them.

A warning is *known* when we have read where it comes from and why it does not apply to a run of
a plan; each framework's room lists its own (``runtime.adapters.torchtitan.titan
.KNOWN_WARNINGS``), each entry with that reason, and its launch calls ``quiet`` unless
``--verbose``. Nothing else is silenced: an unknown warning still prints, as Python or the
framework prints it, so a new upstream release cannot hide a new problem.

Two channels: ``warnings.warn`` (one filter per entry: message, category and module, as
``warnings.filterwarnings`` matches them) and warnings that a framework *logs* (torchtitan logs
through the root logger): a filter on that logger drops records whose message matches.

Example: torchtitan logs "torch.distributed is already initialized. Skipping init_distributed"
once per rank, because ``dcp-train`` made the process group itself (with its timeout); the run
is right, the line is noise, and with 8 ranks it is 8 lines before the first step.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["KnownWarning", "quiet"]


@dataclass(frozen=True, slots=True)
class KnownWarning:
    """One upstream warning known not to apply, and why."""

    message: str
    """Regular expression matched at the start of the message."""
    why: str
    """Why it does not apply here (read by people; the docs quote it)."""
    category: type[Warning] | None = UserWarning
    """The ``warnings`` category; None: a record logged at WARNING level."""
    module: str = ""
    """``warnings``: a regular expression of the module that warns (empty: any).
    Logged: the logger's name (empty: the root logger)."""


class _DropKnown(logging.Filter):
    """Drops the records whose message matches one of ``patterns``."""

    def __init__(self) -> None:
        super().__init__()
        self.patterns: list[re.Pattern[str]] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


_FILTERS: dict[str, _DropKnown] = {}


def quiet(known: Sequence[KnownWarning]) -> None:
    """Silence exactly ``known`` in this process (idempotent)."""
    for w in known:
        if w.category is not None:
            warnings.filterwarnings("ignore", message=w.message, category=w.category,
                                    module=w.module)
            continue
        drop = _FILTERS.get(w.module)
        if drop is None:
            drop = _FILTERS[w.module] = _DropKnown()
            logging.getLogger(w.module or None).addFilter(drop)
        pattern = re.compile(w.message)
        if pattern not in drop.patterns:
            drop.patterns.append(pattern)
