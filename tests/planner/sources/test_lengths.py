"""planner.sources.lengths: every format round-trips, every bad record is named, chunking holds
(JSONL, text and the common checks here; Megatron, Parquet and Arrow in test_lengths_binary.py)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.sources import formats
from planner.sources.jsonl import _record_length
from planner.sources.jsonl_scan import BLANK, CHECK, OK, encode_fields, scan_chunk
from planner.sources.lengths import (
    LengthTable,
    jsonl_index,
    read_lengths,
)

REPO = Path(__file__).resolve().parents[3]
lengths_st = st.lists(st.integers(1, 3000), min_size=1, max_size=40)
# Per test, not a global profile: other test files keep their own settings. (The kernel property
# also passed with max_examples=4000 and a 1.2M-line mutation fuzz while it was written.)
quick = settings(deadline=None, max_examples=60,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# ---------------------------------------------------------------- JSONL


def test_jsonl_fields_blank_lines_and_index(tmp_path: Path) -> None:
    lines = ['{"input_ids": [5, 6, 7], "text": "a [1, 2] \\"quoted\\" }"}', "", "  \t ",
             '{"tokens": [1, 2]}', '{"length": 9, "id": "x"}\r', '{"num_tokens": 4}',
             '{"input_ids": null, "length": 2}', '  {"meta": {"input_ids": "no"}, "length": 3}  ']
    path = write(tmp_path / "d.jsonl", "\n".join(lines))  # last line without a newline
    table = read_lengths(path)
    assert table.format == "jsonl"
    assert table.path == str(path)
    assert table.lengths.tolist() == [3, 2, 9, 4, 2, 3]
    assert table.num_samples == 6
    assert table.num_tokens == 23
    assert len(table.skipped) == 0
    offsets, sizes, counts = jsonl_index(path)
    data = path.read_bytes()
    records = [line for line in lines if line.strip()]
    assert [data[o:o + s].decode() for o, s in zip(offsets, sizes, strict=True)] == records
    assert counts.tolist() == table.lengths.tolist()


@quick
@given(lengths=lengths_st, data=st.data())
def test_jsonl_round_trip(tmp_path_factory: pytest.TempPathFactory, lengths: list[int],
                          data: st.DataObject) -> None:
    out, expected = [], []
    for n in lengths:
        kind = data.draw(st.sampled_from(["input_ids", "tokens", "length", "num_tokens"]))
        rec: dict[str, object] = {kind: list(range(n)) if kind in ("input_ids", "tokens") else n}
        if data.draw(st.booleans()):
            rec["text"] = data.draw(st.text(max_size=12))
        indent = " " * data.draw(st.integers(0, 2))
        out.append(indent + json.dumps(rec, ensure_ascii=data.draw(st.booleans())))
        expected.append(n)
        if data.draw(st.integers(0, 4)) == 0:
            out.append(data.draw(st.sampled_from(["", " ", "\t", "\r"])))
    eol = data.draw(st.sampled_from(["\n", "\r\n"]))
    path = tmp_path_factory.mktemp("rt") / "d.jsonl"
    path.write_bytes((eol.join(out) + data.draw(st.sampled_from(["", eol]))).encode())
    assert read_lengths(path).lengths.tolist() == expected
    offsets, sizes, counts = jsonl_index(path)
    raw = path.read_bytes()
    spans = zip(offsets.tolist(), sizes.tolist(), strict=True)
    records = [json.loads(raw[o:o + s]) for o, s in spans]
    assert [_record_length(json.dumps(r).encode(), formats.DEFAULT_FIELDS)
            for r in records] == expected == counts.tolist()


BAD_JSONL = [
    ('{"input_ids": [1, 2, 3, "x"]}', "'input_ids' holds a non-integer token 'x' at position 3"),
    ('{"input_ids": [1, 2.0]}', "'input_ids' holds a non-integer token 2.0 at position 1"),
    ('{"tokens": [true]}', "'tokens' holds a non-integer token True at position 0"),
    ('{"input_ids": [1, null]}', "'input_ids' holds a non-integer token None at position 1"),
    ('{"input_ids": []}', "'input_ids' is empty"),
    ('{"input_ids": 5}', "'input_ids' is 5, not a list of token ids"),
    ('{"length": 0}', "'length' is 0; lengths must be positive"),
    ('{"length": -4}', "'length' is -4; lengths must be positive"),
    ('{"length": 2.5}', "'length' is 2.5, not an integer length"),
    ('{"num_tokens": true}', "'num_tokens' is True, not an integer length"),
    ('{"length": "7"}', "'length' is '7', not an integer length"),
    ('{"length": [1]}', "'length' is [1], not an integer length"),
    ('{"text": "hi"}', "no usable field"),
    ('{"length": null}', "no usable field"),
    ("[1, 2]", "not a JSON object but an array"),
    ("17", "not a JSON object but a number"),
    ('{"length": 3', "not JSON"),
    ('{"length": 3} {"length": 4}', "not JSON"),
    ("garbage", "not JSON"),
    ('{"length": 01}', "not JSON"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_JSONL)
def test_jsonl_bad_record_names_file_line_and_problem(tmp_path: Path, line: str,
                                                      problem: str) -> None:
    path = write(tmp_path / "data.jsonl", f'{{"length": 5}}\n\n{line}\n{{"length": 6}}\n')
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}:3: {problem}")):
        read_lengths(path)
    table = read_lengths(path, skip_bad_records=True)
    assert table.lengths.tolist() == [5, 0, 6]
    assert table.skipped.tolist() == [1]


def test_jsonl_skip_counts_every_bad_record_and_keeps_indices(tmp_path: Path) -> None:
    lines = ['{"length": 3}', "oops", '{"input_ids": [1, "a"]}', '{"length": 2}', "{}",
             '{"length": 0}']
    path = write(tmp_path / "d.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not JSON"):
        read_lengths(path)
    table = read_lengths(path, skip_bad_records=True)
    assert table.lengths.tolist() == [3, 0, 0, 2, 0, 0]
    assert table.skipped.tolist() == [1, 2, 4, 5]
    offsets, _, counts = jsonl_index(path, skip_bad_records=True)
    assert len(offsets) == 6
    assert counts.tolist() == table.lengths.tolist()


def test_jsonl_named_field(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", '{"ids": [1, 2], "length": 9}\n{"ids": 4}\n')
    assert read_lengths(path, field="ids").lengths.tolist() == [2, 4]
    assert read_lengths(path, skip_bad_records=True).lengths.tolist() == [9, 0]
    with pytest.raises(ValueError, match=r"d\.jsonl:2: no usable field \(one of 'input_ids'"):
        read_lengths(path)
    with pytest.raises(ValueError, match=r"d\.jsonl:1: no 'n' field"):
        read_lengths(path, field="n")


def test_jsonl_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=300)
    text = "".join(json.dumps({"input_ids": list(range(n))}) + ("\n\n" if n % 7 else "\n")
                   for n in lengths.tolist())
    path = write(tmp_path / "d.jsonl", text + '{"length": 11}')
    monkeypatch.setattr(formats, "CHUNK_BYTES", 97)  # lines longer than a chunk too
    assert read_lengths(path).lengths.tolist() == [*lengths.tolist(), 11]
    path.write_bytes(text.encode() + b'{"length": 0}\n')
    with pytest.raises(ValueError, match=rf":{text.count(chr(10)) + 1}: 'length' is 0"):
        read_lengths(path)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**20) | st.floats(allow_nan=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=8)
KEYS = st.sampled_from(["input_ids", "tokens", "length", "num_tokens", "text", "input\\u005fids"])


@quick
@given(st.lists(st.tuples(st.dictionaries(KEYS, JSON_VALUES | st.lists(st.integers(-3, 10**19)),
                                          max_size=3), st.integers(0, 3), st.binary(max_size=2)),
                min_size=1, max_size=20),
       st.sampled_from([formats.DEFAULT_FIELDS, ("length",), ("text",)]))
def test_kernel_is_never_laxer_than_the_reference(
        lines: list[tuple[dict[str, object], int, bytes]], fields: tuple[str, ...]) -> None:
    """Wherever the numba kernel decides a line, json.loads and the reference agree with it."""
    raw_lines = []
    for obj, mutation, junk in lines:
        raw = json.dumps(obj).encode()
        if mutation == 1 and len(raw) > 2:  # damage the line: the kernel must not accept it
            cut = len(junk) % len(raw)
            raw = raw[:cut] + junk + raw[cut + 1:]
        elif mutation == 2:  # other whitespace; an escaped key that decodes to "input_ids"
            raw = raw.replace(b", ", b" ,\t").replace(b"\\\\u005f", b"\\u005f")
        raw_lines.append(raw.replace(b"\n", b" "))
    chunk = b"\n".join(raw_lines) + b"\n"
    a = np.frombuffer(chunk, dtype=np.uint8)
    ends = np.flatnonzero(a == ord("\n"))
    states = np.zeros(len(ends), dtype=np.int8)
    lengths = np.zeros(len(ends), dtype=np.int64)
    scan_chunk(a, ends, *encode_fields(fields, formats.LIST_FIELDS, formats.INT_FIELDS),
               states, lengths)
    for raw, state, length in zip(raw_lines, states.tolist(), lengths.tolist(), strict=True):
        assert (state == BLANK) == (raw.strip(b" \t\r") == b""), raw
        if state == OK and length > formats.MAX_LENGTH:
            # read_jsonl sends these lines to the reference, which refuses them by name.
            assert isinstance(_record_length(raw, fields), str), raw
        elif state == OK:
            assert _record_length(raw, fields) == length, raw
        else:
            assert state in (BLANK, CHECK)


def test_sample_dataset() -> None:
    table = read_lengths(REPO / "data" / "sample.jsonl")
    assert table.num_samples == 2000
    assert 700_000 < table.num_tokens < 1_100_000
    assert table.lengths.max() == 30000
    assert table.lengths.min() >= 16
    assert (REPO / "data" / "sample.jsonl").stat().st_size < 5 * 2**20


# ---------------------------------------------------------------- .txt


def test_text_round_trip_and_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "l.txt", "5\n17\n\n  \n9\r\n3")
    table = read_lengths(path)
    assert table.format == "text"
    assert table.lengths.tolist() == [5, 17, 9, 3]


@pytest.mark.parametrize(("line", "problem"), [
    ("0", "length 0 is not positive"), ("-3", "length -3 is not positive"),
    ("abc", "'abc' is not an integer length"), ("1.5", "'1.5' is not an integer length"),
    ("4 5", "expected one integer length, got 2 fields"),
])
def test_text_bad_lines(tmp_path: Path, line: str, problem: str) -> None:
    path = write(tmp_path / "l.txt", f"5\n\n{line}\n7\n")
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}:3: {problem}')}$"):
        read_lengths(path)
    table = read_lengths(path, skip_bad_records=True)
    assert table.lengths.tolist() == [5, 0, 7]
    assert table.skipped.tolist() == [1]


def test_text_chunks_and_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    values = rng.integers(1, 2**31, size=500)
    path = write(tmp_path / "l.txt", "\n".join(map(str, values.tolist())) + "\n")
    monkeypatch.setattr(formats, "CHUNK_BYTES", 50)
    assert np.array_equal(read_lengths(path).lengths, values)
    path.write_text("\n".join(map(str, values.tolist())) + "\nx\n")
    with pytest.raises(ValueError, match=":501: 'x' is not"):
        read_lengths(path)
    # The shipped workload (1M lines, in the repository): the fast path over real data.
    text = gzip.decompress((REPO / "data" / "workloads"
                            / "flexsp_wikipedia_lengths.txt.gz").read_bytes())
    workload = tmp_path / "wikipedia.txt"
    workload.write_bytes(text)
    monkeypatch.setattr(formats, "CHUNK_BYTES", 1 << 24)
    table = read_lengths(workload)
    assert table.num_samples == 1_000_000
    assert table.lengths.tolist() == [int(x) for x in text.split()]


# ---------------------------------------------------------------- common


def test_empty_missing_and_unknown(tmp_path: Path) -> None:
    for name in ("e.jsonl", "e.txt"):
        for content in (b"", b"\n \n"):
            with pytest.raises(ValueError, match="no samples|no records"):
                read_lengths(write(tmp_path / name, content))
    with pytest.raises(ValueError, match="no records"):
        jsonl_index(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="all 2 samples are bad records"):
        read_lengths(write(tmp_path / "bad.txt", "0\n0\n"), skip_bad_records=True)
    with pytest.raises(ValueError, match="no such file"):
        read_lengths(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown dataset format"):
        read_lengths(write(tmp_path / "x.csv", "1\n"))
    with pytest.warns(UserWarning, match="field='ids' is ignored"):
        read_lengths(write(tmp_path / "ok.txt", "3\n"), field="ids")


def test_length_table_is_read_only(tmp_path: Path) -> None:
    table = read_lengths(write(tmp_path / "l.txt", "3\n4\n"))
    assert isinstance(table, LengthTable)
    assert table.lengths.dtype == np.int64
    with pytest.raises(ValueError, match="read-only"):
        table.lengths[0] = 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format": "txt"}, "format 'txt' is not one of"),
        ({"lengths": [[1, 2]]}, "lengths must be one-dimensional"),
        ({"lengths": [3, -1]}, "sample 1 has length -1"),
    ],
)
def test_length_table_rejects_bad_input(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"path": "mem", "format": "text", "lengths": [3, 4], "skipped": []}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        LengthTable(**args)  # type: ignore[arg-type]
