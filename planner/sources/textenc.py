"""Text -> token ids through a Hugging Face ``tokenizer.json``: the one ``tokenizers`` import.

Planning a text corpus needs each document's token count, and training needs the same tokens:
both go through ``TextEncoder``, built from a ``TokenizerSpec`` that the plan header records
(``dataset.tokenizer``), so the runtime can refuse a tokenizer other than the planner's.

A document's tokens are ``[BOS] + tokenizer(text) + [EOD]`` where:

- ``bos`` is the BOS policy: ``"tokenizer"`` keeps what the tokenizer file's post-processor adds
  (a Llama 3 ``tokenizer.json`` adds ``<|begin_of_text|>``; GPT-2's adds nothing), as
  Megatron-LM's ``HuggingFaceTokenizer`` and torchtitan's loader tokenize; ``"add"`` encodes without
  special tokens and prepends the BOS token (``bos_token``, else ``tokenizer_config.json``'s);
  ``"none"`` encodes without special tokens.
- ``append_eod`` (Megatron-LM's ``--append-eod``) appends the end-of-document token
  (``eod_token``, else ``tokenizer_config.json``'s ``eos_token``).

The tokenizer is identified by the sha256 of its ``tokenizer.json`` bytes, not by its path: the
same file under another path is the same tokenizer; an edited file is not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["BOS_POLICIES", "TextEncoder", "TokenizerSpec", "load_encoder", "plan_encoder",
           "tokenizer_file"]

BOS_POLICIES = ("tokenizer", "add", "none")
"""``--bos``: keep the tokenizer file's special tokens, prepend the BOS token, or neither."""
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerSpec:
    """What a plan records of the tokenizer its lengths were counted with."""

    path: str
    """The ``tokenizer.json`` as given (a hint for the runtime; the sha256 identifies it)."""
    sha256: str
    """sha256 of the ``tokenizer.json`` bytes."""
    vocab_size: int
    """Ids run 0..vocab_size-1 (added tokens included)."""
    bos: str = "tokenizer"
    """One of ``BOS_POLICIES``."""
    append_eod: bool = False
    """An end-of-document token after each document (Megatron-LM's ``--append-eod``)."""
    bos_id: int | None = None
    """The id prepended under ``bos="add"``; None otherwise."""
    eod_id: int | None = None
    """The id appended under ``append_eod``; None otherwise."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenizerSpec:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def policy_text(self) -> str:
        """One line for summaries and ``dcp-plan show``."""
        eod = f"EOD {self.eod_id} appended" if self.append_eod else "no EOD"
        bos = {"tokenizer": "BOS as the tokenizer adds it", "none": "no BOS",
               "add": f"BOS {self.bos_id} prepended"}[self.bos]
        return (f"{self.path} (sha256 {self.sha256[:12]}, vocabulary {self.vocab_size:,}; "
                f"{bos}, {eod})")

    def mismatch(self, other: TokenizerSpec) -> str | None:
        """Why ``other`` would not give this spec's tokens (None: it would)."""
        for name in ("sha256", "bos", "append_eod", "bos_id", "eod_id"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{name} {b!r} where the plan has {a!r}"
        return None


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` that ``path`` names: the file, or one directly inside a folder.

    Raises:
        ValueError: nothing there, or a folder without a ``tokenizer.json``.
    """
    p = Path(path)
    if p.is_dir():
        if not (p / TOKENIZER_FILE).is_file():
            raise ValueError(f"tokenizer {path}: the folder holds no {TOKENIZER_FILE} (a Hugging "
                             "Face tokenizer file, as model folders and torchtitan's assets have)")
        return p / TOKENIZER_FILE
    if not p.is_file():
        raise ValueError(f"tokenizer {path}: no such file or folder")
    return p


def _config_token(folder: Path, key: str) -> str | None:
    """``tokenizer_config.json``'s token for ``key`` (a string or ``{"content": ...}``)."""
    f = folder / CONFIG_FILE
    if not f.is_file():
        return None
    try:
        value = json.loads(f.read_text(encoding="utf-8")).get(key)
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{f}: not a tokenizer config ({e})") from None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextEncoder:
    """A loaded tokenizer with its policies: documents -> token ids, in batches on every core."""

    def __init__(self, spec: TokenizerSpec, tokenizer: Any) -> None:
        self.spec = spec
        self._tok = tokenizer
        self._special = spec.bos == "tokenizer"

    def encode(self, texts: Sequence[str]) -> list[NDArray[np.int64]]:
        """Each document's token ids (``tokenizers`` spreads a batch over its threads)."""
        out = []
        head = [self.spec.bos_id] if self.spec.bos == "add" else []
        tail = [self.spec.eod_id] if self.spec.append_eod else []
        for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=self._special):
            out.append(np.array(head + e.ids + tail, dtype=np.int64))
        return out

    def count(self, texts: Sequence[str]) -> NDArray[np.int64]:
        """Each document's token count (what ``encode`` would return the length of)."""
        extra = (self.spec.bos == "add") + self.spec.append_eod
        enc = self._tok.encode_batch_fast(list(texts), add_special_tokens=self._special)
        # len(e), not len(e.ids): the count without building a list of ids (3% of the time).
        return np.fromiter((len(e) + extra for e in enc), dtype=np.int64, count=len(enc))


def load_encoder(path: str | Path, *, bos: str = "tokenizer", append_eod: bool = False,
                 bos_token: str | None = None, eod_token: str | None = None) -> TextEncoder:
    """The tokenizer at ``path`` (``tokenizer_file``) with the given policies.

    Raises:
        ValueError: not a tokenizer file, an unknown policy, or a BOS / EOD token the policy needs
            that neither the argument nor ``tokenizer_config.json`` names (or the vocabulary lacks).
    """
    if bos not in BOS_POLICIES:
        raise ValueError(f"bos policy {bos!r}: expected one of {', '.join(BOS_POLICIES)}")
    from tokenizers import Tokenizer

    f = tokenizer_file(path)
    data = f.read_bytes()
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own Exception type for any bad file
        raise ValueError(f"tokenizer {f}: not a Hugging Face tokenizer.json "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    # A document's tokens are all of its tokens, alone: a tokenizer.json may carry padding
    # (a batch padded to its longest: counts that depend on the batch) or truncation (a
    # BERT-style max_length: documents cut short), which plans and training must not inherit.
    tok.no_padding()
    tok.no_truncation()

    def token_id(given: str | None, key: str, flag: str, token_flag: str) -> int:
        name = given if given is not None else _config_token(f.parent, key)
        if name is None:
            raise ValueError(f"tokenizer {f}: {flag} needs a token and neither {token_flag} nor "
                             f"{f.parent / CONFIG_FILE} ({key}) names one")
        i = tok.token_to_id(name)
        if i is None:
            raise ValueError(f"tokenizer {f}: {name!r} ({flag}) is not in its vocabulary")
        return int(i)

    spec = TokenizerSpec(
        path=str(f), sha256=hashlib.sha256(data).hexdigest(),
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)), bos=bos,
        append_eod=append_eod,
        bos_id=(token_id(bos_token, "bos_token", "--bos add", "--bos-token")
                if bos == "add" else None),
        eod_id=(token_id(eod_token, "eos_token", "--append-eod", "--eod-token")
                if append_eod else None))
    return TextEncoder(spec, tok)


def plan_encoder(tokenizer: Mapping[str, Any], path: str | Path | None = None, *,
                 source: str = "the plan") -> TextEncoder:
    """The encoder a text plan was made with (its header's ``dataset.tokenizer``), loaded from
    its recorded path or ``path`` (the tokenizer moved: ``--tokenizer PATH``), refused unless its
    bytes are the plan's (sha256). What ``dcp-plan validate`` counts and training tokenizes with.

    The policies and the BOS / EOD ids are the plan's, not looked up again: a
    ``tokenizer_config.json`` edited since cannot change what is prepended or appended.

    Raises:
        ValueError: naming ``source``: the tokenizer is missing (where to give it), not one, or
            another one (both files and sha256s).
    """
    spec = TokenizerSpec.from_dict(dict(tokenizer))
    try:
        f = tokenizer_file(spec.path if path is None else path)
        loaded = load_encoder(f)
    except ValueError as e:
        hint = "" if path is not None else " (give its new place with --tokenizer PATH)"
        raise ValueError(f"{source} was planned with tokenizer {spec.path}: {e}{hint}") from None
    got = loaded.spec
    if got.sha256 != spec.sha256:
        raise ValueError(f"{source} was planned with tokenizer {spec.path} (sha256 "
                         f"{spec.sha256[:12]}); {f} is another tokenizer (sha256 "
                         f"{got.sha256[:12]}), which gives other tokens: give the plan's "
                         "tokenizer.json with --tokenizer PATH")
    for name, i in (("bos_id", spec.bos_id), ("eod_id", spec.eod_id)):
        if i is not None and not 0 <= i < got.vocab_size:
            raise ValueError(f"{source}: its tokenizer's {name} {i} is outside the vocabulary of "
                             f"{f} ({got.vocab_size} ids): the plan's header was edited")
    return TextEncoder(TokenizerSpec(path=str(f), sha256=spec.sha256, vocab_size=got.vocab_size,
                                     bos=spec.bos, append_eod=spec.append_eod,
                                     bos_id=spec.bos_id, eod_id=spec.eod_id), loaded._tok)
