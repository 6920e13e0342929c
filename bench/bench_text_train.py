"""On-the-fly tokenization against pre-tokenized data: host time per training step and at open.

The README's example (``dcp-plan data/sample.jsonl --dp 2 --cp 2 --max-tokens-per-rank 2048
--global-batch-size 8 --long-sequences split``, 4 ranks) with a text corpus in place of its
token ids: one document per sample of ``data/sample.jsonl``, of about that sample's length in
tokens (pseudo-words drawn Zipf-like from a 20,000-word lexicon), tokenized by a byte-level BPE
of ``--vocab-size`` ids trained here on the corpus (nothing fetched). The corpus's counts plan
the ids twin (the same records as token ids, JSONL ``input_ids``: what the README trains on) and
the text plan is that plan with a text header (``tests.text.plans``), so both have the very same
steps. For every step and every pool rank it times what a rank's data path does per step:
``reader.step`` plus ``build_microbatch`` of each of its microbatches (the rows' tokens read,
positions, labels, loss mask), once from each source; and the one-off cost of opening each
source (the text source counts every record; the JSONL source builds its line index).

Usage:
    .venv/bin/python bench/bench_text_train.py [--steps 250] [--vocab-size 32000] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.cli import main as plan_main  # noqa: E402
from planner.sources.textenc import load_encoder  # noqa: E402
from runtime.data.batch import build_microbatch  # noqa: E402
from runtime.data.plan_reader import PlanReader  # noqa: E402
from runtime.data.plan_source import open_plan_source  # noqa: E402
from tests.text.plans import rewrite_as_text, write_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
README_PLAN = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "2048",
               "--global-batch-size", "8", "--long-sequences", "split"]


def corpus(lengths: np.ndarray, seed: int, words_per_token: float) -> list[str]:
    """One document per length, of about ``words_per_token * length`` pseudo-words."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    lexicon = ["".join(rng.choice(letters, size=int(k))) for k in rng.integers(2, 11, 20_000)]
    weights = 1.0 / np.arange(1, len(lexicon) + 1)
    weights /= weights.sum()
    return [" ".join(lexicon[j] for j in rng.choice(len(lexicon), size=max(1, int(
        n * words_per_token)), p=weights)) + "." for n in lengths]


def train_tokenizer(folder: Path, docs: list[str], vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder / "tokenizer.json"


def step_times(reader: PlanReader, data: Path, steps: int) -> tuple[float, np.ndarray]:
    """(seconds to open the source, the mean over ranks; seconds per (step, rank) of
    reader.step + every microbatch of that rank). Each rank opens its own source, as its
    process would (the text source's cache of recent records is per process)."""
    out = np.zeros((steps, reader.pool_size))
    opened = []
    for rank in range(reader.pool_size):
        for cache in data.parent.glob("*.dcpidx"):
            cache.unlink()  # the JSONL index built at open, as on a first run
        t0 = time.perf_counter()
        source = open_plan_source(reader, [str(data)])
        opened.append(time.perf_counter() - t0)
        for s in range(steps):
            t0 = time.perf_counter()
            step = reader.step(s)
            for m in range(step.num_microbatches):
                build_microbatch(step.group_for(m, rank), source, layout=reader.layout)
            out[s, rank] = time.perf_counter() - t0
    return float(np.mean(opened)), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250, help="steps timed (from step 0)")
    ap.add_argument("--vocab-size", type=int, default=32000, help="the BPE's vocabulary")
    ap.add_argument("--threads", type=int, default=0,
                    help="RAYON_NUM_THREADS of the tokenizer (0: its default, every core)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    lengths = np.array([len(json.loads(x)["input_ids"])
                        for x in (REPO / "data/sample.jsonl").read_text().splitlines()])
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        docs = corpus(lengths, args.seed, 1.0)
        tokenizer = train_tokenizer(tmp / "tok", docs, args.vocab_size)
        encoder = load_encoder(tokenizer, append_eod=True)
        ratio = float(lengths.sum() / encoder.count(docs).sum())
        docs = corpus(lengths, args.seed, ratio)  # about the sample's lengths in tokens
        ids = encoder.encode(docs)
        text = write_text(tmp / "corpus.jsonl", docs)
        ids_path = tmp / "ids.jsonl"
        ids_path.write_text("".join(json.dumps({"input_ids": t.tolist()}) + "\n" for t in ids))
        ids_plan = tmp / "ids.arrow"
        assert plan_main([str(ids_path), "-o", str(ids_plan), "--quiet", *README_PLAN]) == 0
        text_plan = rewrite_as_text(ids_plan, tmp / "text.arrow", text, encoder)
        num_tokens = int(sum(len(t) for t in ids))
        print(f"corpus: {len(docs)} documents, {num_tokens:,} tokens ({text.stat().st_size:,} "
              f"bytes of text, {ids_path.stat().st_size:,} of token-id JSONL), BPE of "
              f"{encoder.spec.vocab_size} ids; tokenizer threads "
              f"{os.environ.get('RAYON_NUM_THREADS', 'default')}, {os.cpu_count()} cores")
        rows = []
        for label, plan, data in (("token ids (JSONL)", ids_plan, ids_path),
                                  ("text (JSONL), tokenized", text_plan, text)):
            with PlanReader(plan) as reader:
                steps = min(args.steps, reader.num_steps)
                opened, t = step_times(reader, data, steps)
                rows.append((label, opened, t * 1e3))
        print(f"{steps} steps of the README plan (pool 4), ms per step per rank "
              "(reader.step + every microbatch of the rank):")
        print(f"{'source':<26} {'open s':>7} {'mean':>7} {'p50':>7} {'p90':>7} {'max':>7}")
        for label, opened, t in rows:
            print(f"{label:<26} {opened:>7.2f} {t.mean():>7.2f} {np.median(t):>7.2f} "
                  f"{np.percentile(t, 90):>7.2f} {t.max():>7.2f}")
        base = rows[0][2]
        extra = rows[1][2] - base
        print(f"overhead of tokenizing on the fly: mean {extra.mean():+.2f} ms per step per "
              f"rank (p90 {np.percentile(extra, 90):+.2f}, max {extra.max():+.2f}); open "
              f"{rows[1][1] - rows[0][1]:+.2f} s, {num_tokens / max(rows[1][1], 1e-9):,.0f} "
              "tokens/s counted")


if __name__ == "__main__":
    main()
