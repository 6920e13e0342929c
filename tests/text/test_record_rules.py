"""Training reads a text corpus's records as the planner reads them: one set of rules.

The planner streams a text corpus (``planner.sources.text.iter_texts`` / ``count_lengths``); the
runtime reads it by sample index (``runtime.data.text_records``). On a corpus holding every kind
of awkward record (blank and whitespace lines, a BOM at the start and one in the middle, bytes
that are not UTF-8, a null, missing, numeric or token-id field, an empty text, an unpaired
surrogate, CRLF, a last line without a newline) both must give the same samples, the same
texts, the same counts (0 for bad records) and the same problem for each bad record, in every
format: JSONL, .jsonl.gz, .jsonl.zst, Parquet and Arrow (string, large_string, string_view).
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from numpy.typing import NDArray

from planner.sources.formats import BadRecords
from planner.sources.text import count_lengths, iter_texts
from planner.sources.textenc import TextEncoder, load_encoder
from runtime.data.text_records import open_text_records
from runtime.data.token_text import count_records
from tests.text.bpe import train_bpe

BOM = b"\xef\xbb\xbf"
LINES = [
    b'{"text": "first record"}',
    b"",
    b" \t\r",
    b'{"text": ""}',
    b'{"text": "caf\xe9 au lait"}',  # Latin-1, not UTF-8
    b'{"text": null}',
    b'{"id": 3, "title": "no text field"}',
    b'{"text": 5}',
    b'{"text": [1, 2, 3]}',
    BOM + b'{"text": "a BOM in the middle"}',
    b'{"text": "\\ud800 lone surrogate"}',
    b"not json",
    b"[1]",
    b'{"text": "crlf line"}\r',
    '{"text": "ünïcödé ☃ plan"}'.encode(),
    b"\t  ",
    b'{"text": "the last line, no newline"}',
]


class Collected(BadRecords):
    """Skips bad records, keeping each one's location and problem."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        super().__init__(skip=True)
        self.seen: dict[int, tuple[str, str]] = {}

    def add(self, sample_index: int, location: str, problem: str) -> None:
        self.seen[sample_index] = (location, problem)
        super().add(sample_index, location, problem)

    def add_rows(self, indices: NDArray[np.int64],
                 describe: Callable[[int], tuple[str, str]]) -> None:
        for i in indices.tolist():
            self.seen[int(i)] = describe(int(i))
        super().add_rows(indices, describe)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> TextEncoder:
    return load_encoder(train_bpe(tmp_path_factory.mktemp("tok")), append_eod=True)


def _planner(path: Path, fmt: str, encoder: TextEncoder
             ) -> tuple[dict[int, str], NDArray[np.int64], dict[int, tuple[str, str]]]:
    """(text of each good sample, every sample's count, location and problem of each bad one)."""
    texts: dict[int, str] = {}
    for batch in iter_texts(str(path), fmt, "text", BadRecords(skip=True)):
        texts.update(zip(batch.samples.tolist(), batch.texts, strict=True))
    bad = Collected()
    counts = count_lengths(str(path), fmt, "text", encoder, bad)
    return texts, counts, bad.seen


def _check_same(path: Path, fmt: str, encoder: TextEncoder) -> dict[int, tuple[str, str]]:
    texts, counts, bad = _planner(path, fmt, encoder)
    records = open_text_records(str(path), "text")
    assert records.num_samples == len(counts)
    got = records.texts(range(records.num_samples))
    # The surrogate passes iter_texts (the tokenizer finds it); the runtime names it at once.
    assert {i: t for i, t in enumerate(got) if t is not None} == {
        i: t for i, t in texts.items() if i not in bad}
    (runtime_counts,) = count_records([records], encoder, skip_bad_records=True)
    assert runtime_counts.tolist() == counts.tolist()
    for i, (location, problem) in bad.items():
        assert got[i] is None
        assert records.problem(i) == problem
        where = records.where(i)
        assert location == (f"{path}:{where.split()[1]}" if fmt == "jsonl"
                            else f"{path}: {where}")
    assert all(records.problem(i) == "" for i, t in enumerate(got) if t is not None)
    return bad


@pytest.mark.parametrize("compression", ["", ".gz", ".zst"])
@pytest.mark.parametrize("first", ["record", "blank"])
def test_jsonl_records_are_the_planners(tmp_path: Path, encoder: TextEncoder,
                                        compression: str, first: str) -> None:
    lines = [b"", *LINES] if first == "blank" else LINES  # a BOM alone on the first line
    raw = BOM + b"\n".join(lines)
    path = tmp_path / f"c.jsonl{compression}"
    if compression == ".gz":
        raw = gzip.compress(raw)
    elif compression == ".zst":
        import zstandard

        raw = zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(raw)
    bad = _check_same(path, "jsonl", encoder)
    problems = [p for _, p in bad.values()]
    assert len(bad) == 9
    assert any(p.startswith("not UTF-8 text (byte 0xe9 at byte 14 of the line)")
               for p in problems)
    assert any("unpaired surrogate" in p for p in problems)
    assert any("Unexpected UTF-8 BOM" in p for p in problems)  # only the file's first is skipped
    records = open_text_records(str(path), "text")
    assert records.texts([0, 1]) == ["first record", ""]  # the empty text is a record
    assert records.where(0) == ("line 2" if first == "blank" else "line 1")


@pytest.mark.parametrize("kind", ["parquet", "arrow-string", "arrow-large", "arrow-view"])
def test_columnar_records_are_the_planners(tmp_path: Path, encoder: TextEncoder,
                                           kind: str) -> None:
    docs = ["plan step", None, "", "rank ring group", None, "token " * 40, "last"]
    t = {"arrow-large": pa.large_string(), "arrow-view": pa.string_view()}.get(kind,
                                                                               pa.string())
    table = pa.table({"id": pa.array(range(len(docs))), "text": pa.array(docs, type=t)})
    if kind == "parquet":
        path = tmp_path / "c.parquet"
        pq.write_table(table, path, row_group_size=3)
    else:
        path = tmp_path / "c.arrow"
        feather.write_feather(table, path, compression="uncompressed", chunksize=3)
    fmt = "parquet" if kind == "parquet" else "arrow"
    bad = _check_same(path, fmt, encoder)
    assert sorted(bad) == [1, 4]
    assert bad[1] == (f"{path}: row 1", "'text' is null")


def test_a_column_without_text_is_refused_alike(tmp_path: Path) -> None:
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]], "title": ["a", "b"]}), path)
    for field, says in (("input_ids", "it holds token ids"), ("text", "no column 'text'")):
        with pytest.raises(ValueError, match=says) as planner_error:
            list(iter_texts(str(path), "parquet", field, BadRecords(skip=True)))
        with pytest.raises(ValueError, match=says) as runtime_error:
            open_text_records(str(path), field)
        assert str(runtime_error.value) == str(planner_error.value)


def test_a_bad_record_stops_training_with_the_planners_words(tmp_path: Path,
                                                              encoder: TextEncoder) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + LINES[4] + b"\n")
    with pytest.raises(ValueError, match="not UTF-8") as planner_error:
        count_lengths(str(path), "jsonl", "text", encoder, BadRecords(skip=False))
    records = open_text_records(str(path), "text")
    with pytest.raises(ValueError, match="not UTF-8") as runtime_error:
        count_records([records], encoder)
    problem = str(planner_error.value).split(": ", 1)[1]
    assert str(planner_error.value) == f"{path}:2: {problem}"
    assert str(runtime_error.value) == f"{path}: record of sample 1 (line 2): {problem}"
