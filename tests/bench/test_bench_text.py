"""``bench/bench_text.py`` runs end to end on a tiny corpus with the tests' own BPE.

A smoke test, not a measurement: a folder of a few text files, one repeat, one thread. It checks
that the script still runs against the current API (``iter_texts``, ``read_lengths(encoder=)``,
the lengths cache, ``tokenize_dataset``) and that every row of its table is printed (the script
asserts that every format gives the same token count).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.helpers import run_bench
from tests.text.bpe import texts, train_bpe

pytest.importorskip("tokenizers")


def test_bench_text_runs_and_prints_every_row(tmp_path: Path) -> None:
    tok = train_bpe(tmp_path / "tok").parent
    source = tmp_path / "src"
    source.mkdir()
    for i in range(3):
        (source / f"doc{i}.txt").write_text("\n\n".join(texts(40, seed=i)[1:]))
    out = run_bench("bench_text.py", "--tokenizer", str(tok), "--source", str(source),
                    "--repeat", "1", "--workers", "1", "--out", str(tmp_path / "work"))
    for row in ("parse JSONL only", "tokenizer only", "plan read, jsonl ", "plan read, "
                "jsonl.zst", "plan read, parquet", "plan read, jsonl, cached",
                "tokenize, jsonl, 1 thread"):
        assert f"| {row}" in out, row
