"""RNG states as checkpoint data: tensors and plain numbers, loadable with ``weights_only=True``.

``rng_state()`` is this process's torch (CPU, and CUDA when initialised) and numpy global RNG
states; numpy's MT19937 key (624 uint32 words) is stored as an int64 tensor beside its position
and Gaussian cache, so the file holds nothing torch's restricted unpickler refuses. Checkpoint
format 2 stored ``np.random.get_state()`` itself (a numpy array): ``load_rng`` reads such a file
with numpy's array reconstruction alone allowed (no other callable), then checks every field's
type and shape, so a crafted file can neither run code nor set a malformed state.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

_MT_WORDS = 624


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as tensors and numbers."""
    algorithm, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"algorithm": str(algorithm),
                  "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``load_rng`` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_format2() -> list[Any]:
    """The globals a format-2 file's numpy array needs (``np.random.get_state()``'s key)."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rng(path: Path, checkpoint_format: int) -> dict[str, Any]:
    """A rank's RNG file, checked: ``{"torch": ByteTensor, "numpy": get_state() tuple, ["cuda":
    [ByteTensor]]}``.

    Raises:
        ValueError: unreadable, holding objects other than data, or a field missing or of the
            wrong type or shape (naming the file and the field).
    """
    try:
        if checkpoint_format >= 3:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        else:
            with torch.serialization.safe_globals(_numpy_format2()):
                raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file raises anything from zip to pickle
        first = str(e).splitlines()[0] if str(e) else ""
        if isinstance(e, pickle.UnpicklingError) and "Weights only" in first:
            raise ValueError(f"{path}: holds objects other than tensors and plain data (a "
                             "checkpoint is data; refusing to unpickle code)") from None
        raise ValueError(f"{path}: unreadable checkpoint file ({type(e).__name__}: "
                         f"{first})") from None
    return _checked(path, raw)


def _checked(path: Path, raw: Any) -> dict[str, Any]:
    def bad(field: str, what: str) -> ValueError:
        return ValueError(f"{path}: RNG state {field!r} {what}")

    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not an RNG state (holds a {type(raw).__name__})")
    if not isinstance(raw.get("torch"), torch.Tensor) or raw["torch"].dtype != torch.uint8:
        raise bad("torch", "is missing or not a uint8 tensor")
    np_state = raw.get("numpy")
    if isinstance(np_state, dict):  # format 3
        key = np_state.get("key")
        if not isinstance(key, torch.Tensor) or key.dtype != torch.int64:
            raise bad("numpy.key", "is missing or not an int64 tensor")
        fields = (np_state.get("algorithm"), key.numpy(), np_state.get("pos"),
                  np_state.get("has_gauss"), np_state.get("cached_gaussian"))
    elif isinstance(np_state, tuple) and len(np_state) == 5:  # format 2: get_state() itself
        fields = np_state
    else:
        raise bad("numpy", "is missing or not a numpy RNG state")
    algorithm, key, pos, has_gauss, cached = fields
    if algorithm != "MT19937":
        raise bad("numpy.algorithm", f"is {algorithm!r}, expected 'MT19937'")
    if not isinstance(key, np.ndarray) or key.shape != (_MT_WORDS,) or key.dtype.kind not in "iu" \
            or (key < 0).any() or (key > 0xFFFFFFFF).any():
        raise bad("numpy.key", f"is not {_MT_WORDS} 32-bit words")
    if not isinstance(pos, int) or not 0 <= pos <= _MT_WORDS:
        raise bad("numpy.pos", f"is {pos!r}, expected 0..{_MT_WORDS}")
    if not isinstance(has_gauss, int) or not isinstance(cached, float):
        raise bad("numpy.has_gauss", "or its cached Gaussian is not a number")
    out: dict[str, Any] = {"torch": raw["torch"],
                           "numpy": ("MT19937", key.astype(np.uint32), pos, has_gauss, cached)}
    cuda = raw.get("cuda")
    if cuda is not None:
        if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) for t in cuda):
            raise bad("cuda", "is not a list of tensors")
        out["cuda"] = cuda
    return out
