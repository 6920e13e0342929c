"""Planning a text corpus (``dcp-plan DATA --tokenizer``): every input the issue lists, the
header's record of the tokenizer, the lengths cache, and clear errors."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from planner.cli import main
from planner.planfile.io import PlanFile
from planner.sources.lengths import read_lengths
from planner.sources.textenc import TextEncoder, load_encoder
from tests.text.bpe import texts, train_bpe

pytest.importorskip("tokenizers")

PLAN = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "512", "--global-batch-size", "16"]


@pytest.fixture(autouse=True)
def _user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback lengths cache goes under the test's folder, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return train_bpe(tmp_path / "tok").parent


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(docs)))
    return path


def _want(enc: TextEncoder, docs: list[str]) -> list[int]:
    return [len(x) for x in enc.encode(docs)]


def test_jsonl_counts_are_the_encoders_and_the_plan_records_the_tokenizer(
        tmp_path: Path, tok: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = texts(300)
    data = _jsonl(tmp_path / "c.jsonl", docs)
    enc = load_encoder(tok, append_eod=True)
    table = read_lengths(data, encoder=enc)
    assert table.lengths.tolist() == _want(enc, docs)
    assert table.lengths[0] == 1  # the empty first text: its EOD alone
    assert table.field == "text"
    assert table.tokenizer == enc.spec.to_dict()
    out = tmp_path / "p.arrow"
    assert main([str(data), "--tokenizer", str(tok), "--append-eod", *PLAN, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokenizer " in text
    assert "EOD 1 appended" in text
    with PlanFile(out) as f:
        d = f.header.dataset
    assert d.tokenizer == enc.spec.to_dict()
    assert d.field == "text"
    assert d.tokenizer["sha256"] == enc.spec.sha256
    assert d.tokenizer["vocab_size"] == 300
    assert main(["show", str(out), "--steps", "0:1"]) == 0
    shown = capsys.readouterr().out
    assert f"tokenizer: {enc.spec.policy_text()}; field 'text'" in shown
    assert main(["validate", str(out), str(data)]) == 0
    assert "dataset coverage" in capsys.readouterr().out
    # A tokenizer moved since planning: named, and found again with --tokenizer.
    moved = tmp_path / "moved"
    tok.rename(moved)
    assert main(["validate", str(out), str(data)]) == 2
    assert "give its new place with --tokenizer PATH" in capsys.readouterr().err
    assert main(["validate", str(out), str(data), "--tokenizer", str(moved)]) == 0
    capsys.readouterr()
    # Another tokenizer than the plan's is refused by validate, naming the difference.
    other = train_bpe(tmp_path / "other", vocab_size=280).parent
    assert main(["validate", str(out), str(data), "--tokenizer", str(other)]) == 2
    assert "another tokenizer" in capsys.readouterr().err


def test_compressed_parquet_and_arrow_give_the_same_counts(tmp_path: Path, tok: Path) -> None:
    import zstandard

    docs = texts(200, seed=3)
    enc = load_encoder(tok, bos="add")
    want = _want(enc, docs)
    plain = _jsonl(tmp_path / "c.jsonl", docs)
    zst = tmp_path / "c.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=64)
    pq.write_table(table.cast(pa.schema([("id", pa.int64()), ("text", pa.large_string())])),
                   tmp_path / "large.parquet")
    with pa.OSFile(str(tmp_path / "c.arrow"), "wb") as sink, pa.ipc.new_file(
            sink, table.schema) as w:
        w.write_table(table)
    for name in ("c.jsonl.zst", "c.jsonl.gz", "c.parquet", "large.parquet", "c.arrow"):
        got = read_lengths(tmp_path / name, encoder=enc)
        assert got.lengths.tolist() == want, name
    # Several files are one dataset, numbered through them in order.
    both = read_lengths([str(zst), str(tmp_path / "c.parquet")], encoder=enc)
    assert both.lengths.tolist() == want + want
    assert both.format == "mixed"


def test_empty_texts_keep_their_samples_and_are_not_planned(
        tmp_path: Path, tok: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = ["", "plan step rank", "", "ring group token sequence", ""] * 8
    data = _jsonl(tmp_path / "e.jsonl", docs)
    enc = load_encoder(tok, bos="none")
    lengths = read_lengths(data, encoder=enc).lengths
    assert lengths.tolist() == _want(enc, docs)
    assert lengths[0] == 0
    assert lengths[1] > 0
    out = tmp_path / "e.arrow"
    assert main([str(data), "--tokenizer", str(tok), "--bos", "none", "--dp", "1",
                 "--max-tokens-per-rank", "64", "--global-batch-size", "4", "-o",
                 str(out)]) == 0
    assert "24 documents have no tokens (empty texts)" in capsys.readouterr().err
    with PlanFile(out) as f:
        planned = set(f.table().column("sample_index").to_pylist()) - {-1}
    assert planned == set(np.flatnonzero(lengths > 0).tolist())


def test_bad_records_name_the_file_and_line(tmp_path: Path, tok: Path) -> None:
    enc = load_encoder(tok)
    data = tmp_path / "bad.jsonl"
    good = json.dumps({"text": "plan step"}).encode()
    data.write_bytes(good + b"\n\n" + b'{"text": "caf\xe9 ring"}\n' + good + b"\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not UTF-8 text \(byte 0xe9 at byte 14 "
                       "of the line\\)"):
        read_lengths(data, encoder=enc)
    skipped = read_lengths(data, encoder=enc, skip_bad_records=True)
    assert skipped.skipped.tolist() == [1]
    assert skipped.lengths[1] == 0
    assert skipped.lengths[0] == skipped.lengths[2] > 0
    cases = {b'{"txt": "a"}': r"c.jsonl:1: no 'text' field \(or it is null\); its string fields "
             "are 'txt': name one with --field",
             b'{"text": [1, 2]}': "c.jsonl:1: 'text' holds token ids, not text",
             b'{"text": 5}': "c.jsonl:1: 'text' is int, not a string of text",
             b"[1]": "c.jsonl:1: not a JSON object",
             b'{"text": "a"': r"c.jsonl:1: not JSON",
             b'{"text": "\\ud800 x"}': "c.jsonl:1: the text holds an unpaired surrogate"}
    for line, message in cases.items():
        (tmp_path / "c.jsonl").write_bytes(line + b"\n")
        with pytest.raises(ValueError, match=message):
            read_lengths(tmp_path / "c.jsonl", encoder=enc, use_cache=False)
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n.parquet: row 1: 'text' is null"):
        read_lengths(tmp_path / "n.parquet", encoder=enc)
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' .* its string columns are \['body'\]"):
        read_lengths(tmp_path / "b.parquet", encoder=enc)
    assert read_lengths(tmp_path / "b.parquet", encoder=enc, field="body").field == "body"
    with pytest.raises(ValueError, match="column 'n' has type int64, not a string column"):
        read_lengths(tmp_path / "b.parquet", encoder=enc, field="n")
    (tmp_path / "l.txt").write_text("3\n4\n")
    with pytest.raises(ValueError, match="holds token ids or lengths, not text"):
        read_lengths(tmp_path / "l.txt", encoder=enc)


def test_command_line_errors_are_one_line(tmp_path: Path, tok: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "c.jsonl", texts(20))
    (tmp_path / "notatok.json").write_text('{"version": "1.0", "model": 3}')
    assert main([str(data), "--tokenizer", str(tmp_path / "notatok.json"), *PLAN]) == 2
    err = capsys.readouterr().err
    assert "notatok.json: not a Hugging Face tokenizer.json" in err
    assert "Traceback" not in err
    assert main([str(data), "--tokenizer", str(tmp_path), *PLAN]) == 2
    assert "the folder holds no tokenizer.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(data), "--append-eod", *PLAN])
    assert "give --tokenizer PATH too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(data), "--tokenizer", str(tok), "--bos-token", "<s>", *PLAN])
    assert "give --bos add with it" in capsys.readouterr().err
    assert main([str(data), "--tokenizer", str(tok), "--bos", "add", "--bos-token", "<x>",
                 *PLAN]) == 2
    assert "'<x>' (--bos add) is not in its vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(data), "--tokenizer", str(tok), "--fingerprint", "content", *PLAN])
    assert "dcp-plan tokenize" in capsys.readouterr().err
    # Without --tokenizer a text corpus is refused as before, with the way to plan it.
    assert main([str(data), *PLAN]) == 2
    err = capsys.readouterr().err
    assert "the record holds text ('text'), not token ids: plan it with --tokenizer PATH" in err


def test_the_lengths_cache_is_keyed_by_content(tmp_path: Path, tok: Path) -> None:
    docs = texts(100, seed=5)
    data = _jsonl(tmp_path / "c.jsonl", docs)
    enc = load_encoder(tok)
    first = read_lengths(data, encoder=enc)
    assert first.cached_files == 0
    caches = sorted(tmp_path.glob("c.jsonl.*.dcplen"))
    assert len(caches) == 1
    again = read_lengths(data, encoder=enc)
    assert again.cached_files == 1
    assert again.lengths.tolist() == first.lengths.tolist()
    # Another policy is another cache, beside the first.
    eod = load_encoder(tok, append_eod=True)
    assert read_lengths(data, encoder=eod).cached_files == 0
    assert len(list(tmp_path.glob("c.jsonl.*.dcplen"))) == 2
    assert read_lengths(data, encoder=eod).cached_files == 1
    # An edit that keeps the size and the mtime is still seen: the key is the content.
    st = os.stat(data)
    raw = data.read_bytes()
    at = raw.index(b"plan")
    data.write_bytes(raw[:at] + b"ring" + raw[at + 4:])
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = read_lengths(data, encoder=enc)
    assert edited.cached_files == 0
    assert edited.lengths.tolist() == _want(enc, [json.loads(x)["text"]
                                                  for x in data.read_text().splitlines()])
    # A damaged cache is rebuilt, never read; the cache is not a dataset file of the folder.
    caches[0].write_bytes(caches[0].read_bytes()[:-8])
    assert read_lengths(data, encoder=enc).cached_files == 0
    assert read_lengths(tmp_path, encoder=enc).num_samples == len(docs)
    # Where the cache cannot be written beside the file (here a folder holds its name, as a
    # read-only folder would refuse it), it goes to the user's cache folder.
    beside = caches[0]  # enc's (the other is eod's)
    beside.unlink()
    beside.mkdir()
    assert read_lengths(data, encoder=enc).cached_files == 0
    assert read_lengths(data, encoder=enc).cached_files == 1
    assert len(list((tmp_path / "xdg" / "dcp-planner" / "lengths").glob("*.dcplen"))) == 1


def test_compare_takes_a_text_corpus(tmp_path: Path, tok: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "c.jsonl", texts(60))
    assert main(["compare", str(data), "--tokenizer", str(tok), "--append-eod", "--pools", "2,4",
                 "--max-tokens-per-rank", "512", "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    total = int(load_encoder(tok, append_eod=True).count(texts(60)).sum())
    assert f"{data}: 60 samples, {total:,} tokens" in out


def test_a_hugging_face_dataset_as_saved_or_exported_plans(tmp_path: Path, tok: Path) -> None:
    datasets = pytest.importorskip("datasets")
    docs = texts(120, seed=9)
    ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs})
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    enc = load_encoder(tok, append_eod=True)
    want = _want(enc, docs)
    notices: list[str] = []  # its metadata files are not data, and not worth a notice
    got = read_lengths(tmp_path / "saved", encoder=enc, notice=notices.append)
    assert notices == []
    assert got.lengths.tolist() == want
    assert [Path(f.path).suffix for f in got.files] == [".arrow"]
    assert read_lengths(tmp_path / "dict" / "train", encoder=enc).lengths.tolist() == want
    assert read_lengths(tmp_path / "train.parquet", encoder=enc).lengths.tolist() == want
    with pytest.raises(ValueError, match="a Hugging Face DatasetDict .* give one split's folder"):
        read_lengths(tmp_path / "dict", encoder=enc)


def test_a_tokenizer_files_padding_and_truncation_are_not_inherited(tmp_path: Path,
                                                                     tok: Path) -> None:
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok / "tokenizer.json"))
    t.enable_padding(pad_id=0, pad_token="<s>")
    t.enable_truncation(max_length=8)
    padded = tmp_path / "padded"
    padded.mkdir()
    t.save(str(padded / "tokenizer.json"))
    docs = texts(50)
    data = _jsonl(tmp_path / "c.jsonl", docs)
    want = read_lengths(data, encoder=load_encoder(tok), use_cache=False).lengths.tolist()
    assert max(want) > 8  # truncation would have cut these, padding lengthened the short ones
    assert read_lengths(data, encoder=load_encoder(padded)).lengths.tolist() == want
