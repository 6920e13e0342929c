"""Streaming: plan, validate and write step by step; the file is the one make_plan writes."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import PlanStream, make_plan
from planner.planfile.coverage import Coverage
from planner.planfile.io import write_plan, write_plan_stream
from planner.planfile.schema import COLUMN_NAMES, PlanHeader, arrow_schema, step_batch
from planner.planfile.validate import validate
from planner.sources.lengths import LengthTable

COST = load_cost_model("dense-7b-h200")


def _table(lengths: np.ndarray) -> LengthTable:
    return LengthTable(path="mem.txt", format="text", lengths=lengths,
                       skipped=np.zeros(0, np.int64))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kw", [dict(), dict(epochs=2, drop_last=True, workers=2),
                                dict(long_sequences="split", effort="fast")])
def test_streamed_file_is_the_in_memory_one(tmp_path: Path, kw: dict[str, object]) -> None:
    rng = np.random.default_rng(5)
    lengths = rng.lognormal(6.5, 1.3, 3000).astype(np.int64).clip(1, 40_000)
    config = PlannerConfig(parallel=ParallelConfig(dp=4, cp=2), capacity_tokens_per_rank=8192,
                           global_batch_size=96, **{"long_sequences": "split", **kw})
    plan = make_plan(_table(lengths), config, COST)
    a = write_plan(tmp_path / "a.arrow", plan.header, plan.record_batches(), lengths=lengths)
    stream = PlanStream(_table(lengths), config, COST)
    b = write_plan_stream(tmp_path / "b.arrow", stream.steps(), stream.header, lengths=lengths)
    assert _digest(a) == _digest(b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.arrow", "b.arrow"]  # no spill left


def test_an_invalid_streamed_plan_writes_nothing(tmp_path: Path) -> None:
    lengths = np.full(64, 500, np.int64)
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=2), capacity_tokens_per_rank=4096,
                           global_batch_size=16)
    stream = PlanStream(_table(lengths), config, COST)
    wrong = lengths.copy()
    wrong[3] += 1  # another dataset: fingerprint and coverage fail
    with pytest.raises(ValueError, match="fingerprint"):
        write_plan_stream(tmp_path / "p.arrow", stream.steps(), stream.header, lengths=wrong)
    assert list(tmp_path.iterdir()) == []


def test_a_step_found_invalid_after_others_were_copied_leaves_nothing(tmp_path: Path) -> None:
    # Validation and the copy into the plan's temporary run in one pass: steps before the bad
    # one are already in the temporary when its epoch's errors are raised.
    lengths = np.full(64, 500, np.int64)
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=2), capacity_tokens_per_rank=4096,
                           global_batch_size=16, epochs=2)
    stream = PlanStream(_table(lengths), config, COST)

    def corrupt_last_of_first_epoch() -> Iterator[dict[str, np.ndarray]]:
        for i, cols in enumerate(stream.steps()):
            if i == 3:
                cols = {**cols, "microbatch": cols["microbatch"] + 1}  # no microbatch 0
            yield cols

    with pytest.raises(ValueError, match="step 3"):
        write_plan_stream(tmp_path / "p.arrow", corrupt_last_of_first_epoch(), stream.header,
                          lengths=lengths)
    assert list(tmp_path.iterdir()) == []


def test_header_needs_every_step() -> None:
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=1), capacity_tokens_per_rank=4096,
                           global_batch_size=4)
    stream = PlanStream(_table(np.full(16, 100, np.int64)), config, COST)
    with pytest.raises(RuntimeError, match="consume steps"):
        stream.header()


def _two_steps(segments: list[list[tuple[int, int, int]]]
               ) -> tuple[PlanHeader, list[pa.RecordBatch]]:
    """A 1-rank plan whose step i holds ``segments[i]`` as (sample, offset, tokens), one
    microbatch per segment."""
    plan = make_plan(_table(np.array([30, 30], np.int64)),
                     PlannerConfig(parallel=ParallelConfig(dp=1, cp=1),
                                   capacity_tokens_per_rank=64, global_batch_size=1), COST)
    header = plan.header
    schema = arrow_schema(header)
    batches = []
    for i, segs in enumerate(segments):
        n = len(segs)
        cols = {"step": np.full(n, i), "microbatch": np.arange(n), "rank_start": np.zeros(n),
                "cp_size": np.ones(n), "sample_index": np.array([s for s, _, _ in segs]),
                "token_offset": np.array([o for _, o, _ in segs]),
                "num_tokens": np.array([t for _, _, t in segs]),
                "padded_tokens": np.array([t for _, _, t in segs])}
        assert tuple(cols) == COLUMN_NAMES
        batches.append(step_batch(schema, cols))
    return header, batches


def test_coverage_accepts_a_sample_split_over_steps_in_any_order() -> None:
    # Sample 0's pieces arrive [20, 30) first, then [0, 10) and [10, 20): still a tiling.
    header, batches = _two_steps([[(0, 20, 10), (1, 0, 30)], [(0, 0, 10), (0, 10, 10)]])
    validate(header, batches, np.array([30, 30], np.int64))


@pytest.mark.parametrize(("second", "message"), [
    ([(0, 5, 10)], "sample 0 has a segment at token 5, expected 30"),
    ([(0, 0, 30)], "sample 0 has a segment at token 0, expected 30"),
])
def test_coverage_finds_overlaps_across_steps(second: list[tuple[int, int, int]],
                                              message: str) -> None:
    header, batches = _two_steps([[(0, 0, 30), (1, 0, 30)], second])
    with pytest.raises(ValueError, match=message):
        validate(header, batches, np.array([30, 30], np.int64))


@given(seed=st.integers(0, 2**32 - 1), samples=st.integers(1, 12), steps=st.integers(1, 4),
       damage=st.sampled_from(["none", "overlap", "gap", "duplicate", "range"]))
@settings(max_examples=200, deadline=None)
def test_coverage_fast_path_agrees_with_sorting(seed: int, samples: int, steps: int,
                                                damage: str) -> None:
    """Coverage.add's one-pass path (every segment extends its prefix) records what sorting
    the step records, and leaves every misfit to it: the same prefixes, placements and
    verdicts, split samples in any row order and step included."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, samples)
    segs = []
    for s in range(samples):
        cuts = np.unique(np.r_[0, rng.integers(1, lengths[s] + 1, rng.integers(0, 3)),
                               lengths[s]])
        segs += [(s, int(a), int(b - a)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    if damage == "overlap" and segs:
        s, o, t = segs[int(rng.integers(len(segs)))]
        segs.append((s, o, t + 1))
    elif damage == "gap" and segs:
        segs.pop(int(rng.integers(len(segs))))
    elif damage == "duplicate" and segs:
        segs.append(segs[int(rng.integers(len(segs)))])
    elif damage == "range":
        segs.append((samples + 3, 0, 5))
    rng.shuffle(segs)
    where = rng.integers(0, steps, len(segs))
    header, _ = _two_steps([[(0, 0, 1)]])
    header = dataclasses.replace(header, dataset=dataclasses.replace(header.dataset,
                                                                     num_samples=samples))
    fast, slow = Coverage(header, 0), Coverage(header, 0)
    for i in range(steps):
        step = [segs[j] for j in range(len(segs)) if where[j] == i]
        cols = [np.array([x[k] for x in step] + [-1], np.int64) for k in range(3)]
        cols[2][-1] = 0  # a filler row
        fast.add(*cols)
        if slow.error is None:  # what add did before its one-pass path
            slow._add_sorted(*cols)
        assert (fast.ends == slow.ends).all()
        assert (fast.placed == slow.placed).all()
        assert fast.error == slow.error
        assert [[w.tolist() for w in x] for x in fast.waiting] == \
            [[w.tolist() for w in x] for x in slow.waiting]
    assert fast.finish(lengths) == slow.finish(lengths)
