"""Reading a ``torch.distributed.checkpoint`` directory without running code from it.

A DCP checkpoint (Megatron's ``model/``, torchtitan's ``step-N/``) holds two kinds of pickle:

- ``.metadata``, which torch reads with ``pickle.load``: ``check_metadata_pickle`` reads it
  first through an unpickler that admits only the checkpoint metadata's own classes, and
  refuses the file by name otherwise;
- the objects stored inside the ``.distcp`` shards (ints, strings, a data loader's state),
  which ``DefaultLoadPlanner.load_bytes`` reads with ``torch.load(weights_only=False)``:
  ``objects_load_as_data`` makes it ``weights_only=True`` (tensors, containers, numbers,
  strings and the safe globals registered with torch) for the duration of a load.

Both the Megatron and the torchtitan adapters load through these; a crafted checkpoint is
refused before any of its code could run.
"""

from __future__ import annotations

import contextlib
import pickle
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "TensorWriteData", "WriteItem", "WriteItemType", "BytesIOWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a torch layout by its name
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id as torchtitan saves
}
"""What torch's checkpoint metadata pickles: its dataclasses and enums (whose construction runs
no code of the pickle's choosing), torch.Size, layouts, dtypes and a path (parsed, never
opened). Nothing else is admitted."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits ``_METADATA_CLASSES`` and torch dtypes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_metadata_pickle(path: Path | str) -> None:
    """Refuse torch checkpoint metadata that names anything but metadata (it could run code).

    Raises:
        ValueError: naming ``path``: a pickle that refers to any other global, or one that
            does not load at all (missing, damaged, truncated).
    """
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: refers to {e}, which checkpoint metadata never holds; "
                         "refusing to load a checkpoint that could run code") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
        raise ValueError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: "
                         f"{e})") from None


SHARD_OBJECT_REFUSED = "an object stored in the checkpoint's .distcp shards is not plain data"


def refused_shard_object(exc: BaseException) -> str:
    """The refusal ``objects_load_as_data`` raised, when ``exc`` (a DCP ``CheckpointException``,
    which wraps each rank's error) carries one; else ''."""
    for item in dict(getattr(exc, "failures", None) or {}).values():
        inner = item[0] if isinstance(item, tuple) else item
        if isinstance(inner, ValueError) and SHARD_OBJECT_REFUSED in str(inner):
            return str(inner)
    return ""


class _TorchLoadsWeightsOnly(types.ModuleType):
    """``torch`` whose ``load`` never unpickles arbitrary objects (``weights_only=True``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(f: Any, *args: Any, weights_only: bool = True, **kwargs: Any) -> Any:
        del weights_only
        try:
            return torch.load(f, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if "global" in ln.lower()]
            why = lines[0] if lines else type(e).__name__
            raise ValueError(f"{SHARD_OBJECT_REFUSED} ({why}); refusing to load a checkpoint "
                             "that could run code") from None


@contextlib.contextmanager
def objects_load_as_data() -> Iterator[None]:
    """During a DCP load, the shards' stored objects load with ``weights_only=True``."""
    # torch/distributed/checkpoint/default_planner.py (DefaultLoadPlanner.load_bytes) reads
    # every non-tensor object of a checkpoint with torch.load(weights_only=False): a crafted
    # shard file would run code.
    import torch.distributed.checkpoint.default_planner as planner_module

    module: Any = planner_module
    saved = module.torch
    module.torch = _TorchLoadsWeightsOnly("torch")
    try:
        yield
    finally:
        module.torch = saved
