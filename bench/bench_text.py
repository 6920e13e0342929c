"""How fast a text corpus plans (``dcp-plan DATA --tokenizer``) and tokenizes (``dcp-plan
tokenize``): documents/s and tokens/s, and where the time goes.

The corpus is built from a folder of text files (default: the Python documentation's reST
sources, Debian's ``python3-doc``, ``/usr/share/doc/python3/html/_sources``): every file is cut
into paragraphs, grouped into documents of a long-tail size mix (log-normal, median about 1.5
KB, as web-corpus documents are), repeated ``--repeat`` times, and written as JSONL, JSONL.zst and
Parquet (a ``text`` column). Nothing is fetched: the tokenizer is a ``tokenizer.json`` given by
path (``--tokenizer``: for the numbers in BENCHMARKS.md, Llama 3's, 128,256 ids).

Timed, each once, page cache warm:

- ``parse``: the JSONL read alone (``planner.sources.text.iter_texts``: UTF-8 decode and
  ``json.loads`` per record), no tokenizer;
- ``encode``: the tokenizer alone on the parsed texts (``TextEncoder.count``);
- ``plan read``: ``read_lengths(..., encoder=...)`` without the cache, per format (what
  ``dcp-plan --tokenizer`` spends before planning);
- ``cached``: the same read with a warm lengths cache (the content hash and the cache read);
- ``tokenize``: ``tokenize_dataset`` to a Megatron dataset (encode, ids, write), per
  ``--workers`` value.

Usage:
    .venv/bin/python bench/bench_text.py --tokenizer PATH [--source DIR] [--repeat 2]
        [--workers 1,2] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_SOURCE = "/usr/share/doc/python3/html/_sources"
T = TypeVar("T")


def build_corpus(source: Path, repeat: int, seed: int = 0) -> list[str]:
    """Documents of paragraphs from every text file under ``source`` (sorted), ``repeat``
    times, each pass grouped with other sizes."""
    files = sorted(p for p in source.rglob("*.txt") if p.is_file())
    if not files:
        raise SystemExit(f"{source}: no .txt files (install python3-doc or give --source)")
    paras = [p.strip() for f in files for p in f.read_text(errors="replace").split("\n\n")
             if p.strip()]
    rng = np.random.default_rng(seed)
    docs: list[str] = []
    for _ in range(repeat):
        i = 0
        while i < len(paras):
            target = rng.lognormal(np.log(1500), 1.0)
            size, j = 0, i
            while j < len(paras) and size < target:
                size += len(paras[j])
                j += 1
            docs.append("\n\n".join(paras[i:j]))
            i = j
    return docs


def write_formats(docs: list[str], folder: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    jsonl = folder / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    zst = folder / "corpus.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor(level=3).compress(jsonl.read_bytes()))
    parquet = folder / "corpus.parquet"
    pq.write_table(pa.table({"text": docs}), parquet, row_group_size=8192)
    return {"jsonl": jsonl, "jsonl.zst": zst, "parquet": parquet}


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _tokenize_in_child(tokenizer: str, data: Path, prefix: Path, workers: int) -> float:
    """``tokenize_dataset`` in a fresh process (the tokenizer's thread count is fixed at its
    first use, so each ``--workers`` needs its own process)."""
    code = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
            "from planner.sources.textenc import load_encoder\n"
            "from planner.sources.pretokenize import tokenize_dataset\n"
            f"e = load_encoder({tokenizer!r}); t = time.perf_counter()\n"
            f"tokenize_dataset([{str(data)!r}], e, {str(prefix)!r}, overwrite=True)\n"
            "print(time.perf_counter() - t)\n")
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json or its folder")
    ap.add_argument("--source", default=DEFAULT_SOURCE, help="folder of .txt files")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workers", default="1,2", help="tokenizer threads to time tokenize with")
    ap.add_argument("--out", default="", help="folder for the corpus (default: a temporary)")
    args = ap.parse_args()

    from planner.sources.formats import BadRecords
    from planner.sources.lengths import read_lengths
    from planner.sources.text import iter_texts, text_pieces
    from planner.sources.textenc import load_encoder

    folder = Path(args.out or tempfile.mkdtemp(prefix="bench-text-"))
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["XDG_CACHE_HOME"] = str(folder / "xdg")
    docs = build_corpus(Path(args.source), args.repeat)
    files = write_formats(docs, folder)
    enc = load_encoder(args.tokenizer)
    mb = files["jsonl"].stat().st_size / 1e6
    print(f"corpus: {len(docs):,} documents, {mb:.1f} MB of JSONL ({args.source}, x{args.repeat})"
          f"; tokenizer {enc.spec.path} (vocabulary {enc.spec.vocab_size:,}, sha256 "
          f"{enc.spec.sha256[:12]}); {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    rows: list[tuple[str, float, int, int]] = []
    parse_s, texts = timed(lambda: [t for b in iter_texts(str(files["jsonl"]), "jsonl", "text",
                                                          BadRecords(skip=False))
                                    for t in b.texts])
    n_docs = len(texts)
    # In the readers' pieces (BATCH_CHARS each), as count_lengths calls it.
    encode_s, counts = timed(lambda: [enc.count(texts[a:b]) for a, b in text_pieces(texts)])
    n_tok = sum(int(c.sum()) for c in counts)
    rows += [("parse JSONL only", parse_s, n_docs, 0), ("tokenizer only", encode_s, n_docs, n_tok)]
    for name, path in files.items():
        s, table = timed(functools.partial(read_lengths, path, encoder=enc, use_cache=False))
        assert int(table.lengths.sum()) == n_tok, name
        rows.append((f"plan read, {name}", s, n_docs, n_tok))
    read_lengths(files["jsonl"], encoder=enc)  # writes the cache
    s, table = timed(lambda: read_lengths(files["jsonl"], encoder=enc))
    assert table.cached_files == 1
    rows.append(("plan read, jsonl, cached", s, n_docs, n_tok))
    for w in [int(x) for x in args.workers.split(",") if x]:
        s = _tokenize_in_child(args.tokenizer, files["jsonl"], folder / "mg", w)
        rows.append((f"tokenize, jsonl, {w} thread{'s' if w > 1 else ''}", s, n_docs, n_tok))
    print("| what | s | documents/s | tokens/s | MB/s of JSONL |")
    print("|---|---|---|---|---|")
    for what, s, d, t in rows:
        print(f"| {what} | {s:.2f} | {d / s:,.0f} | {t / s:,.0f} | {mb / s:.1f} |"
              if t else f"| {what} | {s:.2f} | {d / s:,.0f} | - | {mb / s:.1f} |")
    print(f"tokens: {n_tok:,} ({n_tok / len(docs):.0f} per document); load after "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
