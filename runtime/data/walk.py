"""The one walk from a rank's shard slots to plan rows and tokens, shared by every per-slot input.

A CP group packs its rows back to back, each padded to ``padded_tokens``; a rank holds the slots
``shard_indices_np`` gives it (``runtime.data.shard``). ``walk`` maps each of those slots to its
row and its position in the row (``real`` where the position is below the row's real tokens);
``read`` then reads every row that has a real slot here, whole, plus (``with_next``) the sample's
next token when the plan split the sample after the row: the label of the row's last real token.

Every label comes from ``ShardTokens.labels(d)``, the label of the position d further on in
the same sequence: the LM labels (``runtime.data.batch``) are d = 0 and multi-token
prediction's depth d (``runtime.data.mtp``) is d, so the two cannot drift apart.

Example (cp 1): rows a = [5, 6, 7] (whole sample) and b = [8, 9] (tokens 0..1 of a 3-token sample
whose token 2 is 4), padded to 4 and 2: ``row`` [0 0 0 0 1 1], ``pos`` [0 1 2 3 0 1], ``real``
[1 1 1 0 1 1]; read with the next token, ``cat`` = [5 6 7 8 9 4]; ``tokens()`` is
[5 6 7 0 8 9], ``labels(0)`` [6 7 0 0 9 4] with mask [1 1 0 0 1 1] and ``labels(1)``
[7 0 0 0 4 0] with mask [1 0 0 0 1 0].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from runtime.data.plan_reader import GroupRows
from runtime.data.shard import cu_seqlens_np, shard_indices_np
from runtime.data.tokens import TokenSource, read_segments


@dataclass(frozen=True, slots=True)
class ShardWalk:
    """This rank's slots of one microbatch's packed buffer, as rows and positions (no tokens)."""

    idx: NDArray[np.int64]
    """[slots]: each slot's position in the group's packed buffer."""
    row: NDArray[np.int64]
    """[slots]: the row (0..rows-1) each slot belongs to (a padded slot: the row it pads)."""
    pos: NDArray[np.int64]
    """[slots]: the slot's position inside its row."""
    real: NDArray[np.bool_]
    """[slots]: True where the slot holds a real token (``pos < num_tokens[row]``)."""


def walk(rows: GroupRows, layout: str, cp_rank: int | None = None) -> ShardWalk:
    """The slots of ``cp_rank`` (default: ``rows.cp_rank``) in ``rows``' group, for ``layout``."""
    cu_pad = cu_seqlens_np(rows.padded_tokens).astype(np.int64)
    rank = rows.cp_rank if cp_rank is None else cp_rank
    idx = shard_indices_np(layout, cu_pad, rows.cp_size, rank)
    row = np.searchsorted(cu_pad[1:], idx, side="right")
    pos = idx - cu_pad[row]
    return ShardWalk(idx=idx, row=row, pos=pos, real=pos < rows.num_tokens[row])


@dataclass(frozen=True, slots=True)
class ShardTokens:
    """The tokens of the rows a ``ShardWalk`` touches, read once (``read``)."""

    walk: ShardWalk
    num_tokens: NDArray[np.int64]
    """[rows]: the rows' real tokens (the plan's ``num_tokens``)."""
    read_len: NDArray[np.int64]
    """[rows]: tokens read per row: 0 for a row with no real slot here, else its real tokens,
    plus 1 where the sample's next token was read too."""
    cat: NDArray[np.int64]
    """The read rows' tokens back to back (one 0 when nothing was read, to keep gathers in
    range)."""
    start: NDArray[np.int64]
    """[slots]: where the slot's row starts in ``cat``."""

    def tokens(self) -> NDArray[np.int64]:
        """[slots]: each slot's token id, 0 on padding."""
        w = self.walk
        return np.where(w.real, self.cat[np.where(w.real, self.start + w.pos, 0)], 0)

    def labels(self, d: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """([slots] labels, [slots] mask): the label of the position ``d`` further on in the
        same sequence, and whether it counts; 0 / False where there is none.

        ``d = 0`` is the LM label, ``d >= 1`` multi-token prediction's depth d. The position
        ``d`` on must be a real token of the slot's row; its label is the token after it: in the
        row, or the sample's next token when it was read (``read(with_next=True)``).
        """
        w = self.walk
        ok = w.real & (w.pos + d < self.num_tokens[w.row]) & (w.pos + d + 1 < self.read_len[w.row])
        return np.where(ok, self.cat[np.where(ok, self.start + w.pos + d + 1, 0)], 0), ok


def read(rows: GroupRows, source: TokenSource, w: ShardWalk, *, with_next: bool) -> ShardTokens:
    """Read the rows ``w`` has a real slot in, whole, and (``with_next``) each split sample's
    next token (the label of the row's last real token). Rows without a real slot are not read."""
    n = rows.num_tokens
    needed = np.zeros(len(n), dtype=bool)
    needed[w.row[w.real]] = True
    has_next = np.zeros(len(n), dtype=np.int64)
    if with_next:
        sel = needed & (rows.sample_index >= 0)
        ends = rows.token_offset[sel] + n[sel]
        has_next[sel] = ends < source.lengths()[rows.sample_index[sel]]
    read_len = np.where(needed, n + has_next, 0)
    read_rows = np.flatnonzero(read_len > 0)
    cat = read_segments(source, rows.sample_index[read_rows], rows.token_offset[read_rows],
                        read_len[read_rows])
    if cat.size == 0:
        cat = np.zeros(1, np.int64)  # every slot is padding; keeps the gathers in range
    start = (np.cumsum(read_len) - read_len)[w.row]
    return ShardTokens(walk=w, num_tokens=n, read_len=read_len, cat=cat, start=start)
