"""Megatron indexed datasets of several sequences per document, written by Megatron-core itself.

``IndexedDatasetBuilder.add_item`` per sequence and ``end_document`` per document, as Megatron-LM's
``tools/preprocess_data.py --split-sentences`` writes one sequence per sentence: the real writer,
so the tests read what users' data holds (not this project's own ``write_megatron_dataset``,
which writes one sequence per document).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

Documents = list[list[NDArray[np.int64]]]
"""Per document, its sequences' tokens."""


def random_documents(num_documents: int, *, sequences: int = 3, vocab: int = 1000,
                     longest: int = 40, seed: int = 0) -> Documents:
    """``num_documents`` documents of 1..``sequences`` sequences (exactly ``sequences`` when
    ``seed`` is 0) of 1..``longest`` tokens below ``vocab``."""
    rng = np.random.default_rng(seed)
    out: Documents = []
    for _ in range(num_documents):
        n = sequences if seed == 0 else int(rng.integers(1, sequences + 1))
        out.append([rng.integers(0, vocab, int(rng.integers(1, longest + 1))) for _ in range(n)])
    return out


def indexed_dataset() -> ModuleType:
    """Megatron-core's ``megatron.core.datasets.indexed_dataset`` (skips without it). Imported
    with warnings silenced, as ``runtime.adapters.megatron.compat.mcore`` does: importing
    ``megatron.core`` warns about torch and TE internals, and the suite runs warnings as errors."""
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.datasets.indexed_dataset as module
    found: ModuleType = module
    return found


def megatron_reader(prefix: Path) -> Any:
    """Megatron-core's own reader (``IndexedDataset``) of ``prefix``."""
    return indexed_dataset().IndexedDataset(str(prefix))


def write_documents(prefix: Path, docs: Documents, dtype: type[np.integer] = np.int32) -> Path:
    """``prefix.bin`` / ``prefix.idx`` with Megatron-core's builder; returns ``prefix``."""
    import torch

    builder = indexed_dataset().IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.from_numpy(np.asarray(seq, dtype=np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def concatenated(docs: Documents) -> list[NDArray[np.int64]]:
    """Each document's tokens: its sequences', concatenated (what a document sample holds)."""
    return [np.concatenate(d) if d else np.zeros(0, np.int64) for d in docs]
