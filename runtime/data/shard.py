"""Pure index math for packed (THD) buffers: cu_seqlens and each CP rank's rows.

A group of k ranks processes one packed buffer of T rows: its sequences, each padded, back to
back. Every function here is a pure function of integers; numpy does the work (``*_np``) and thin
wrappers return torch tensors for the runtime edge.

Worked example (Transformer Engine's notation). Sequences a, b, c of real lengths 3, 2, 4 pack as
``[a a a b b c c c c]``, so ``cu_seqlens([3, 2, 4]) == [0, 3, 5, 9]``. Padded to multiples of 4
for k = 2 with zigzag they become ``[a a a _ b b _ _ c c c c]``, ``cu_seqlens_padded == [0, 4,
8, 12]`` and each sequence is cut into 2k = 4 chunks of h = 1:

    zigzag rank 0: chunk 0 and chunk 3 of each sequence -> rows [0, 3, 4, 7, 8, 11]
    zigzag rank 1: chunk 1 and chunk 2 of each sequence -> rows [1, 2, 5, 6, 9, 10]
    contiguous rank r: rows [r*T/k, (r+1)*T/k)          -> [0..5], [6..11]

Zigzag: local index i of a sequence starting at s with padded length P and h = P / 2k maps to
``s + i + h*r`` for i < h, else ``s + (i - h) + h*(2k - 1 - r)`` (TE's
``thd_get_partitioned_indices``). It balances causal attention work across the ranks of a group.

Preconditions (ValueError otherwise): ``cu_seqlens_padded`` is 1-D, starts at 0 and never
decreases; zigzag with k > 1 needs every padded length (hence the total) to be a multiple of 2k;
contiguous needs T % k == 0. With k == 1 both layouts are the identity and need nothing.
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray

from planner.groups import CONTIGUOUS, LAYOUTS, ZIGZAG

IntArray: TypeAlias = "ArrayLike | torch.Tensor"


def _as_np(x: IntArray, name: str) -> NDArray[np.int64]:
    """numpy int64 view of a numpy array, torch tensor or sequence of ints (1-D)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range 0..{cp_size - 1} for cp_size {cp_size}")


def _check_cu(cu: NDArray[np.int64]) -> None:
    if cu.size == 0 or cu[0] != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0, got {cu[:4].tolist()}")
    if np.any(np.diff(cu) < 0):
        j = int(np.argmax(np.diff(cu) < 0))
        raise ValueError(f"cu_seqlens_padded decreases at sequence {j}: {int(cu[j])} -> "
                         f"{int(cu[j + 1])}")


def ranges_to_indices(starts: NDArray[np.int64], lengths: NDArray[np.int64]) -> NDArray[np.int64]:
    """Concatenate ``arange(starts[j], starts[j] + lengths[j])`` over j, without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # Each output row is its range's start plus its position inside the range.
    first = np.cumsum(lengths) - lengths
    out: NDArray[np.int64] = np.arange(total, dtype=np.int64) + np.repeat(
        np.asarray(starts, np.int64) - first, lengths)
    return out


def cu_seqlens_np(lengths: IntArray) -> NDArray[np.int32]:
    """Cumulative lengths ``[0, l0, l0+l1, ...]`` (int32, S+1): ``[3, 2, 4] -> [0, 3, 5, 9]``."""
    ls = _as_np(lengths, "lengths")
    if np.any(ls < 0):
        raise ValueError(f"lengths must be >= 0, got {int(ls.min())}")
    out = np.zeros(ls.size + 1, dtype=np.int64)
    np.cumsum(ls, out=out[1:])
    if out[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{int(out[-1])} tokens overflow int32 cu_seqlens")
    return out.astype(np.int32)


def cu_seqlens(lengths: IntArray) -> torch.Tensor:
    """1-D int32 tensor of cumulative lengths, as TE's THD format wants (not ``[1, S+1]``).

    Example: sequences ``[a a a b b c c c c]`` have lengths [3, 2, 4] and
    ``cu_seqlens == tensor([0, 3, 5, 9], dtype=torch.int32)``.
    """
    return torch.from_numpy(cu_seqlens_np(lengths))


def zigzag_indices_np(cu_seqlens_padded: IntArray, cp_size: int, cp_rank: int) -> NDArray[np.int64]:
    """Rows of the packed buffer that CP rank ``cp_rank`` of ``cp_size`` holds in zigzag layout.

    Per sequence: chunk ``cp_rank`` then chunk ``2*cp_size - 1 - cp_rank`` of its 2k equal chunks,
    sequences concatenated in order. Returns T / k int64 indices.
    """
    _check_rank(cp_size, cp_rank)
    cu = _as_np(cu_seqlens_padded, "cu_seqlens_padded")
    _check_cu(cu)
    if cp_size == 1:
        return np.arange(int(cu[-1]), dtype=np.int64)
    padded = np.diff(cu)
    two_k = 2 * cp_size
    bad = padded % two_k != 0
    if bad.any():
        j = int(np.argmax(bad))
        raise ValueError(f"zigzag with cp_size {cp_size} needs padded lengths that are multiples "
                         f"of {two_k}; sequence {j} has {int(padded[j])}")
    h = padded // two_k
    s = cu[:-1]
    # Two ranges per sequence, interleaved so that each sequence's chunks stay together in order.
    starts = np.stack([s + h * cp_rank, s + h * (two_k - 1 - cp_rank)], axis=1).ravel()
    return ranges_to_indices(starts, np.repeat(h, 2))


def contiguous_indices_np(cu_seqlens_padded: IntArray, cp_size: int,
                          cp_rank: int) -> NDArray[np.int64]:
    """Rows ``[r*T/k, (r+1)*T/k)`` of the packed buffer of total T = ``cu_seqlens_padded[-1]``."""
    _check_rank(cp_size, cp_rank)
    cu = _as_np(cu_seqlens_padded, "cu_seqlens_padded")
    _check_cu(cu)
    total = int(cu[-1])
    if total % cp_size != 0:
        raise ValueError(f"contiguous layout needs the total of {total} padded tokens to be a "
                         f"multiple of cp_size {cp_size}")
    n = total // cp_size
    return np.arange(cp_rank * n, (cp_rank + 1) * n, dtype=np.int64)


def shard_indices_np(layout: str, cu_seqlens_padded: IntArray, cp_size: int,
                     cp_rank: int) -> NDArray[np.int64]:
    """This CP rank's rows of the packed buffer for ``layout`` (``zigzag`` or ``contiguous``)."""
    if layout == ZIGZAG:
        return zigzag_indices_np(cu_seqlens_padded, cp_size, cp_rank)
    if layout == CONTIGUOUS:
        return contiguous_indices_np(cu_seqlens_padded, cp_size, cp_rank)
    raise ValueError(f"unknown layout {layout!r} (expected one of {', '.join(LAYOUTS)})")


def zigzag_indices(cu_seqlens_padded: IntArray, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 tensor equal to TE's ``thd_get_partitioned_indices(cu, cu[-1], cp_size, cp_rank)``."""
    return torch.from_numpy(zigzag_indices_np(cu_seqlens_padded, cp_size, cp_rank))


def contiguous_indices(cu_seqlens_padded: IntArray, cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 tensor of rows ``[r*T/k, (r+1)*T/k)``; see ``contiguous_indices_np``."""
    return torch.from_numpy(contiguous_indices_np(cu_seqlens_padded, cp_size, cp_rank))


def shard_indices(layout: str, cu_seqlens_padded: IntArray, cp_size: int,
                  cp_rank: int) -> torch.Tensor:
    """int64 tensor of this CP rank's rows for ``layout``; see ``shard_indices_np``."""
    return torch.from_numpy(shard_indices_np(layout, cu_seqlens_padded, cp_size, cp_rank))
