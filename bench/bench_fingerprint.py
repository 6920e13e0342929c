"""What ``dcp-plan --fingerprint content`` costs: hashing every token, at plan time and at start.

For each format, a synthetic dataset of about ``--tokens`` tokens (lengths from a long-tail
mix, token ids below 128K, so Megatron stores int32) is written once; then timed, each once:

- ``plan``: ``planner.sources.content.file_content_fingerprint`` (what ``dcp-plan`` adds);
- ``runtime``: the runtime's check (``runtime.data.plan_source``: every block read through the
  runtime's own token source and hashed) in one process; with W ranks each does about 1/W.

Reported: file size, tokens, seconds, seconds per GB of file and per billion tokens. Also the
bundled sample through the CLI: ``dcp-plan data/sample.jsonl ...`` with and without the flag.

Usage:
    .venv/bin/python bench/bench_fingerprint.py [--tokens 50000000] [--jsonl-tokens 5000000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from planner.sources.content import block_starts, file_content_fingerprint
from planner.sources.lengths import read_lengths, write_megatron_dataset
from runtime.data.plan_source import _block
from runtime.data.tokens import open_token_source

ROOT = Path(__file__).resolve().parents[1]


def _seqs(tokens: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        n = int(min(rng.lognormal(6.5, 1.0), 32768)) + 1
        out.append(rng.integers(0, 128_000, size=n, dtype=np.int32))
        total += n
    return out


def _write(fmt: str, d: Path, seqs: list[np.ndarray]) -> Path:
    if fmt == "megatron":
        write_megatron_dataset(d / "m", seqs, dtype=np.int32)
        return d / "m"
    if fmt == "jsonl":
        path = d / "d.jsonl"
        with open(path, "w") as f:
            for s in seqs:
                f.write(json.dumps({"input_ids": s.tolist()}) + "\n")
        return path
    table = pa.table({"input_ids": pa.array(seqs, type=pa.list_(pa.int32()))})
    if fmt == "parquet":
        pq.write_table(table, path := d / "d.parquet", row_group_size=4096)
        return path
    with pa.OSFile(str(path := d / "d.arrow"), "wb") as sink, ipc.new_file(sink,
                                                                            table.schema) as w:
        w.write_table(table, max_chunksize=4096)
    return path


def _size(path: Path) -> int:
    files = [Path(str(path) + ".bin"), Path(str(path) + ".idx")] if not path.exists() else [path]
    return sum(f.stat().st_size for f in files)


def _runtime(path: Path, lengths: np.ndarray) -> float:
    source = open_token_source(path)
    t0 = time.perf_counter()
    starts = block_starts(lengths)
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        _block(source, lengths, a, b)
    return time.perf_counter() - t0


def _sample_cli() -> tuple[float, float]:
    def run(*extra: str) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run(
                [sys.executable, "-m", "planner.cli", str(ROOT / "data" / "sample.jsonl"),
                 "--dp", "4", "--cp", "2", "--max-tokens-per-rank", "4096",
                 "--global-batch-size", "64", "-o", f"{tmp}/p.arrow", "--json", *extra],
                capture_output=True, text=True, check=True, cwd=ROOT).stdout
        seconds = json.loads(out)["seconds"]
        return float(seconds.get("fingerprint", 0.0)), float(seconds["total"])

    run()  # numba compile cache warm
    plain = run()[1]
    fp, total = run("--fingerprint", "content")
    return fp, total - plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--jsonl-tokens", type=int, default=5_000_000)
    ap.add_argument("--formats", nargs="+", default=["megatron", "arrow", "parquet", "jsonl"])
    args = ap.parse_args()
    print(f"{'format':>9} {'file MB':>8} {'Mtokens':>8} {'plan s':>7} {'plan s/GB':>9} "
          f"{'plan s/Gtok':>11} {'run s':>6} {'run s/GB':>8} {'run s/Gtok':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            seqs = _seqs(args.jsonl_tokens if fmt == "jsonl" else args.tokens)
            d = Path(tmp) / fmt
            d.mkdir()
            path = _write(fmt, d, seqs)
            lengths = np.asarray(read_lengths(path).lengths)
            source = str(path)
            t0 = time.perf_counter()
            file_content_fingerprint(source, fmt, lengths)
            plan_s = time.perf_counter() - t0
            run_s = _runtime(path, lengths)
            gb, gtok = _size(path) / 1e9, lengths.sum() / 1e9
            print(f"{fmt:>9} {gb * 1e3:>8.0f} {gtok * 1e3:>8.1f} {plan_s:>7.2f} "
                  f"{plan_s / gb:>9.1f} {plan_s / gtok:>11.1f} {run_s:>6.2f} "
                  f"{run_s / gb:>8.1f} {run_s / gtok:>10.1f}", flush=True)
    fp, extra = _sample_cli()
    mb = (ROOT / "data" / "sample.jsonl").stat().st_size / 1e6
    print(f"data/sample.jsonl (2,000 samples, 886,536 tokens, {mb:.1f} MB): fingerprint "
          f"{fp:.3f} s, dcp-plan time +{extra:.3f} s")


if __name__ == "__main__":
    main()
