"""runtime.data.batch: packed buffers, labels, positions and loss masks, per CP rank and stage."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.data.batch import MicrobatchInputs, build_microbatch, to_device
from runtime.data.plan_reader import GroupRows, PlanReader
from runtime.data.shard import shard_indices_np
from runtime.data.tokens import ArrayTokens
from tests.runtime import planfactory


def t(x: torch.Tensor | None) -> torch.Tensor:
    """The tensor, asserting that this stage has it."""
    assert x is not None
    return x


SAMPLES = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35, 36]]


def rows(*r: tuple[int, int, int, int], k: int = 2, cp_rank: int = 0) -> GroupRows:
    a = np.array(r, dtype=np.int64).reshape(-1, 4)
    return GroupRows(microbatch=0, rank_start=0, cp_size=k, cp_rank=cp_rank,
                     sample_index=a[:, 0], token_offset=a[:, 1], num_tokens=a[:, 2],
                     padded_tokens=a[:, 3])


def test_hand_computed_zigzag() -> None:
    src = ArrayTokens.from_sequences(SAMPLES)
    # Sample 0 whole, the first 4 tokens of sample 2 (which continues), a filler; k = 2, h = 1.
    g = [(0, 0, 3, 4), (2, 0, 4, 4), (-1, 0, 0, 4)]
    want = {  # full buffer: tokens, positions, labels, mask
        0: dict(tokens=[11, 0, 31, 34, 0, 0], position_ids=[0, 0, 0, 3, 0, 0],
                labels=[12, 0, 32, 35, 0, 0], loss_mask=[1, 0, 1, 1, 0, 0]),
        1: dict(tokens=[12, 13, 32, 33, 0, 0], position_ids=[1, 2, 1, 2, 0, 0],
                labels=[13, 0, 33, 34, 0, 0], loss_mask=[1, 0, 1, 1, 0, 0]),
    }
    for r in (0, 1):
        mb = build_microbatch(rows(*g, cp_rank=r), src, layout="zigzag")
        for name, values in want[r].items():
            assert getattr(mb, name).tolist() == values, (r, name)
        assert mb.cu_seqlens.tolist() == [0, 3, 7, 7]
        assert mb.cu_seqlens_padded.tolist() == [0, 4, 8, 12]
        assert mb.cu_seqlens.dtype == mb.cu_seqlens_padded.dtype == torch.int32
        assert t(mb.tokens).dtype == t(mb.labels).dtype == t(mb.position_ids).dtype == torch.int64
        assert t(mb.loss_mask).dtype == torch.float32
        assert (mb.max_seqlen, mb.cp_size, mb.cp_rank, mb.num_tokens) == (4, 2, r, 7)


def test_module_docstring_example() -> None:
    src = ArrayTokens.from_sequences([[5, 6, 7], [8, 9, 4]])
    mb = build_microbatch(rows((0, 0, 3, 4), (1, 0, 2, 2), k=1), src, layout="zigzag")
    assert t(mb.tokens).tolist() == [5, 6, 7, 0, 8, 9]
    assert t(mb.position_ids).tolist() == [0, 1, 2, 0, 0, 1]
    assert t(mb.labels).tolist() == [6, 7, 0, 0, 9, 4]
    assert t(mb.loss_mask).tolist() == [1, 1, 0, 0, 1, 1]


def test_last_segment_of_split_sample_is_masked_at_its_end() -> None:
    src = ArrayTokens.from_sequences(SAMPLES)
    mb = build_microbatch(rows((2, 4, 2, 2), k=1), src, layout="contiguous")
    assert t(mb.tokens).tolist() == [35, 36]
    assert t(mb.labels).tolist() == [36, 0]
    assert t(mb.loss_mask).tolist() == [1, 0]
    assert t(mb.position_ids).tolist() == [0, 1]


def test_pipeline_stages() -> None:
    src = ArrayTokens.from_sequences(SAMPLES)
    g = rows((1, 0, 5, 8), (0, 0, 3, 4), k=2, cp_rank=1)
    first = build_microbatch(g, src, layout="zigzag", is_first_stage=True, is_last_stage=False)
    last = build_microbatch(g, src, layout="zigzag", is_first_stage=False, is_last_stage=True)
    middle = build_microbatch(g, src, layout="zigzag", is_first_stage=False, is_last_stage=False)
    both = build_microbatch(g, src, layout="zigzag")
    assert first.labels is None
    assert first.loss_mask is None
    assert torch.equal(t(first.tokens), t(both.tokens))
    assert torch.equal(t(first.position_ids), t(both.position_ids))
    assert last.tokens is None
    assert last.position_ids is None
    assert torch.equal(t(last.labels), t(both.labels))
    assert torch.equal(t(last.loss_mask), t(both.loss_mask))
    assert middle.tokens is middle.labels is middle.position_ids is middle.loss_mask is None
    for mb in (first, last, middle):
        assert torch.equal(mb.cu_seqlens, both.cu_seqlens)
        assert torch.equal(mb.cu_seqlens_padded, both.cu_seqlens_padded)
        assert mb.max_seqlen == 8


class PerRow:
    """A source with ``read`` only (no ``read_many``), counting its calls: the fallback path."""

    def __init__(self, inner: ArrayTokens) -> None:
        self.inner = inner
        self.reads = 0

    @property
    def num_samples(self) -> int:
        return self.inner.num_samples

    def lengths(self) -> np.ndarray:
        return self.inner.lengths()

    def read(self, sample_index: int, offset: int, length: int) -> np.ndarray:
        self.reads += 1
        return self.inner.read(sample_index, offset, length)


def test_middle_stage_reads_nothing() -> None:
    src = PerRow(ArrayTokens(np.arange(10), np.array([0, 4, 10])))
    build_microbatch(rows((1, 0, 6, 8)), src, layout="zigzag", is_first_stage=False,
                     is_last_stage=False)
    assert src.reads == 0
    build_microbatch(rows((1, 0, 6, 8)), src, layout="zigzag")
    assert src.reads == 1


def test_contiguous_reads_only_rows_on_this_rank() -> None:
    src = PerRow(ArrayTokens.from_sequences(SAMPLES))
    g = rows((0, 0, 3, 4), (1, 0, 5, 8), (2, 0, 6, 8), k=4, cp_rank=0)  # 20 slots, 5 per rank
    mb = build_microbatch(g, src, layout="contiguous")  # slots 0..4: row 0 and row 1's first
    assert src.reads == 2
    assert t(mb.tokens).tolist() == [11, 12, 13, 0, 21]
    assert t(mb.labels).tolist() == [12, 13, 0, 0, 22]


def test_bad_rows() -> None:
    src = ArrayTokens.from_sequences(SAMPLES)
    with pytest.raises(ValueError, match="sample 1 has 5 tokens but 4 padded slots"):
        build_microbatch(rows((1, 0, 5, 4)), src, layout="zigzag")
    with pytest.raises(ValueError, match="multiples of 4"):
        build_microbatch(rows((1, 0, 5, 6)), src, layout="zigzag")
    with pytest.raises(ValueError, match=r"sample 0 has 3 tokens, asked for \[1, 4\)"):
        build_microbatch(rows((0, 1, 3, 4)), src, layout="zigzag")


@pytest.mark.parametrize(("layout", "dp", "cp", "tp", "sp"), [
    ("zigzag", 2, 4, 1, False), ("contiguous", 4, 2, 1, False), ("zigzag", 3, 2, 2, True),
    ("contiguous", 2, 2, 3, True),
])
@pytest.mark.parametrize("batched", [True, False], ids=["read_many", "read"])
def test_shards_reassemble_the_reference_buffer(tmp_path: Path, layout: str, dp: int, cp: int,
                                                tp: int, sp: bool, batched: bool) -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 60, size=40)
    seqs = [rng.integers(1, 50_000, size=n) for n in lengths]
    src = ArrayTokens.from_sequences(seqs) if batched else PerRow(ArrayTokens.from_sequences(seqs))
    path = planfactory.random_plan(tmp_path / "p.arrow", lengths, dp=dp, cp=cp, tp=tp,
                                   sequence_parallel=sp, layout=layout, num_steps=2)
    reader = PlanReader(path)
    tp_eff = tp if sp else 1
    for i in range(reader.num_steps):
        step = reader.step(i)
        for m in range(step.num_microbatches):
            for pool_rank in range(reader.pool_size):
                g = step.group_for(m, pool_rank)
                if g.cp_rank != 0:
                    continue  # rebuild each group once, from all of its ranks
                ref = planfactory.reference_group(g, seqs)
                total = len(ref["tokens"])
                full: dict[str, np.ndarray] = {n: np.full(total, -1.0) for n in ref}
                for r in range(g.cp_size):
                    gr = step.group_for(m, g.rank_start + r)
                    assert gr.cp_rank == r
                    mb = build_microbatch(gr, src, layout=layout)
                    assert t(mb.tokens).shape == (total // g.cp_size,)
                    assert t(mb.tokens).shape[0] % tp_eff == 0  # sequence parallelism splits it
                    assert mb.max_seqlen == int(g.padded_tokens.max())
                    idx = shard_indices_np(layout, mb.cu_seqlens_padded, g.cp_size, r)
                    for name in ref:
                        full[name][idx] = getattr(mb, name).numpy()
                for name, values in ref.items():
                    assert full[name].tolist() == values, (i, m, g.rank_start, name)


def test_to_device_cpu_is_identity() -> None:
    mb = build_microbatch(rows((0, 0, 3, 4)), ArrayTokens.from_sequences(SAMPLES),
                          layout="zigzag")
    assert to_device(mb, "cpu") is mb


@pytest.mark.gpu
def test_to_device_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    mb = build_microbatch(rows((0, 0, 3, 4), (1, 0, 5, 8)), ArrayTokens.from_sequences(SAMPLES),
                          layout="zigzag")
    with warnings.catch_warnings():  # torch warns that the debug mode is a prototype
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")  # any host-device sync inside to_device raises
    try:
        dev: MicrobatchInputs = to_device(mb, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for name in ("tokens", "position_ids", "labels", "loss_mask", "cu_seqlens",
                 "cu_seqlens_padded"):
        x = getattr(dev, name)
        assert x.is_cuda
        assert torch.equal(x.cpu(), getattr(mb, name))
    assert dev.cu_seqlens.dtype == torch.int32
    assert dev.max_seqlen == mb.max_seqlen
