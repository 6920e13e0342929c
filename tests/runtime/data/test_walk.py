"""runtime.data.walk: the one slot -> row -> token walk that the LM labels and MTP targets share."""

from __future__ import annotations

import numpy as np

from runtime.data.mtp import mtp_inputs
from runtime.data.tokens import ArrayTokens
from runtime.data.walk import read, walk
from tests.runtime.data.test_batch import rows


def test_module_docstring_example() -> None:
    src = ArrayTokens.from_sequences([[5, 6, 7], [8, 9, 4]])
    g = rows((0, 0, 3, 4), (1, 0, 2, 2), k=1)
    w = walk(g, "zigzag")
    assert w.row.tolist() == [0, 0, 0, 0, 1, 1]
    assert w.pos.tolist() == [0, 1, 2, 3, 0, 1]
    assert w.real.tolist() == [True, True, True, False, True, True]
    got = read(g, src, w, with_next=True)
    assert got.cat.tolist() == [5, 6, 7, 8, 9, 4]
    assert got.tokens().tolist() == [5, 6, 7, 0, 8, 9]
    labels, mask = got.labels(0)
    assert (labels.tolist(), mask.tolist()) == ([6, 7, 0, 0, 9, 4], [1, 1, 0, 0, 1, 1])
    labels, mask = got.labels(1)
    assert (labels.tolist(), mask.tolist()) == ([7, 0, 0, 0, 4, 0], [1, 0, 0, 0, 1, 0])


def test_without_next_the_split_row_ends_unlabelled() -> None:
    src = ArrayTokens.from_sequences([[5, 6, 7], [8, 9, 4]])
    got = read(rows((1, 0, 2, 2), k=1), src, walk(rows((1, 0, 2, 2), k=1), "zigzag"),
               with_next=False)
    assert got.cat.tolist() == [8, 9]
    assert got.labels(0)[0].tolist() == [9, 0]


def test_mtp_depth_d_is_the_lm_label_d_positions_on() -> None:
    # Zigzag over 2 ranks, a split sample and a filler: at every slot whose position d on is
    # this rank's, depth d's target is that slot's LM label (the two come from one walk).
    src = ArrayTokens.from_sequences([[11, 12, 13], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]])
    g = [(0, 0, 3, 4), (2, 0, 4, 8), (-1, 0, 0, 4)]
    for r in (0, 1):
        gr = rows(*g, cp_rank=r)
        got = read(gr, src, walk(gr, "zigzag"), with_next=True)
        mtp = mtp_inputs(gr, src, layout="zigzag", depth=2)
        for d in (1, 2):
            want, want_mask = got.labels(d)
            assert mtp.labels[d - 1].tolist() == want.tolist()
            assert mtp.loss_mask[d - 1].tolist() == want_mask.astype(np.float32).tolist()
    # By hand. Rank 1 holds positions 1, 2 of row 0 and 2..5 of row 1 (tokens 0..3 of sample 2,
    # which continues with 35): depth 1 of position 2 is the label of position 3, i.e. 35.
    mtp = mtp_inputs(rows(*g, cp_rank=1), src, layout="zigzag", depth=2)
    assert mtp.labels[0].tolist() == [0, 0, 35, 0, 0, 0, 0, 0]
    assert not mtp.loss_mask[1].any()
    # Rank 0 holds positions 0, 3 of row 0 and 0, 1, 6, 7 of row 1: depth 2 of positions 0 and 1
    # are the labels of positions 2 and 3 (34, 35).
    mtp = mtp_inputs(rows(*g, cp_rank=0), src, layout="zigzag", depth=2)
    assert mtp.labels[1].tolist() == [0, 0, 34, 35, 0, 0, 0, 0]
    assert mtp.loss_mask[1].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
