"""The tokenizer flags of ``dcp-plan`` and ``dcp-plan tokenize``: a text corpus's tokenizer and
its policies, as Megatron-LM's ``tools/preprocess_data.py`` names them where it has a name.

    --tokenizer PATH      a Hugging Face tokenizer.json, or a folder holding one
    --append-eod          an end-of-document token after each document (Megatron-LM's flag)
    --bos {tokenizer,add,none}
    --bos-token TOKEN / --eod-token TOKEN   (default: tokenizer_config.json's bos / eos token)

The policies change every count, so a plan records them with the tokenizer's sha256
(``dataset.tokenizer``) and the runtime refuses another tokenizer or policy.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.sources.lengths import LengthTable
    from planner.sources.textenc import TextEncoder

__all__ = ["add_tokenizer_arguments", "encoder_from_args", "text_notice"]

BOS_HELP = ("BOS policy: tokenizer (what the tokenizer.json's post-processor adds: Llama 3's "
            "<|begin_of_text|>, nothing for GPT-2), add (prepend --bos-token, else "
            "tokenizer_config.json's bos_token), none")


def add_tokenizer_arguments(p: argparse.ArgumentParser, *, required: bool) -> None:
    """The flags above, in their own group of ``p``'s help."""
    g = p.add_argument_group("text corpora (tokenized with a Hugging Face tokenizer.json)")
    g.add_argument("--tokenizer", metavar="PATH", required=required, default=None,
                   help="tokenizer.json, or a folder holding one (a model folder, torchtitan's "
                   "assets/tokenizer): the dataset is text (JSONL, Parquet or Arrow with a "
                   "string field, --field, default 'text'), planned by token counts under this "
                   "tokenizer, which the plan records (sha256, vocabulary size, policies)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document (Megatron-LM's "
                   "--append-eod): --eod-token, else tokenizer_config.json's eos_token")
    g.add_argument("--bos", choices=("tokenizer", "add", "none"), default="tokenizer",
                   help=BOS_HELP)
    g.add_argument("--bos-token", metavar="TOKEN", default=None,
                   help="the token --bos add prepends (default: tokenizer_config.json's)")
    g.add_argument("--eod-token", metavar="TOKEN", default=None,
                   help="the token --append-eod appends (default: tokenizer_config.json's "
                   "eos_token)")


def encoder_from_args(parser: argparse.ArgumentParser,
                      args: argparse.Namespace) -> TextEncoder | None:
    """The encoder the flags name, or None without ``--tokenizer`` (a policy flag without it
    is a usage error: it would change nothing).

    Raises:
        ValueError: the tokenizer file is missing or not one, or a policy's token is unknown.
    """
    if args.tokenizer is None:
        given = [flag for flag, on in (("--append-eod", args.append_eod),
                                       ("--bos", args.bos != "tokenizer"),
                                       ("--bos-token", args.bos_token is not None),
                                       ("--eod-token", args.eod_token is not None)) if on]
        if given:
            parser.error(f"{', '.join(given)} set how text is tokenized: give --tokenizer PATH "
                         "too (a token-id dataset is planned as its tokens are)")
        return None
    if args.bos_token is not None and args.bos != "add":
        parser.error("--bos-token is the token --bos add prepends: give --bos add with it")
    if args.eod_token is not None and not args.append_eod:
        parser.error("--eod-token is the token --append-eod appends: give --append-eod with it")
    from planner.sources.textenc import load_encoder

    return load_encoder(args.tokenizer, bos=args.bos, append_eod=args.append_eod,
                        bos_token=args.bos_token, eod_token=args.eod_token)


def text_notice(table: LengthTable) -> str:
    """One line on a text corpus's read: files whose counts came from their caches, and the
    documents with no tokens (kept as samples, never planned); empty when neither."""
    parts = []
    if table.cached_files:
        parts.append(f"token counts of {table.cached_files} of {len(table.files)} files from "
                     "their lengths caches (.dcplen: same content, tokenizer and policies)")
    empty = int((table.lengths == 0).sum()) - len(table.skipped)
    if empty:
        parts.append(f"{empty:,} documents have no tokens (empty texts): they keep their "
                     "sample indices and are not planned")
    return "; ".join(parts)
