"""`dcp-plan tokenize DATA... --tokenizer PATH -o PREFIX`: a text corpus into a Megatron dataset.

Megatron-LM's ``tools/preprocess_data.py`` for the corpora ``dcp-plan`` reads as text (JSONL,
also .gz/.zst, Parquet, Arrow with a string field), with its flag names where it has them
(``--append-eod``, ``--workers``): the output (``PREFIX.bin`` / ``PREFIX.idx``) is planned and
trained on by ``dcp-plan PREFIX``, ``dcp-train`` and Megatron-LM without a tokenizer. The write
is atomic (nothing at ``PREFIX`` until both files are complete) and an existing dataset there is
replaced only with ``--overwrite``.
"""

from __future__ import annotations

import os

from planner.cli.args import (
    ArgumentParser,
    HelpFormatter,
    add_json_arguments,
    add_version,
    emit_summary,
    positive_int,
)
from planner.cli.guard import print_notice
from planner.cli.textargs import add_tokenizer_arguments, encoder_from_args

PROG = "dcp-plan tokenize"


def cmd_tokenize(argv: list[str]) -> int:
    p = ArgumentParser(
        prog=PROG, formatter_class=HelpFormatter,
        description="Tokenize a text corpus once into a Megatron indexed dataset (PREFIX.bin, "
        "PREFIX.idx: one document per record with tokens), the format Megatron-LM trains on; "
        "then plan it with dcp-plan PREFIX.")
    add_version(p)
    p.add_argument("dataset", nargs="+", metavar="DATASET",
                   help="text files, directories or quoted globs, in order (JSONL, .jsonl.gz, "
                   ".jsonl.zst, Parquet, Arrow)")
    p.add_argument("-o", "--output", "--output-prefix", dest="output", required=True,
                   metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--field", "--json-keys", dest="field", default=None,
                   help="the text field (JSONL) or string column (Parquet, Arrow) (default: "
                   "text)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="tokenizer threads (default: every core)")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="leave malformed records out (counted) instead of stopping at the first")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing Megatron dataset at PREFIX (never another file)")
    add_tokenizer_arguments(p, required=True)
    add_json_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no summary and no progress bar")
    args = p.parse_intermixed_args(argv)
    if args.workers is not None:
        # The tokenizers library's thread pool (Rust's rayon) reads this when it starts.
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    encoder = encoder_from_args(p, args)
    assert encoder is not None  # --tokenizer is required here
    from planner.cli.progress import Progress
    from planner.sources.pretokenize import tokenize_dataset
    from planner.sources.text import text_unit

    show = not (args.quiet or args.json)
    with Progress("tokenizing", unit=text_unit(args.dataset), enabled=show) as bar:
        r = tokenize_dataset(args.dataset, encoder, args.output, field=args.field,
                             skip_bad_records=args.skip_bad_records, overwrite=args.overwrite,
                             progress=bar, notice=print_notice)
    summary = {"prefix": r.prefix, "files": list(r.files), "num_records": r.num_records,
               "num_documents": r.num_documents, "num_tokens": r.num_tokens,
               "empty_documents": r.empty_documents,
               "skipped_bad_records": r.skipped_bad_records, "dtype": r.dtype,
               "seconds": round(r.seconds, 3), "tokenizer": encoder.spec.to_dict(),
               "field": args.field or "text"}
    rate = r.num_records / r.seconds if r.seconds > 0 else 0.0
    lines = [f"wrote     {r.prefix}.bin, {r.prefix}.idx: {r.num_documents:,} documents, "
             f"{r.num_tokens:,} tokens ({r.dtype})",
             f"tokenizer {encoder.spec.policy_text()}"]
    left = [f"{n:,} {what}" for n, what in ((r.empty_documents, "empty documents (no tokens)"),
                                             (r.skipped_bad_records, "bad records")) if n]
    if left:
        lines.append(f"left out {', '.join(left)}")
    lines.append(f"speed     {rate:,.0f} documents/s, {r.num_tokens / max(r.seconds, 1e-9):,.0f} "
                 f"tokens/s in {r.seconds:.2f} s")
    lines.append(f"next      dcp-plan {r.prefix} --dp D --cp C --max-tokens-per-rank CAP "
                 "--global-batch-size B")
    emit_summary(summary, "\n".join(lines), as_json=args.json, json_path=args.summary_json,
                 quiet=args.quiet)
    return 0
