"""Per-epoch sample permutation and global batches (one global batch = one optimizer step).

Invariants:
- The permutation is a pure function of (num_samples, seed, epoch): keys are splitmix64 hashes of
  (seed, epoch, index) computed with numpy uint64 arithmetic (which wraps, as the hash wants), and
  the permutation is their stable argsort (the keys are distinct, so the order is unique; a
  radix sort computes it). It
  never touches ``np.random``, whose streams may change between numpy versions, so a plan made
  on one machine is the plan made on another.
- Global batches take eligible samples in permutation order and never reorder them; the planner
  may reorder samples *within* a step but never moves one to another step.
- Evaluation batches (``eval_global_batches``) take the eligible samples in file order, one
  pass, and keep the last partial batch: the same cutting rule, without the permutation.

Trade-off: hashing then sorting costs O(n) per epoch (0.05 s at a million samples), more than
a shuffle, and buys a permutation defined by a formula rather than by a library.

Example (tokens mode, T = 10): lengths in permutation order [4, 5, 3, 12, 2] give the steps
[4, 5] (adding 3 would make 12 > 10), [3], [12] (alone larger than T: a step of its own), [2].
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel

_MASK64 = (1 << 64) - 1


def _splitmix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finalizer, element-wise; arrays (not numpy scalars) wrap without warnings."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> NDArray[np.int64]:
    """The order in which ``epoch`` visits samples 0..num_samples-1, the same on every machine.

    Args:
        num_samples: number of samples in the dataset.
        seed: the plan's seed (any Python int; taken modulo 2**64).
        epoch: 0-based epoch number.

    Returns:
        A permutation of ``arange(num_samples)`` as int64.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    s = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))
    base = _splitmix64(s ^ np.array([epoch & _MASK64], dtype=np.uint64))
    # splitmix64 is a bijection of uint64, so distinct indices get distinct keys: the order is
    # unique (the stable sort only makes that independent of the sort algorithm by definition).
    keys = _splitmix64(base ^ np.arange(num_samples, dtype=np.uint64))
    return radix_argsort(keys)


@kernel
def radix_argsort(keys: NDArray[np.uint64]) -> NDArray[np.int64]:
    """The stable argsort of ``keys`` (LSD radix, 8 passes of 8 bits; ``keys`` is overwritten):
    numpy's stable sort of uint64 is a timsort, 113 ms at a million keys against 46 ms here,
    and the order is the same. Besides ``keys``, 3 arrays of its length (numpy's: about 2.5).
    A pass whose byte is the same in every key moves nothing and is skipped."""
    n = len(keys)
    perm = np.arange(n)
    tmp = np.empty(n, dtype=np.int64)
    k = keys
    k2 = np.empty(n, dtype=np.uint64)
    count = np.empty(257, dtype=np.int64)
    mask = np.uint64(255)
    for byte in range(8):
        shift = np.uint64(8 * byte)
        count[:] = 0
        for i in range(n):
            count[((k[i] >> shift) & mask) + 1] += 1
        if n == 0 or count[((k[0] >> shift) & mask) + 1] == n:
            continue
        for d in range(256):
            count[d + 1] += count[d]
        for i in range(n):
            d = (k[i] >> shift) & mask
            j = count[d]
            count[d] = j + 1
            tmp[j] = perm[i]
            k2[j] = k[i]
        perm, tmp = tmp, perm
        k, k2 = k2, k
    return perm


@kernel
def _token_batch_ends(lengths: NDArray[np.int64], order: NDArray[np.int64],
                      tokens: int) -> NDArray[np.int64]:
    """End positions (exclusive, into ``order``) of greedily filled token batches."""
    ends = np.empty(len(order), dtype=np.int64)
    num = 0
    acc = 0
    for j in range(len(order)):
        length = lengths[order[j]]
        # Close the batch when the next sample would overflow it; a lone oversized sample still
        # forms a batch (acc == 0), so every sample lands in exactly one batch.
        if acc > 0 and acc + length > tokens:
            ends[num] = j
            num += 1
            acc = 0
        acc += length
    if len(order) > 0:
        ends[num] = len(order)
        num += 1
    return ends[:num]


def draw_global_batches(
    lengths: NDArray[np.int64],
    eligible: NDArray[np.bool_],
    *,
    seed: int,
    epoch: int,
    global_batch_size: int = 0,
    global_batch_tokens: int = 0,
    drop_last: bool = False,
) -> tuple[list[NDArray[np.int64]], NDArray[np.int64]]:
    """Split one epoch's eligible samples, in permutation order, into global batches.

    With ``global_batch_size`` every batch holds that many samples (the last may hold fewer).
    With ``global_batch_tokens`` = T a batch takes samples until the next one would push its
    real tokens past T; a sample alone longer than T is a batch of its own. The final batch of
    the epoch is partial when it holds fewer than the batch size (fewer than T tokens); with
    ``drop_last`` it is not drawn.

    Args:
        lengths: tokens per sample in file order (after any truncation policy).
        eligible: which samples may be drawn (False for skipped records and dropped samples).
        seed: the plan's seed.
        epoch: 0-based epoch number.
        global_batch_size: samples per batch (exclusive with ``global_batch_tokens``).
        global_batch_tokens: real tokens per batch (exclusive with ``global_batch_size``).
        drop_last: leave out a partial final batch.

    Returns:
        (batches, undrawn): the batches' sample indices in permutation order, and the eligible
        samples that were not drawn (the dropped final batch; empty unless ``drop_last``).
    """
    lengths, eligible = _check(lengths, eligible, global_batch_size, global_batch_tokens)
    perm = epoch_permutation(len(lengths), seed, epoch)
    return _cut(lengths, perm[eligible[perm]], global_batch_size, global_batch_tokens, drop_last)


def eval_global_batches(lengths: NDArray[np.int64], eligible: NDArray[np.bool_], *,
                        global_batch_size: int = 0, global_batch_tokens: int = 0
                        ) -> list[NDArray[np.int64]]:
    """An evaluation pass: the eligible samples in file order, cut as ``draw_global_batches``
    cuts, the last partial batch kept (every eligible sample is in exactly one batch).

    Example (size mode, B = 4): eligible samples 0..9 give [0 1 2 3], [4 5 6 7], [8 9].
    """
    lengths, eligible = _check(lengths, eligible, global_batch_size, global_batch_tokens)
    order = np.flatnonzero(eligible).astype(np.int64)
    batches, _ = _cut(lengths, order, global_batch_size, global_batch_tokens, drop_last=False)
    return batches


def _check(lengths: NDArray[np.int64], eligible: NDArray[np.bool_], global_batch_size: int,
           global_batch_tokens: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    lengths = np.asarray(lengths, dtype=np.int64)
    eligible = np.asarray(eligible, dtype=np.bool_)
    if lengths.shape != eligible.shape:
        raise ValueError(f"lengths {lengths.shape} and eligible {eligible.shape} differ in shape")
    if (global_batch_size > 0) == (global_batch_tokens > 0):
        raise ValueError("give exactly one of global_batch_size and global_batch_tokens (> 0)")
    return lengths, eligible


def _cut(lengths: NDArray[np.int64], order: NDArray[np.int64], global_batch_size: int,
         global_batch_tokens: int, drop_last: bool
         ) -> tuple[list[NDArray[np.int64]], NDArray[np.int64]]:
    """Cut ``order`` into global batches (see ``draw_global_batches``); (batches, undrawn)."""
    if global_batch_size > 0:
        ends = np.arange(global_batch_size, len(order), global_batch_size, dtype=np.int64)
        ends = np.append(ends, len(order)) if len(order) else ends
        last_full = len(order) % global_batch_size == 0
    else:
        ends = _token_batch_ends(lengths, order, global_batch_tokens)
        start = int(ends[-2]) if len(ends) > 1 else 0
        last_full = int(lengths[order[start:]].sum()) >= global_batch_tokens
    undrawn = np.zeros(0, dtype=np.int64)
    if drop_last and len(ends) and not last_full:
        start = int(ends[-2]) if len(ends) > 1 else 0
        undrawn = order[start:].copy()
        ends = ends[:-1]
    starts = np.r_[0, ends[:-1]] if len(ends) else ends
    batches = [order[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    return batches, undrawn


def draw_blended_batches(
    eligible: NDArray[np.bool_],
    group_bounds: NDArray[np.int64],
    counts: list[int],
    *,
    seed: int,
    epoch: int,
) -> tuple[list[NDArray[np.int64]], list[int]]:
    """One epoch of a blend: every batch takes ``counts[g]`` samples of group ``g``.

    Group g holds samples ``group_bounds[g]:group_bounds[g + 1]`` and has its own permutation
    per epoch (keyed by seed, epoch and g). The epoch holds as many full batches as every group
    can fill: the group that runs out first ends it, and the others' remaining samples are not
    drawn this epoch (a fresh permutation next epoch draws others). Within a batch the samples
    are group 0's, then group 1's, ...; the planner may reorder within a step anyway.

    Returns:
        (batches, drawn): the batches' sample indices, and how many samples each group gave.
    """
    orders = []
    for g, count in enumerate(counts):
        a, b = int(group_bounds[g]), int(group_bounds[g + 1])
        # A group's key mixes g into the seed, so groups of equal size are not permuted alike.
        perm = a + epoch_permutation(b - a, (seed * 0x9E3779B1 + g + 1) & _MASK64, epoch)
        orders.append(perm[eligible[perm]])
        if count <= 0:
            raise ValueError(f"blend group {g} gives {count} samples per step")
    num = min(len(o) // c for o, c in zip(orders, counts, strict=True))
    if num == 0:
        g = min(range(len(counts)), key=lambda i: len(orders[i]) // counts[i])
        raise ValueError(f"blend entry {g} has {len(orders[g])} usable samples, fewer than the "
                         f"{counts[g]} every step draws from it")
    batches = [np.concatenate([o[s * c:(s + 1) * c] for o, c in zip(orders, counts, strict=True)])
               for s in range(num)]
    return batches, [num * c for c in counts]
