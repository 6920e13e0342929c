"""Write data/text/: a small text corpus and the tokenizer it is planned with (README's text
example, the text tests' fixture for a user's view).

- ``data/text/sample.jsonl``: 400 records ``{"id": i, "text": "..."}`` as Hugging Face datasets
  hold text, a long-tail length mix (most 5-400 words, a few 2,000-6,000; three empty texts).
- ``data/text/tokenizer.json`` (+ ``tokenizer_config.json`` naming ``<s>`` / ``</s>``): a byte-level
  BPE of 512 ids trained on those texts with the ``tokenizers`` library, a stand-in for a
  model's tokenizer.json (nothing is fetched from a hub).

Deterministic (numpy's PCG64, seeded; BPE training is deterministic for the same texts).

    python data/make_text_sample.py [folder]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

SEED = 20261203
NUM_RECORDS = 400
SYLLABLES = ("ka", "to", "ri", "mu", "se", "lo", "na", "pe", "vi", "du", "ra", "shi", "en",
             "or", "al", "qu")


def texts(rng: np.random.Generator) -> list[str]:
    words = ["".join(rng.choice(SYLLABLES, size=int(rng.integers(1, 4)))) for _ in range(300)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    out = []
    for i in range(NUM_RECORDS):
        n = 0 if i % 150 == 7 else int(np.clip(rng.lognormal(4.0, 1.0), 5, 400))
        if i % 97 == 3:
            n = int(rng.integers(2000, 6000))
        picked = rng.choice(len(words), size=n, p=weights)
        sentence = " ".join(words[j] for j in picked)
        out.append(sentence.capitalize() + ("." if n else ""))
    return out


def main(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = texts(np.random.Generator(np.random.PCG64(SEED)))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sample.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(docs):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "text")
