"""runtime.data.tokens: every source returns the right tokens; the JSONL index cache behaves."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from runtime.data.tokens import (
    ArrayTokens,
    ArrowTokens,
    BatchedTokenSource,
    JsonlTokens,
    MegatronTokens,
    TokenSource,
    open_token_source,
    read_segments,
)


@pytest.fixture(scope="module")
def docs() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 60_000, size=int(n)) for n in rng.integers(1, 300, size=257)]


def write_jsonl(path: Path, docs: list[np.ndarray], field: str = "input_ids") -> Path:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"id": "x", field: d.tolist()}) + "\n")
    return path


def write_ipc(path: Path, docs: list[np.ndarray], rows_per_batch: int) -> Path:
    col = pa.array([d.tolist() for d in docs], type=pa.list_(pa.int32()))
    table = pa.table({"input_ids": col, "n": pa.array([len(d) for d in docs])})
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        for b in table.to_batches(max_chunksize=rows_per_batch):
            w.write_batch(b)
    return path


def write_parquet(path: Path, docs: list[np.ndarray], row_group_size: int) -> Path:
    col = pa.array([d.tolist() for d in docs], type=pa.large_list(pa.int64()))
    pq.write_table(pa.table({"tokens": col}), str(path), row_group_size=row_group_size)
    return path


def write_megatron(prefix: Path, docs: list[np.ndarray]) -> Path:
    from planner.sources.megatron import write_megatron_dataset

    write_megatron_dataset(prefix, docs, dtype=np.uint16)
    return prefix


def check_random_reads(src: TokenSource, docs: list[np.ndarray], seed: int = 0) -> None:
    assert isinstance(src, TokenSource)
    assert src.num_samples == len(docs)
    assert src.lengths().tolist() == [len(d) for d in docs]
    assert src.lengths().dtype == np.int64
    rng = np.random.default_rng(seed)
    for _ in range(300):
        s = int(rng.integers(len(docs)))
        off = int(rng.integers(len(docs[s])))
        n = int(rng.integers(0, len(docs[s]) - off + 1))
        got = src.read(s, off, n)
        assert got.dtype == np.int64
        assert got.tolist() == docs[s][off:off + n].tolist(), (s, off, n)
    # Many segments at once: read_many where the source has it, else per-row reads.
    for _ in range(20):
        ss = rng.integers(len(docs), size=int(rng.integers(0, 40)))
        oo = np.array([rng.integers(len(docs[i])) for i in ss], dtype=np.int64)
        nn = np.array([rng.integers(0, len(docs[i]) - o + 1)
                       for i, o in zip(ss, oo, strict=True)], np.int64)
        want = [t for i, o, k in zip(ss, oo, nn, strict=True) for t in docs[i][o:o + k].tolist()]
        assert read_segments(src, ss, oo, nn).tolist() == want
        if isinstance(src, BatchedTokenSource):
            assert src.read_many(ss, oo, nn).tolist() == want
    if isinstance(src, BatchedTokenSource):
        with pytest.raises(ValueError, match=f"sample {len(docs)} out of range"):
            src.read_many(np.array([0, len(docs)]), np.zeros(2, np.int64), np.ones(2, np.int64))
        with pytest.raises(ValueError, match=f"sample 0 has {len(docs[0])} tokens"):
            src.read_many(np.array([1, 0]), np.array([0, 1]), np.array([1, len(docs[0])]))
    last = len(docs) - 1
    assert src.read(last, 0, len(docs[last])).tolist() == docs[last].tolist()
    with pytest.raises(ValueError, match=f"sample {len(docs)} out of range"):
        src.read(len(docs), 0, 1)
    with pytest.raises(ValueError, match=f"sample 0 has {len(docs[0])} tokens"):
        src.read(0, 1, len(docs[0]))


def test_array_source(docs: list[np.ndarray]) -> None:
    check_random_reads(ArrayTokens.from_sequences(docs), docs)


@pytest.mark.parametrize("rows_per_batch", [1, 50, 1000])
def test_arrow_ipc(tmp_path: Path, docs: list[np.ndarray], rows_per_batch: int) -> None:
    path = write_ipc(tmp_path / "d.arrow", docs, rows_per_batch)
    check_random_reads(ArrowTokens(path), docs)
    check_random_reads(open_token_source(path), docs, seed=1)


@pytest.mark.parametrize("row_group_size", [7, 100, 1000])
def test_parquet(tmp_path: Path, docs: list[np.ndarray], row_group_size: int) -> None:
    path = write_parquet(tmp_path / "d.parquet", docs, row_group_size)
    check_random_reads(ArrowTokens(path, cache_bytes=4096), docs)  # evicts often
    check_random_reads(open_token_source(path), docs, seed=1)


def test_arrow_column_choice_and_bad_rows(tmp_path: Path) -> None:
    table = pa.table({"a": pa.array([[1, 2], [3]]), "b": pa.array([[4], None]),
                      "c": pa.array(["x", "y"])})
    pq.write_table(table, str(tmp_path / "t.parquet"))
    with pytest.raises(ValueError, match="name the token column"):
        ArrowTokens(tmp_path / "t.parquet")
    with pytest.raises(ValueError, match="'c' is not a list-of-integers column"):
        ArrowTokens(tmp_path / "t.parquet", column="c")
    src = ArrowTokens(tmp_path / "t.parquet", column="b")
    # A null row is a bad record: length 0, as the planner counts it when skipping.
    assert src.lengths().tolist() == [1, 0]
    with pytest.raises(ValueError, match="sample 1 has 0 tokens"):
        src.read(1, 0, 1)
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match="not an Arrow IPC file or stream"):
        ArrowTokens(tmp_path / "junk.arrow")


def test_arrow_stream(tmp_path: Path, docs: list[np.ndarray]) -> None:
    t = pa.table({"input_ids": pa.array([d.tolist() for d in docs])})
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, \
            ipc.new_stream(sink, t.schema) as w:
        for b in t.to_batches(max_chunksize=64):
            w.write_batch(b)
    check_random_reads(ArrowTokens(tmp_path / "s.arrow"), docs)


def test_megatron(tmp_path: Path, docs: list[np.ndarray]) -> None:
    prefix = write_megatron(tmp_path / "mega", docs)
    check_random_reads(MegatronTokens(prefix), docs)
    check_random_reads(open_token_source(str(prefix) + ".bin"), docs, seed=1)
    check_random_reads(open_token_source(prefix), docs, seed=2)


def test_jsonl(tmp_path: Path, docs: list[np.ndarray]) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    assert not isinstance(JsonlTokens(path), BatchedTokenSource)  # per-row fallback path
    check_random_reads(JsonlTokens(path), docs)
    check_random_reads(open_token_source(path), docs, seed=1)
    tpath = write_jsonl(tmp_path / "t.jsonl", docs[:5], field="tokens")
    assert JsonlTokens(tpath).read(3, 0, 2).tolist() == docs[3][:2].tolist()


def test_jsonl_cache_built_once_and_rebuilt_when_stale(tmp_path: Path,
                                                       docs: list[np.ndarray]) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    first = JsonlTokens(path)
    cache = Path(str(path) + ".dcpidx")
    assert first.index_built
    assert first.index_path == cache
    assert cache.is_file()
    stamp = cache.stat().st_mtime_ns
    second = JsonlTokens(path)
    assert not second.index_built
    assert cache.stat().st_mtime_ns == stamp
    check_random_reads(second, docs)
    # Rewrite the file (other sizes, new mtime): the old index would read garbage.
    write_jsonl(path, docs[::-1])
    third = JsonlTokens(path)
    assert third.index_built
    check_random_reads(third, docs[::-1])
    assert not JsonlTokens(path).index_built
    # Index options are part of the key: another field means another index.
    assert JsonlTokens(path, field="input_ids").index_built


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[None]:
    """Make ``path`` unwritable, also for root (chattr +i); skip where that is impossible."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("running as root without chattr: cannot make a directory read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_jsonl_cache_falls_back_to_cache_dir(tmp_path: Path, docs: list[np.ndarray]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    path = write_jsonl(data / "d.jsonl", docs)
    with read_only_dir(data):
        src = JsonlTokens(path, cache_dir=tmp_path / "cache")
        assert src.index_built
        assert src.index_path is not None
        assert src.index_path.parent == tmp_path / "cache"
        assert not Path(str(path) + ".dcpidx").exists()
        again = JsonlTokens(path, cache_dir=tmp_path / "cache")
        assert not again.index_built
        assert again.index_path == src.index_path
        check_random_reads(again, docs)
        with pytest.warns(UserWarning, match="index lives in memory only"):
            mem = JsonlTokens(path)
        assert mem.index_built
        assert mem.index_path is None
        check_random_reads(mem, docs)


def test_open_token_source_rejects_unknown(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        open_token_source(tmp_path / "x.csv")
