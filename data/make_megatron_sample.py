"""Write data/sample.jsonl as a Megatron indexed dataset of documents of several sequences.

Every 3 consecutive records of ``sample.jsonl`` become the sequences ("sentences") of one
document: 2,000 sequences in 667 documents (the last holds 2), as Megatron-LM's
``tools/preprocess_data.py --split-sentences`` writes a corpus, one sequence per sentence and
one document per JSON line. Written by Megatron-core's own ``IndexedDatasetBuilder``
(``add_item`` per sequence, ``end_document`` per document) with uint16 tokens (what
preprocessing picks for a vocabulary under 65,500). Needs the ``megatron`` extra.

    python data/make_megatron_sample.py PREFIX     # writes PREFIX.bin and PREFIX.idx
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np

SEQUENCES_PER_DOCUMENT = 3


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python data/make_megatron_sample.py PREFIX")
    prefix = sys.argv[1]
    with warnings.catch_warnings():  # importing megatron.core warns about torch internals
        warnings.simplefilter("ignore")
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    source = Path(__file__).with_name("sample.jsonl")
    records = [json.loads(line)["input_ids"] for line in source.read_text().splitlines()]
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i, tokens in enumerate(records):
        builder.add_item(torch.tensor(tokens, dtype=torch.int64))
        if (i + 1) % SEQUENCES_PER_DOCUMENT == 0 or i + 1 == len(records):
            builder.end_document()
    builder.finalize(f"{prefix}.idx")
    documents = -(-len(records) // SEQUENCES_PER_DOCUMENT)
    print(f"wrote {prefix}.bin and {prefix}.idx: {len(records):,} sequences in "
          f"{documents:,} documents")


if __name__ == "__main__":
    main()
