"""JSONL lengths and the record index the runtime seeks with: one definition of a record.

A record is a line (lines end at ``\\n``) that is not blank; a blank line holds only spaces, tabs
and ``\\r`` and takes no sample index. Sample ``i`` is the ``i``-th record. Its length comes from
the first non-null field of ``input_ids``/``tokens`` (token lists: the number of tokens) and
``length``/``num_tokens`` (positive integers), or from the one field the caller names, which may
hold either. A JSON ``null`` counts as absent. Example (``|`` marks line ends)::

    {"input_ids": [5, 6, 7]}|   |{"length": 2}|  ->  offsets [0, 29], sizes [24, 13], lengths [3, 2]

Two paths give one answer. A numba kernel (``planner.sources.jsonl_scan``) validates every line and
reads
its length at a few hundred MB/s; every line it is unsure about, bad records included, goes to
``_record_length`` (``json.loads`` and type checks), the reference semantics, which also writes
every error message. The file is read in chunks, so memory stays bounded for any file size.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from numpy.typing import NDArray

from planner.jit import charge
from planner.sources.compressed import compression_of, iter_decompressed_lines
from planner.sources.formats import (
    CHUNK_BYTES,
    DEFAULT_FIELDS,
    INT_FIELDS,
    LIST_FIELDS,
    MAX_LENGTH,
    BadRecords,
    iter_line_chunks,
    only_token_list_hint,
)
from planner.sources.jsonl_scan import BLANK, CHECK, encode_fields, scan_chunk

_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}

Index = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]
JSON_S_PER_BYTE = 3e-8
"""The reference path's cost (``json.loads`` per line: 28 ns/byte on the sample, 2-core machine);
below the budget it beats compiling the scanner (3 CPU-s, ~100 MB of JSONL at that rate)."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _value_length(name: str, value: object) -> int | str:
    """Length held by a non-null field value, or the problem with it."""
    if isinstance(value, list) and name not in INT_FIELDS:
        # type() rather than isinstance(): a JSON true is a Python bool, a subclass of int.
        if not all(type(t) is int for t in value):
            pos, tok = next((i, t) for i, t in enumerate(value) if type(t) is not int)
            return f"{name!r} holds a non-integer token {_short(tok)} at position {pos}"
        return len(value) if value else f"{name!r} is empty"
    if type(value) is int and name not in LIST_FIELDS:
        if value <= 0:
            return f"{name!r} is {value}; lengths must be positive"
        return value if value <= MAX_LENGTH else (
            f"{name!r} is {value}, more than the {MAX_LENGTH} tokens a plan holds per sample")
    want = ("a list of token ids" if name in LIST_FIELDS else "an integer length"
            if name in INT_FIELDS else "a list of token ids or an integer length")
    return f"{name!r} is {_short(value)}, not {want}"


def _record_length(raw: bytes, fields: tuple[str, ...]) -> int | str:
    """Length of one record line, or the problem with it (the reference semantics)."""
    try:
        # errors="replace": invalid UTF-8 in some other field should not fail the record, as in
        # the fast path; utf-8-sig drops a byte-order mark on the first line.
        obj = json.loads(raw.decode("utf-8-sig", "replace"))
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return "not JSON (nested too deeply)"
    if not isinstance(obj, dict):
        return f"not a JSON object but {_JSON_TYPES.get(type(obj), 'a value')}"
    for name in fields:
        value = obj.get(name)
        if value is not None:
            return _value_length(name, value)
    lists = only_token_list_hint([k for k, v in obj.items() if isinstance(v, list) and v and all(
        type(t) is int for t in v)], "field")
    if len(fields) == 1:
        return f"no {fields[0]!r} field (or it is null)" + lists + _text_hint(obj)
    return ("no usable field (one of " + ", ".join(repr(f) for f in fields) + ")" + lists
            + _text_hint(obj))


def _text_hint(obj: dict[str, object]) -> str:
    """What to do when a record holds text but no tokens (a corpus not yet tokenized)."""
    text = [k for k, v in obj.items() if isinstance(v, str)]
    if not text:
        return ""
    fields = ", ".join(repr(k) for k in text[:3])
    return (f"; the record holds text ({fields}), not token ids: plan it with --tokenizer PATH "
            "(the model's tokenizer.json, or its folder; --field names the text field, default "
            "'text'), or tokenize it once (dcp-plan tokenize DATA --tokenizer PATH -o PREFIX, "
            "or Megatron-LM's tools/preprocess_data.py) and plan PREFIX")


def read_jsonl(path: str, field: str | None, bad: BadRecords) -> tuple[
        NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """(offsets, sizes, lengths) of the records of a JSONL file; bad records go to ``bad``."""
    fields = DEFAULT_FIELDS if field is None else (field,)
    names, bounds, kinds = encode_fields(fields, LIST_FIELDS, INT_FIELDS)
    offsets, sizes, lengths = [], [], []
    lines_before = samples_before = 0
    chunks = (iter_decompressed_lines(path, CHUNK_BYTES) if compression_of(path)
              else iter_line_chunks(path))
    for base, chunk in chunks:
        a = np.frombuffer(chunk, dtype=np.uint8)
        ends = np.flatnonzero(a == ord("\n"))
        start = np.empty_like(ends)
        start[0] = 0
        start[1:] = ends[:-1] + 1
        size = ends - start
        state = np.empty(len(ends), dtype=np.int8)
        length = np.empty(len(ends), dtype=np.int64)
        t = time.process_time()
        fast = scan_chunk.runs_compiled(len(a) * JSON_S_PER_BYTE)
        if fast:
            scan_chunk(a, ends, names, bounds, kinds, state, length)
        else:  # every line by the reference (cheaper than compiling the scanner for a small file)
            scan_chunk.note(a, ends, names, bounds, kinds, state, length)
            raw = bytes(chunk)
            state[:] = [BLANK if not raw[i:j].strip(b" \t\r") else CHECK
                        for i, j in zip(start.tolist(), ends.tolist(), strict=True)]
            length[:] = 0
        # Absurd lengths take the reference path, which names the line (before any planning
        # allocates per token or per segment).
        state[(state != BLANK) & (length > MAX_LENGTH)] = CHECK
        record = state != BLANK
        check = np.flatnonzero(state == CHECK)
        if len(check):
            sample = samples_before + np.cumsum(record) - 1
            for j in check.tolist():
                got = _record_length(bytes(chunk[start[j]:ends[j]]), fields)
                if isinstance(got, int):
                    length[j] = got
                else:
                    length[j] = 0
                    bad.add(int(sample[j]), f"{path}:{lines_before + j + 1}", got)
        if not fast:
            charge(time.process_time() - t)
        offsets.append(base + start[record])
        sizes.append(size[record])
        lengths.append(length[record])
        lines_before += len(ends)
        samples_before += len(offsets[-1])
    if not offsets:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(offsets), np.concatenate(sizes), np.concatenate(lengths)


def jsonl_index(path: str | os.PathLike[str], *, skip_bad_records: bool = False,
                field: str | None = None) -> Index:
    """Byte offset and size of every record's line, and its token count, for seeking to a sample.

    Sizes exclude the line's ``\\n``; ``json.loads`` of ``file[offset:offset + size]`` is the
    record. A skipped bad record keeps its entry with a token count of 0.

    Raises:
        ValueError: a bad record (file, 1-based line and problem) unless ``skip_bad_records``,
            or a file without records.
    """
    path = os.fspath(path)
    offsets, sizes, lengths = read_jsonl(path, field, BadRecords(skip=skip_bad_records))
    if len(offsets) == 0:
        raise ValueError(f"{path}: no records (the file is empty or blank)")
    return offsets, sizes, lengths


def token_fields(field: str | None) -> tuple[str, ...]:
    """Where a record's token list is looked for: ``field``, else ``input_ids`` then
    ``tokens``."""
    return (field,) if field is not None else tuple(
        f for f in DEFAULT_FIELDS if f in LIST_FIELDS)


def record_tokens(raw: bytes, fields: tuple[str, ...]) -> list[int]:
    """The token list of one record line: the first of ``fields`` that holds a list (the
    runtime's reader, ``runtime.data.token_jsonl``, and the content fingerprint both use this).

    Raises:
        ValueError: the line is not a JSON object, or holds no token list.
    """
    obj = json.loads(raw.decode("utf-8-sig", "replace"))
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object but {type(obj).__name__}")
    for name in fields:
        value = obj.get(name)
        if isinstance(value, list):
            return value
    raise ValueError(f"no token list under {' or '.join(repr(f) for f in fields)} (a dataset of "
                     "lengths only can be planned but not replayed)")
