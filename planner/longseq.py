"""The long-sequence policy: what becomes of a sample that no allowed group size holds.

A sample fits when some allowed group size holds it after padding. Otherwise the policy
(``--long-sequences``) decides: ``error`` raises naming the sample; ``split`` cuts it into
segments of ``segment_tokens`` (the most real tokens one group holds after padding) placed in
the same step;
``truncate`` keeps its first ``segment_tokens`` tokens; ``drop`` leaves it out. Example: N=16,
C=16384, zigzag: a group of 16 holds 262,144 padded tokens, so a 600,000-token sample splits into
segments at token offsets 0, 262144 and 524288 (75,712 tokens, which runs at CP 8).
With ``max_segment_tokens`` (``dcp-plan --memory-per-rank``), ``split`` also cuts every sample
longer than it, and no segment is longer: the memory limit, not only the pool, bounds a segment.

``apply_long_policy`` decides per sample (one pass over the lengths); ``segments`` expands a
batch's samples into the segments the solver places.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from planner.config import PlannerConfig
from planner.groups import MAX_SEGMENT_TOKENS, pad_multiple
from planner.jit import kernel
from planner.planfile.stats import min_padded

if TYPE_CHECKING:
    from planner.memory import MemoryModel


@dataclass(frozen=True, kw_only=True, slots=True)
class LongPolicyResult:
    """Per-sample outcome of the long-sequence policy."""

    tokens: NDArray[np.int64]
    """Tokens to place per sample (0: not placed: dropped or a skipped record)."""
    split: NDArray[np.bool_]
    """Samples cut into segments of ``segment_tokens``."""
    segment_tokens: int
    split_for_memory: NDArray[np.int64]
    """Split samples that the pool holds whole but ``max_segment_tokens`` does not (sorted)."""
    dropped: NDArray[np.int64]
    """Samples placed nowhere: policy drops, skipped records, empty samples (sorted)."""
    truncated: list[list[int]]
    """[sample_index, kept_tokens] per truncated sample."""


def segment_capacity(config: PlannerConfig) -> tuple[int, int]:
    """(most real tokens one group holds after padding, the size that holds them)."""
    tp_eff = config.parallel.tp_eff
    best = (0, config.sizes[-1])
    for k in config.sizes:
        m = pad_multiple(k, tp_eff, config.layout, config.pad_to_multiple)
        hold = min(k * config.capacity_tokens_per_rank, MAX_SEGMENT_TOKENS)
        best = max(best, (hold // m * m, k))
    return best


def memory_segment_cap(config: PlannerConfig, model: MemoryModel, budget: float) -> int:
    """The longest segment that keeps every group of ``config`` within ``budget`` bytes a rank
    (``MemoryModel.segment_cap``): at most what the pool holds, 0 when no cap helps."""
    tp_eff = config.parallel.tp_eff
    multiples = tuple(pad_multiple(k, tp_eff, config.layout, config.pad_to_multiple)
                      for k in config.sizes)
    return model.segment_cap(budget, config.sizes, config.capacity_tokens_per_rank, multiples,
                             max(segment_capacity(config)[0], 1))


MAX_SEGMENTS_PER_SAMPLE = 4096
"""A split sample becomes at most this many segments (all in one step, about one microbatch
each); more is a mistake in the data or the capacity, refused before allocating per segment."""


def apply_long_policy(lengths: NDArray[np.int64], config: PlannerConfig, *,
                      source: str = "dataset") -> LongPolicyResult:
    """Apply ``config.long_sequences`` to every sample that no allowed group size holds."""
    tp_eff = config.parallel.tp_eff
    cap = config.capacity_tokens_per_rank
    fits = min_padded(lengths, config.sizes, cap, tp_eff, config.layout,
                      config.pad_to_multiple) > 0
    seg, seg_k = segment_capacity(config)
    for_memory = np.zeros(0, dtype=np.int64)
    if config.max_segment_tokens and config.long_sequences == "split":
        # A memory limit's cap (planner/memory.py): samples the pool holds but the limit does
        # not are split too, and every split sample's segments are at most the cap.
        for_memory = np.flatnonzero(fits & (lengths > config.max_segment_tokens))
        fits &= lengths <= config.max_segment_tokens
        seg = min(seg, config.max_segment_tokens)
    long_idx = np.flatnonzero(~fits & (lengths > 0))
    tokens = np.where(lengths > 0, lengths, 0).astype(np.int64)
    split = np.zeros(len(lengths), dtype=np.bool_)
    dropped = np.flatnonzero(lengths <= 0)
    truncated: list[list[int]] = []
    if long_idx.size:
        policy = config.long_sequences
        i = int(long_idx[0])
        if policy == "error":
            more = f" (and {long_idx.size - 1} more)" if long_idx.size > 1 else ""
            raise ValueError(
                f"sample {i} has {int(lengths[i])} tokens, more than the largest group holds: "
                f"{seg_k} ranks x {cap} tokens per rank = {seg_k * cap} (at most {seg} real "
                f"tokens after padding){more}; use long_sequences split, truncate or drop")
        if policy in ("split", "truncate") and seg <= 0:
            raise ValueError(f"sample {i}: no group size holds even one padded token "
                             f"(capacity {cap}, layout {config.layout}), cannot {policy}")
        if policy == "split":
            count = -(-tokens[long_idx] // seg)
            worst = int(np.argmax(count))
            if int(count[worst]) > MAX_SEGMENTS_PER_SAMPLE:
                j = int(long_idx[worst])
                raise ValueError(
                    f"{source}: sample {j} has {int(lengths[j])} tokens: split into segments of "
                    f"{seg} it would need {int(count[worst])} microbatches in one step (at most "
                    f"{MAX_SEGMENTS_PER_SAMPLE}); raise --max-tokens-per-rank"
                    + (" or --memory-per-rank" if config.max_segment_tokens else "")
                    + ", or use --long-sequences truncate or drop")
            split[long_idx] = True
        elif policy == "truncate":
            tokens[long_idx] = seg
            truncated = [[int(s), seg] for s in long_idx.tolist()]
        else:
            tokens[long_idx] = 0
            dropped = np.union1d(dropped, long_idx)
    return LongPolicyResult(tokens=tokens, split=split, segment_tokens=seg,
                            split_for_memory=for_memory.astype(np.int64),
                            dropped=dropped.astype(np.int64), truncated=truncated)


def segments(order: NDArray[np.int64], policy: LongPolicyResult) -> tuple[
        NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Expand samples (in batch order) into segments: (sample, offset, tokens, per-sample count)."""
    if not policy.split[order].any():
        tok = policy.tokens[order]
        return order, np.zeros(len(order), dtype=np.int64), tok, np.ones(len(order), np.int64)
    return _expand(order, policy.tokens, policy.split, max(policy.segment_tokens, 1))


@kernel
def _expand(order: NDArray[np.int64], tokens: NDArray[np.int64], split: NDArray[np.bool_],
            seg: int) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64],
                               NDArray[np.int64]]:
    """``segments`` with split samples: one pass, no temporaries of the segments' length (the
    numpy version's peaked at ~1 GB above its inputs for 20M samples)."""
    n = len(order)
    count = np.empty(n, dtype=np.int64)
    total = 0
    for j in range(n):
        i = order[j]
        count[j] = -(-tokens[i] // seg) if split[i] else 1
        total += count[j]
    sample = np.empty(total, dtype=np.int64)
    offset = np.empty(total, dtype=np.int64)
    out = np.empty(total, dtype=np.int64)
    q = 0
    for j in range(n):
        i = order[j]
        for s in range(count[j]):
            sample[q] = i
            offset[q] = s * seg
            # A sample that fits is never longer than seg, so the minimum only cuts split ones.
            out[q] = min(seg, tokens[i] - s * seg)
            q += 1
    return sample, offset, out, count
