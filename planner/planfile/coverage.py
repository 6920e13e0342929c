"""Coverage of one epoch, checked step by step in memory independent of the number of steps.

PLAN_FORMAT invariant 5: within an epoch every sample's tokens [0, length) are placed exactly
once, as one segment or disjoint segments that tile it, except what the header's stats remove.
``Coverage`` keeps, per sample, the end of the contiguous prefix placed so far (O(samples)
memory, nothing per row): each step's segments of a sample, sorted by offset, extend that
prefix when they start at its end. A segment that does not (another step placed a later piece
first, or an overlap or a gap) waits in a list that a valid plan never fills (the planner puts
all of a sample's segments in one step), and ``finish`` chains the waiting segments onto the
prefixes in offset order: the same verdicts, and the same messages, as sorting the whole epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel
from planner.planfile.schema import PlanHeader


class Coverage:
    """Invariant 5 for one epoch: ``add`` each step's segment columns, then ``finish``."""

    def __init__(self, header: PlanHeader, epoch: int) -> None:
        self.header = header
        self.epoch = epoch
        n = header.dataset.num_samples
        self.ends = np.zeros(n, dtype=np.int64)
        self.placed = np.zeros(n, dtype=np.bool_)
        self.seen = np.zeros(n, dtype=np.uint8)  # _extend's scratch, all 0 between steps
        self.waiting: list[tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]] = []
        self.error: str | None = None

    def add(self, sample: NDArray[Any], offset: NDArray[Any], ntok: NDArray[Any]) -> None:
        """One step's ``sample_index``, ``token_offset`` and ``num_tokens`` columns."""
        if self.error is not None:
            return
        if not _extend(np.asarray(sample, np.int64), np.asarray(offset, np.int64),
                       np.asarray(ntok, np.int64), self.ends, self.placed, self.seen):
            self._add_sorted(sample, offset, ntok)

    def _add_sorted(self, sample: NDArray[Any], offset: NDArray[Any], ntok: NDArray[Any]) -> None:
        """``add`` by sorting the step's segments (what ``_extend`` does faster when every
        segment extends its prefix): the reference, and the path that words a misfit."""
        keep = sample >= 0
        s = sample[keep].astype(np.int64)
        o = offset[keep].astype(np.int64)
        t = ntok[keep].astype(np.int64)
        num_samples = len(self.ends)
        if s.size and s.max() >= num_samples:
            self.error = (f"epoch {self.epoch}: sample index {int(s.max())} >= num_samples "
                          f"{num_samples}")
            return
        order = np.lexsort((o, s))
        s, o, t = s[order], o[order], t[order]
        # (np.r_ would do, at ~10x the cost per call: this runs once per step.)
        new = np.ones(s.size, dtype=np.bool_)
        np.not_equal(s[1:], s[:-1], out=new[1:])
        chained = np.zeros(s.size, dtype=np.int64)
        np.add(o[:-1], t[:-1], out=chained[1:])
        expected = np.where(new, self.ends[s], chained)
        bad = o != expected
        if bad.any():
            # Every segment of a sample with a misfit waits; the rest extend their prefixes.
            late = np.isin(s, s[bad])
            self.waiting.append((s[late], o[late], t[late]))
            s, o, t, new = s[~late], o[~late], t[~late], new[~late]
        last = np.ones(s.size, dtype=np.bool_)
        last[:-1] = new[1:]
        self.ends[s[last]] = o[last] + t[last]
        self.placed[s] = True

    def _chain_waiting(self) -> str | None:
        s = np.concatenate([w[0] for w in self.waiting])
        o = np.concatenate([w[1] for w in self.waiting])
        t = np.concatenate([w[2] for w in self.waiting])
        order = np.lexsort((o, s))
        for j in order.tolist():
            si, oi = int(s[j]), int(o[j])
            if oi != self.ends[si]:
                return (f"epoch {self.epoch}: sample {si} has a segment at token {oi}, expected "
                        f"{int(self.ends[si])} (overlap or gap)")
            self.ends[si] = oi + int(t[j])
            self.placed[si] = True
        return None

    def finish(self, lengths: NDArray[np.integer] | None,
               blend_check: Callable[[NDArray[np.bool_]], None] | None = None) -> list[str]:
        """The epoch's coverage errors (empty when it holds).

        ``blend_check``: for a blended plan, called with the placed samples; its epoch ends when
        its first group runs out, so the others' remaining samples are undrawn by design and
        "every sample placed" is not asked.
        """
        if self.error is None and self.waiting:
            self.error = self._chain_waiting()
        if self.error is not None:
            return [self.error]
        errors = []
        header, epoch = self.header, self.epoch
        num_samples = len(self.ends)
        placed, ends = self.placed, self.ends
        stats = header.stats
        dropped = np.asarray(stats.get("dropped_samples", []), dtype=np.int64)
        truncated = dict((int(a), int(b)) for a, b in stats.get("truncated_samples", []))
        if blend_check is not None:
            blend_check(placed)
            should = placed.copy()
        else:
            should = np.ones(num_samples, dtype=bool)
        if header.global_batch.get("drop_last") and "undrawn_samples" in stats:
            should[np.asarray(stats["undrawn_samples"][epoch], dtype=np.int64)] = False
        should[dropped] = False
        if np.any(placed & ~should):
            j = int(np.argmax(placed & ~should))
            errors.append(f"epoch {epoch}: sample {j} is placed although the header lists it "
                          f"as dropped")
        if np.any(should & ~placed):
            j = int(np.argmax(should & ~placed))
            errors.append(f"epoch {epoch}: sample {j} is placed nowhere")
        if lengths is not None:
            want = np.asarray(lengths, dtype=np.int64).copy()
            for s, kept in truncated.items():
                want[s] = kept
            bad = placed & (ends != want)
            if bad.any():
                j = int(np.argmax(bad))
                errors.append(f"epoch {epoch}: sample {j} placed tokens [0, {int(ends[j])}) "
                              f"of {int(want[j])}")
        return errors


@kernel
def _extend(sample: NDArray[np.int64], offset: NDArray[np.int64], ntok: NDArray[np.int64],
            ends: NDArray[np.int64], placed: NDArray[np.bool_], seen: NDArray[np.uint8]) -> bool:
    """``Coverage.add`` when every real segment of the step extends its sample's prefix (its
    sample's segments in offset order: the first at ``ends``, each next where the one before
    ends): then it records them as the numpy path would and returns True, in one pass, sorting
    only the samples with several segments. Otherwise it changes nothing and returns False,
    and the numpy path words the verdict."""
    n = len(sample)
    num_samples = len(ends)
    ok = True
    for j in range(n):
        s = sample[j]
        if s < 0:
            continue
        if s >= num_samples:
            ok = False
            break
        seen[s] = 1 if seen[s] == 0 else 2
    rows = np.empty(n, dtype=np.int64)
    k = 0
    if ok:
        # Samples seen once: their one segment must start where the prefix ends.
        for j in range(n):
            s = sample[j]
            if s < 0:
                continue
            if seen[s] == 1:
                if offset[j] != ends[s]:
                    ok = False
                    break
            else:
                rows[k] = j
                k += 1
    if ok and k:
        # The others by (sample, offset), ties in step order (np.lexsort's): a chain from the
        # prefix's end.
        rows = rows[:k]
        rows = rows[np.argsort(offset[rows], kind="mergesort")]
        rows = rows[np.argsort(sample[rows], kind="mergesort")]
        for q in range(k):
            j = rows[q]
            first = q == 0 or sample[rows[q - 1]] != sample[j]
            want = ends[sample[j]] if first else offset[rows[q - 1]] + ntok[rows[q - 1]]
            if offset[j] != want:
                ok = False
                break
    for j in range(n):
        s = sample[j]
        if 0 <= s < num_samples:
            seen[s] = 0
    if not ok:
        return False
    for j in range(n):
        s = sample[j]
        if s >= 0:
            placed[s] = True
            ends[s] = offset[j] + ntok[j]
    # A sample with several segments ends where its last one (in that order) does.
    for q in range(k):
        j = rows[q]
        ends[sample[j]] = offset[j] + ntok[j]
    return True
