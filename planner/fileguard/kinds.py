"""Kinds of output and how an existing file of each is recognised as replaceable.

A new kind of output (``dcp-plan report``'s HTML, ``compare``'s figure) is one entry of
``KINDS``: its description for messages, and a test that an existing regular file is this
kind's own output (which may be replaced; anything else is refused).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_SNIFF_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class OutputKind:
    """A kind of output: what to call it and how to recognise an existing file of its own."""

    description: str
    """``the plan``, ``the summary``: for messages ("cannot write the summary")."""
    own: Callable[[Path], bool]
    """True if an existing regular file is this kind's own output (and may be replaced)."""
    refusal: str
    """Why another file is refused: ``is not a dcp plan``."""


def _head(path: Path, size: int = _SNIFF_BYTES) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


def is_plan_file(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is an Arrow IPC file with a ``dcp.plan`` header (checksums not checked);
    False for anything but a regular file (a FIFO is never opened: that would block)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from planner.planfile.schema import HEADER_KEY

    try:
        if not stat.S_ISREG(os.stat(path).st_mode) or _head(Path(path), 6) != b"ARROW1":
            return False
        with pa.memory_map(os.fspath(path), "r") as src:
            meta = ipc.open_file(src).schema.metadata or {}
    except (pa.ArrowException, OSError, EOFError):
        return False
    return HEADER_KEY in meta


def _is_json_document(path: Path) -> bool:
    """An indented JSON object, as ``emit_summary`` and ``dcp-calibrate`` write: the text starts
    with ``{`` alone on its line, which no JSONL record (one object per line) can."""
    try:
        if path.stat().st_size > (64 << 20):
            return False
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if not text.strip():
        return True
    if not text.startswith("{\n"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


LOG_KEYS = ({"step", "loss", "microbatches"}, {"eval_loss"})
"""A log of this tool: its first line is a JSON object holding one of these key sets (a step
record, or an evaluation record)."""


def _is_log(path: Path) -> bool:
    """Empty, or a JSON-lines log whose first line is a step or evaluation record."""
    head = _head(path)
    if not head.strip():
        return True
    first = head.split(b"\n", 1)[0]
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and any(keys <= record.keys() for keys in LOG_KEYS)


def _magic(*prefixes: bytes) -> Callable[[Path], bool]:
    def own(path: Path) -> bool:
        head = _head(path, 512).lstrip().lower()
        return not head or any(head.startswith(p) for p in prefixes)

    return own


def _megatron_pair(path: Path) -> bool:
    """An empty file, or a ``.bin`` whose ``.idx`` beside it is a Megatron index."""
    idx = path.with_suffix(".idx")
    return _head(path, 1) == b"" or _head(idx, 7) == b"MMIDIDX"


KINDS: dict[str, OutputKind] = {
    "plan": OutputKind("plan", is_plan_file, "is not a dcp plan"),
    "summary": OutputKind("summary", _is_json_document, "is not a JSON summary"),
    "cost-model": OutputKind("cost model", _is_json_document, "is not a JSON cost model"),
    "plan-record": OutputKind("plan record", _is_json_document,
                              "is not a JSON plan record (dcp_plan.json)"),
    "log": OutputKind("log", _is_log, "is not a dcp-train JSON-lines log"),
    "figure": OutputKind("figure", _magic(b"\x89png", b"<?xml", b"<svg", b"%pdf"),
                         "is not a figure (PNG, SVG, PDF)"),
    "report": OutputKind("report", _magic(b"<!doctype html", b"<html"),
                         "is not an HTML report"),
    "lengths-cache": OutputKind("lengths cache", _magic(b"dcplen"),
                                "is not a dcp-plan lengths cache (.dcplen)"),
    "megatron-idx": OutputKind("Megatron index", _magic(b"mmididx"),
                               "is not a Megatron index (.idx)"),
    "megatron-bin": OutputKind("Megatron token file", _megatron_pair,
                               "is not the token file of a Megatron dataset (no MMIDIDX .idx "
                               "beside it)"),
}
"""Every kind of output; ``check_output(kind=...)`` takes one of these names. A new output
kind is one entry here."""
