"""planner.sources.lengths for the binary formats (Megatron indexed datasets, Parquet, Arrow): every
format round-trips and every bad record is named; test_lengths.py has JSONL, text and the
common checks."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.sources.lengths import (
    read_lengths,
    read_megatron_index,
    write_megatron_dataset,
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


# ---------------------------------------------------------------- Megatron


@quick
@given(lengths=lengths_st, dtype=st.sampled_from([np.uint8, np.int8, np.int16, np.int32,
                                                  np.int64, np.uint16]))
def test_megatron_round_trip(tmp_path_factory: pytest.TempPathFactory, lengths: list[int],
                             dtype: type[np.integer]) -> None:
    prefix = tmp_path_factory.mktemp("mg") / "ds"
    docs = [np.arange(n) % 100 for n in lengths]
    write_megatron_dataset(prefix, docs, dtype=dtype)
    sizes, pointers, got_dtype = read_megatron_index(prefix)
    itemsize = np.dtype(dtype).itemsize
    assert sizes.tolist() == lengths
    assert got_dtype == np.dtype(dtype)
    assert pointers.tolist() == (np.cumsum([0, *lengths[:-1]]) * itemsize).tolist()
    bin_data = np.fromfile(f"{prefix}.bin", dtype=np.dtype(dtype).newbyteorder("<"))
    assert bin_data[pointers[-1] // itemsize:].tolist() == docs[-1].tolist()
    for path in (prefix, f"{prefix}.idx", f"{prefix}.bin"):
        table = read_lengths(path)
        assert table.format == "megatron"
        assert table.lengths.tolist() == lengths


def test_megatron_header_layout(tmp_path: Path) -> None:
    write_megatron_dataset(tmp_path / "ds", [[1, 2, 3], [4], [5, 6]], dtype=np.uint16)
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([8]) + struct.pack("<Q", 3)
                + struct.pack("<Q", 4) + struct.pack("<3i", 3, 1, 2)
                + struct.pack("<3q", 0, 6, 8) + struct.pack("<4q", 0, 1, 2, 3))
    assert (tmp_path / "ds.idx").read_bytes() == expected
    assert (tmp_path / "ds.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)


def test_megatron_errors(tmp_path: Path) -> None:
    prefix = tmp_path / "ds"
    write_megatron_dataset(prefix, [[1, 2], [], [3]])
    with pytest.raises(ValueError, match=r"ds\.idx: document 1: length 0; lengths must be"):
        read_lengths(prefix)
    with pytest.raises(ValueError, match=r"ds\.idx: sequence 1: length 0; lengths must be"):
        read_lengths(prefix, megatron_unit="sequence")
    assert read_lengths(prefix, skip_bad_records=True).skipped.tolist() == [1]
    idx = (tmp_path / "ds.idx").read_bytes()
    for name, data, message in [
        ("magic", b"XXIDIDX\x00\x00" + idx[9:], "bad header"),
        ("version", idx[:9] + struct.pack("<Q", 2) + idx[17:], "version 2"),
        ("float", idx[:17] + bytes([6]) + idx[18:], r"dtype code 6 \(float64\)"),
        ("short", idx[:40], "truncated"),
    ]:
        write(tmp_path / f"{name}.idx", data)
        with pytest.raises(ValueError, match=message):
            read_megatron_index(tmp_path / name)
    (tmp_path / "ds.bin").write_bytes(b"\0" * 4)
    with pytest.raises(ValueError, match=r"ds\.bin: holds 4 bytes, its index addresses 12"):
        read_lengths(prefix)
    with pytest.raises(ValueError, match="not a Megatron integer token dtype"):
        write_megatron_dataset(prefix, [[1]], dtype=np.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside uint8"):
        write_megatron_dataset(prefix, [[300]], dtype=np.uint8)


# ---------------------------------------------------------------- Parquet and Arrow

TABLE = pa.table({
    "input_ids": pa.array([[1, 2, 3], None, [4], [5, 6]], pa.list_(pa.int32())),
    "length": pa.array([99, 7, 98, 97], pa.int64()),
    "text": ["a", "b", "c", "d"],
})


def write_ipc(path: Path, table: pa.Table, *, stream: bool) -> Path:
    with pa.OSFile(str(path), "wb") as sink:
        opener = ipc.new_stream if stream else ipc.new_file
        with opener(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
    return path


def columnar_files(tmp_path: Path, table: pa.Table) -> list[Path]:
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    return [tmp_path / "t.parquet", write_ipc(tmp_path / "t.arrow", table, stream=False),
            write_ipc(tmp_path / "t.ipc", table, stream=True),
            write_ipc(tmp_path / "t.feather", table, stream=False)]


def test_columnar_list_and_int_columns(tmp_path: Path) -> None:
    for path in columnar_files(tmp_path, TABLE):
        table = read_lengths(path)
        assert table.format == ("parquet" if path.suffix == ".parquet" else "arrow")
        assert table.lengths.tolist() == [3, 7, 1, 2]  # a null list falls back to "length"
        assert read_lengths(path, field="length").lengths.tolist() == [99, 7, 98, 97]
    # A later candidate of another type (token strings) is not a length column: left out.
    strings = TABLE.append_column("tokens", pa.array([["a"], ["b"], None, ["c"]]))
    for path in columnar_files(tmp_path, strings.drop_columns(["length"])):
        with pytest.raises(ValueError, match=r": row 1: 'input_ids' is null$"):
            read_lengths(path)


@pytest.mark.parametrize(("column", "problem"), [
    (pa.array([[1], None], pa.list_(pa.int64())), "'input_ids' is null"),
    (pa.array([[1], []], pa.list_(pa.int64())), "'input_ids' is empty"),
    (pa.array([[1], [2, None]], pa.list_(pa.int64())), "'input_ids' holds a null token at "
                                                           "position 1"),
])
def test_columnar_bad_rows(tmp_path: Path, column: pa.Array, problem: str) -> None:
    for path in columnar_files(tmp_path, pa.table({"input_ids": column})):
        with pytest.raises(ValueError, match=f"^{re.escape(f'{path}: row 1: {problem}')}$"):
            read_lengths(path)
        table = read_lengths(path, skip_bad_records=True)
        assert table.lengths.tolist() == [1, 0]
        assert table.skipped.tolist() == [1]


def test_columnar_int_column_and_schema_errors(tmp_path: Path) -> None:
    ints = pa.table({"num_tokens": pa.array([4, 0, None, 8], pa.int32())})
    for path in columnar_files(tmp_path, ints):
        with pytest.raises(ValueError, match=r": row 1: 'num_tokens' is 0; lengths must be"):
            read_lengths(path)
        assert read_lengths(path, skip_bad_records=True).skipped.tolist() == [1, 2]
    for table, message in [
        (pa.table({"input_ids": pa.array([[1.0]])}),
         r"'input_ids' has type list<\w+: double>; expected a list of integer"),
        (pa.table({"length": pa.array([1.5])}), "'length' has type double; expected integer"),
        (pa.table({"x": [1]}), r"no column input_ids, tokens, length, num_tokens; columns are"),
    ]:
        for path in columnar_files(tmp_path, table):
            with pytest.raises(ValueError, match=message):
                read_lengths(path)
    write(tmp_path / "junk.arrow", b"not arrow at all")
    with pytest.raises(ValueError, match="not an Arrow IPC file or stream"):
        read_lengths(tmp_path / "junk.arrow")


def test_empty_binary_datasets(tmp_path: Path) -> None:
    empty = pa.table({"length": pa.array([], pa.int64())})
    for path in columnar_files(tmp_path, empty):
        with pytest.raises(ValueError, match="no samples"):
            read_lengths(path)
    write_megatron_dataset(tmp_path / "mg", [])
    with pytest.raises(ValueError, match="no samples"):
        read_lengths(tmp_path / "mg")
