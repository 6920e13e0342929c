"""Write data/sample.jsonl, the small bundled dataset of the Quickstart and the CPU tests.

About 2,000 records ``{"input_ids": [...]}`` with token ids below 32,000 and a long-tail length
mix: most are 16-1,500 tokens, a dozen are 3,000-15,000 and one is 30,000 (at 4,096 tokens per
rank it needs a CP group of 8). About 0.9M tokens in all. Token ids are drawn from a fixed set of
Zipf-weighted "phrases", so a tiny model has something to learn, and small ids keep the file
small. Deterministic: running it again rewrites the same bytes (numpy's PCG64, seeded).

    python data/make_sample.py [output]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

SEED = 20260101
NUM_RECORDS = 2000
VOCAB_SIZE = 32000
NUM_LONG = 12
LONGEST = 30000
NUM_PHRASES = 512


def sample_lengths(rng: np.random.Generator) -> NDArray[np.int64]:
    """Record lengths in file order: a log-normal body in 16-1,500, a long tail, one giant."""
    draws = rng.lognormal(mean=5.7, sigma=0.9, size=2 * NUM_RECORDS)
    # Keep in-range draws (rather than clip) so no pile of records sits at exactly 16 or 1,500.
    body = draws[(draws >= 16) & (draws <= 1500)][: NUM_RECORDS - NUM_LONG - 1]
    tail = rng.integers(3000, 15001, size=NUM_LONG)
    lengths = np.concatenate([body.astype(np.int64), tail, [LONGEST]])
    return rng.permutation(lengths)


def make_records(rng: np.random.Generator) -> list[list[int]]:
    """Token lists: each record concatenates Zipf-chosen phrases, cut to its length."""
    phrases = [np.minimum(rng.zipf(1.4, size=rng.integers(3, 13)), VOCAB_SIZE - 1)
               for _ in range(NUM_PHRASES)]
    weights = 1.0 / np.arange(1, NUM_PHRASES + 1)
    weights /= weights.sum()
    records = []
    for length in sample_lengths(rng).tolist():
        picks = rng.choice(NUM_PHRASES, size=length // 3 + 1, p=weights)
        tokens = np.concatenate([phrases[p] for p in picks])
        while len(tokens) < length:  # phrases average 7 tokens, so this rarely runs
            tokens = np.concatenate([tokens, tokens])
        records.append(tokens[:length].tolist())
    return records


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("sample.jsonl")
    rng = np.random.default_rng(SEED)
    with open(out, "w", encoding="ascii", newline="\n") as f:
        for tokens in make_records(rng):
            f.write(json.dumps({"input_ids": tokens}, separators=(",", ":")) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
