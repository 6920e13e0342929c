"""``dcp-plan tokenize``: a text corpus into a Megatron indexed dataset that megatron-core's own
``IndexedDataset`` reads back token for token, and that plans as the text does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from planner.cli import main
from planner.sources.lengths import read_lengths
from planner.sources.pretokenize import tokenize_dataset
from planner.sources.textenc import load_encoder
from tests.text.bpe import texts, train_bpe

pytest.importorskip("tokenizers")


@pytest.fixture(autouse=True)
def _user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_megatron_core_reads_the_dataset_token_for_token(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    tok = train_bpe(tmp_path / "tok").parent
    docs = texts(120, seed=7)  # the first one empty
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    prefix = tmp_path / "out" / "corpus"
    assert main(["tokenize", str(data), "--tokenizer", str(tok), "-o", str(prefix),
                 "--workers", "2", "--bos", "none"]) == 0
    summary = capsys.readouterr().out
    assert "119 documents" in summary
    assert "left out 1 empty documents" in summary
    enc = load_encoder(tok, bos="none")
    want = [x for x in enc.encode(docs) if len(x)]
    ds = indexed.IndexedDataset(str(prefix), mmap=True)
    assert len(ds) == len(want)
    assert ds.index.dtype == np.uint16  # Megatron's choice for a vocabulary below 65,500
    assert ds.document_indices.tolist() == list(range(len(want) + 1))
    for i, ids in enumerate(want):
        assert ds[i].tolist() == ids.tolist()
    # Byte for byte what megatron-core's own IndexedDatasetBuilder writes for these documents.
    theirs = tmp_path / "theirs"
    builder = indexed.IndexedDatasetBuilder(f"{theirs}.bin", dtype=np.uint16)
    for ids in want:
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{theirs}.idx")
    for ext in (".bin", ".idx"):
        assert Path(f"{prefix}{ext}").read_bytes() == Path(f"{theirs}{ext}").read_bytes(), ext
    # The dataset plans as the text does (the empty document aside).
    text_lengths = read_lengths(data, encoder=enc).lengths
    assert read_lengths(prefix).lengths.tolist() == text_lengths[text_lengths > 0].tolist()
    plan = tmp_path / "p.arrow"
    assert main([str(prefix), "--dp", "2", "--max-tokens-per-rank", "512",
                 "--global-batch-size", "8", "-o", str(plan), "--quiet"]) == 0
    assert main(["validate", str(plan), str(prefix)]) == 0


def test_outputs_are_refused_or_replaced_whole(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    tok = train_bpe(tmp_path / "tok").parent
    docs = texts(40, seed=2)
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet")
    enc = load_encoder(tok, append_eod=True)
    prefix = str(tmp_path / "d")
    r = tokenize_dataset([str(tmp_path / "c.parquet")], enc, prefix)
    assert r.num_documents == 40
    assert r.empty_documents == 0
    assert r.num_tokens == sum(len(x) for x in enc.encode(docs))
    before = Path(prefix + ".bin").read_bytes()
    # An existing dataset is replaced only with --overwrite; a user's other file never.
    argv = ["tokenize", str(tmp_path / "c.parquet"), "--tokenizer", str(tok), "-o", prefix]
    assert main(argv) == 2
    assert "d.bin: exists; refusing to replace it" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--quiet"]) == 0
    assert Path(prefix + ".bin").read_bytes() != before  # no EOD now: other tokens
    (tmp_path / "mine.bin").write_text("notes")
    assert main(["tokenize", str(tmp_path / "c.parquet"), "--tokenizer", str(tok), "-o",
                 str(tmp_path / "mine"), "--overwrite"]) == 2
    assert "is not the token file of a Megatron dataset" in capsys.readouterr().err
    assert (tmp_path / "mine.bin").read_text() == "notes"
    # A bad record after good ones: nothing is written, no temporary is left.
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "plan"}\n' * 50 + b'{"text": "\xff"}\n')
    assert main(["tokenize", str(bad), "--tokenizer", str(tok), "-o",
                 str(tmp_path / "b")]) == 2
    assert "bad.jsonl:51: not UTF-8 text" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".b", "b."))) == []
    r = tokenize_dataset([str(bad)], enc, str(tmp_path / "b"), skip_bad_records=True)
    assert (r.num_documents, r.skipped_bad_records) == (50, 1)
    # A token-id dataset is not text.
    assert main(["tokenize", prefix, "--tokenizer", str(tok), "-o", str(tmp_path / "x")]) == 2
    assert "holds token ids or lengths, not text" in capsys.readouterr().err
