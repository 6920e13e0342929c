"""A small BPE tokenizer the tests train themselves (nothing is fetched from a hub), and texts."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ("plan", "step", "rank", "ring", "group", "token", "sequence", "context", "parallel",
         "attention", "microbatch", "gradient", "megatron", "titan", "offline", "replay")


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic documents of 0-60 words (the first one empty)."""
    out, x = [], seed * 2654435761 + 1
    for i in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        k = 0 if i == 0 else 1 + (x >> 33) % 60
        words = [WORDS[(x >> (j % 40)) % len(WORDS)] for j in range(k)]
        out.append(" ".join(words) + ("." if k else ""))
    return out


def train_bpe(folder: Path, *, vocab_size: int = 300, config: bool = True) -> Path:
    """A byte-level BPE ``tokenizer.json`` (with ``<s>``, ``</s>`` and a GPT-2-like post-processor
    adding nothing) in ``folder``, and a ``tokenizer_config.json`` naming them when ``config``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(200, seed=1), trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return folder / "tokenizer.json"
