"""Datasets in: every supported file format read into a ``LengthTable`` (one length per sample,
file order), with bad records named by file and line. Nothing here reads tokens for training.

Modules: ``lengths`` (format detection, ``read_lengths``, ``LengthTable``), ``formats`` (Parquet,
Arrow, text), ``megatron`` (Megatron ``.idx``: documents or sequences), ``jsonl`` and
``jsonl_scan`` (the numba JSONL scanner),
``fieldname`` (the record field a plan's dataset is read with: recorded, or overridden);
text corpora: ``textenc`` (the one ``tokenizers`` import), ``text`` (documents of JSONL,
Parquet, Arrow string fields, counted), ``textcache`` (their counts cached by content),
``pretokenize`` and ``megatron_write`` (``dcp-plan tokenize``: text into a Megatron dataset).
"""

from __future__ import annotations

from planner.sources.lengths import LengthTable, read_lengths

__all__ = ["LengthTable", "read_lengths"]
