"""planner.sources.textenc: policies, identity by content, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.sources.textenc import TokenizerSpec, load_encoder
from tests.text.bpe import texts, train_bpe

pytest.importorskip("tokenizers")


def test_policies_add_exactly_their_tokens(tmp_path: Path) -> None:
    f = train_bpe(tmp_path / "tok")
    docs = texts(20)
    plain = load_encoder(f.parent, bos="none")
    ids = plain.encode(docs)
    assert len(ids[0]) == 0
    assert all(len(x) > 0 for x in ids[1:])
    both = load_encoder(f, bos="add", append_eod=True)
    s, e = both.spec.bos_id, both.spec.eod_id
    assert (s, e) == (0, 1)  # the trainer's special tokens, named by tokenizer_config.json
    for a, b in zip(ids, both.encode(docs), strict=True):
        assert b.tolist() == [s, *a.tolist(), e]
    assert both.count(docs).tolist() == [len(x) for x in both.encode(docs)]
    # This tokenizer's post-processor adds nothing: "tokenizer" equals "none" here.
    assert [x.tolist() for x in load_encoder(f).encode(docs)] == [x.tolist() for x in ids]
    assert both.spec.vocab_size == 300
    assert "BOS 0 prepended, EOD 1 appended" in both.spec.policy_text()


def test_the_same_bytes_are_the_same_tokenizer(tmp_path: Path) -> None:
    a = load_encoder(train_bpe(tmp_path / "a")).spec
    copy = tmp_path / "b" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_bytes(Path(a.path).read_bytes())
    b = load_encoder(copy).spec
    assert a.mismatch(b) is None
    assert a.path != b.path
    c = load_encoder(train_bpe(tmp_path / "c", vocab_size=280)).spec
    assert "sha256" in str(a.mismatch(c))
    d = load_encoder(copy, append_eod=True, eod_token="</s>").spec
    assert a.mismatch(d) == "append_eod True where the plan has False"
    assert TokenizerSpec.from_dict(d.to_dict()) == d


def test_bad_tokenizers_are_named(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"x.json: not a Hugging Face tokenizer.json"):
        load_encoder(tmp_path / "x.json")
    with pytest.raises(ValueError, match="the folder holds no tokenizer.json"):
        load_encoder(tmp_path)
    with pytest.raises(ValueError, match="no such file or folder"):
        load_encoder(tmp_path / "missing")
    f = train_bpe(tmp_path / "noconf", config=False)
    with pytest.raises(ValueError, match="--append-eod needs a token and neither --eod-token nor"):
        load_encoder(f, append_eod=True)
    assert load_encoder(f, append_eod=True, eod_token="</s>").spec.eod_id == 1
    with pytest.raises(ValueError, match="'<eos>' .--append-eod. is not in its vocabulary"):
        load_encoder(f, append_eod=True, eod_token="<eos>")
    with pytest.raises(ValueError, match="bos policy 'first'"):
        load_encoder(f, bos="first")
