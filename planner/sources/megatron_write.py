"""Writing a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``) document by document.

The format is Megatron-core's ``IndexedDataset`` (``megatron/core/datasets/indexed_dataset.py``,
its ``_IndexWriter``), as ``planner.sources.formats`` documents it: the tokens of every sequence
back to back in ``.bin``; in ``.idx`` the header, each sequence's length (int32) and byte
pointer (int64), and the document indices (int64: document ``d`` is sequences
``doc[d]..doc[d+1]-1``). Each document here is one sequence, as Megatron-LM's
``tools/preprocess_data.py`` writes a document without ``--split-sentences``, so the document
indices are ``0..n``. The token dtype is Megatron's choice for the vocabulary
(``DType.optimal_dtype``): uint16 below 65,500 ids, else int32.

Written without megatron-core (``planner/`` imports no torch, and megatron-core stays in one
module of the runtime): ``tests/text`` reads the files back with megatron-core's own
``IndexedDataset``, token for token, and finds them byte for byte what its
``IndexedDatasetBuilder`` writes for the same documents. Atomic: both files go to temporaries
beside their targets, are fsynced, and are renamed ``.bin`` first, ``.idx`` last (the index is
what makes a dataset, as a versioned index written last): an interrupted or failed write leaves
the old dataset or none and no temporary. (Only a crash in the instant between the two renames
of an ``--overwrite`` leaves the new ``.bin`` under the old ``.idx``; ``read_megatron`` refuses
a ``.bin`` shorter than its index.) Memory holds the per-document lengths only (8 bytes each);
tokens stream to the temporary ``.bin``.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["MegatronWriter", "optimal_dtype"]

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")
_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
          np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.uint16): 8}


def optimal_dtype(vocab_size: int) -> np.dtype[Any]:
    """Megatron-core's ``DType.optimal_dtype``: uint16 for a vocabulary below 65,500, else
    int32."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else \
        np.dtype(np.int32)


class MegatronWriter:
    """``with MegatronWriter(prefix, dtype) as w: w.add(tokens) ...``: one document per call;
    on a normal exit both files are renamed into place, on an exception removed.

    Args:
        prefix: the dataset's prefix (``PREFIX.bin``, ``PREFIX.idx``).
        dtype: the token dtype (``optimal_dtype(vocab_size)``).
        overwrite: replace an existing Megatron dataset at ``prefix`` (never another file).
        inputs: files the run reads: never an output.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: np.dtype[Any], *,
                 overwrite: bool = False, inputs: tuple[str, ...] = ()) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"token dtype {self.dtype} is not a Megatron integer token dtype")
        self._max = int(np.iinfo(self.dtype).max)
        self.paths = (Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx"))
        check_targets(self.prefix, overwrite=overwrite, inputs=inputs)
        self._overwrite, self._inputs = overwrite, inputs
        self._sizes: list[NDArray[np.int64]] = []
        self._pending: list[int] = []
        self.num_tokens = 0
        self._stack = contextlib.ExitStack()
        self._bin: IO[bytes] | None = None
        self._idx_tmp: Path | None = None

    def __enter__(self) -> MegatronWriter:
        from planner.fileguard import atomic_output

        s = self._stack.__enter__()
        try:
            # Entered .idx first, so it is renamed last (ExitStack unwinds in reverse).
            self._idx_tmp = s.enter_context(atomic_output(
                self.paths[1], kind="megatron-idx", inputs=self._inputs))
            bin_tmp = s.enter_context(atomic_output(self.paths[0], kind="megatron-bin",
                                                    inputs=self._inputs))
            self._bin = s.enter_context(open(bin_tmp, "wb"))
        except BaseException:
            self._stack.__exit__(None, None, None)
            raise
        return self

    @property
    def num_documents(self) -> int:
        return sum(len(s) for s in self._sizes) + len(self._pending)

    def add(self, tokens: NDArray[np.integer[Any]]) -> None:
        """Append one document (one sequence) of token ids.

        Raises:
            ValueError: an empty document (Megatron's readers take no empty sequence), or a
                token outside the dtype's range (a tokenizer whose ids exceed its vocabulary).
        """
        assert self._bin is not None, "use MegatronWriter as a context manager"
        arr = np.asarray(tokens)
        if arr.size == 0:
            raise ValueError("a Megatron sequence holds at least one token")
        if int(arr.min()) < 0 or int(arr.max()) > self._max:
            raise ValueError(f"token ids {int(arr.min())}..{int(arr.max())} do not fit the "
                             f"dataset's {self.dtype} tokens")
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._pending.append(arr.size)
        self.num_tokens += arr.size
        if len(self._pending) >= 1 << 16:
            self._sizes.append(np.array(self._pending, dtype=np.int64))
            self._pending = []

    def _write_index(self) -> None:
        assert self._idx_tmp is not None
        sizes = np.concatenate(self._sizes + [np.array(self._pending, dtype=np.int64)])
        if len(sizes) and int(sizes.max()) > np.iinfo(np.int32).max:
            raise ValueError(f"{self.paths[1]}: a document of {int(sizes.max())} tokens is "
                             "longer than a Megatron index holds (int32 lengths)")
        pointers = np.zeros(len(sizes), dtype="<i8")
        np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
        docs = np.arange(len(sizes) + 1, dtype="<i8")
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, 1, _CODES[self.dtype], len(sizes), len(docs)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.tobytes())
            f.write(docs.tobytes())

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            try:
                assert self._bin is not None
                self._bin.close()
                self._write_index()
            except BaseException as e:  # both temporaries removed, nothing renamed
                self._stack.__exit__(type(e), e, e.__traceback__)
                raise
        self._stack.__exit__(exc_type, exc, tb)


def check_targets(prefix: str, *, overwrite: bool, inputs: tuple[str, ...] = ()) -> None:
    """Refuse ``PREFIX.bin`` / ``PREFIX.idx`` where a file exists (unless ``overwrite`` and it
    is a Megatron dataset), where one is an input, or where nothing can be written.

    Raises:
        ValueError: naming the file and what to do.
    """
    from planner.fileguard import check_output

    for path, kind in ((f"{prefix}.bin", "megatron-bin"), (f"{prefix}.idx", "megatron-idx")):
        if os.path.lexists(path) and not overwrite:
            raise ValueError(f"{path}: exists; refusing to replace it (choose another -o, or "
                             "pass --overwrite to replace a Megatron dataset)")
        check_output(path, kind=kind, inputs=inputs, flag="-o/--output")
