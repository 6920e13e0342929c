from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from planner.planfile.io import PlanFile, write_plan
from planner.planfile.schema import PlanHeader, arrow_schema, step_batch
from planner.planfile.validate import validate
from tests.planner.planfile import handmade
from tests.runtime.planfactory import header, write


def batches(h=None, steps=None):  # noqa: ANN001, ANN201
    h = h or handmade.header()
    schema = arrow_schema(h)
    return [step_batch(schema, c) for c in (steps or handmade.steps())]


def test_handmade_plan_is_valid() -> None:
    validate(handmade.header(), batches(), handmade.LENGTHS)


def _broken(mutate) -> list[dict[str, np.ndarray]]:  # noqa: ANN001
    steps = handmade.steps()
    mutate(steps)
    return steps


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s[0]["cp_size"].__setitem__(4, 3), "not in cp_sizes"),
        (lambda s: s[0]["rank_start"].__setitem__(1, 0), "cover 3 rank slots, pool is 4"),
        (lambda s: s[0]["cp_size"].__setitem__(1, 2), "not an aligned block"),
        (lambda s: s[0]["padded_tokens"].__setitem__(0, 20), "capacity"),
        (lambda s: s[0]["padded_tokens"].__setitem__(3, 3), "not a multiple of 4"),
        (lambda s: s[0]["padded_tokens"].__setitem__(0, 9), "padded_tokens < num_tokens"),
        (lambda s: s[0]["step"].__setitem__(0, 1), "column step"),
        (lambda s: s[1]["sample_index"].__setitem__(0, 0), "sample 0 has a segment|overlap"),
        (lambda s: s[1]["sample_index"].__setitem__(0, -1) or s[1]["num_tokens"].__setitem__(0, 0),
         "sample 3 is placed nowhere"),
        (lambda s: s[0]["num_tokens"].__setitem__(4, 39), "placed tokens \\[0, 39\\) of 40"),
        (lambda s: s[0]["microbatch"].__setitem__(4, 2), "microbatches are not numbered"),
    ],
)
def test_validate_names_each_broken_invariant(mutate, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        validate(handmade.header(), batches(steps=_broken(mutate)), handmade.LENGTHS)


def test_validate_vpp_multiple_and_fingerprint() -> None:
    from planner.planfile.schema import ParallelInfo

    h = handmade.header(parallel=ParallelInfo(dp=2, cp=2, tp=1, pp=2, vpp=2,
                                              sequence_parallel=False, pool_size=4,
                                              microbatch_group_size=2))
    with pytest.raises(ValueError, match="not a multiple of the microbatch group size 2"):
        validate(h, batches(h), handmade.LENGTHS)
    with pytest.raises(ValueError, match="fingerprint"):
        validate(handmade.header(), batches(), handmade.LENGTHS + 1)


def test_dropped_and_truncated_samples_are_honoured() -> None:
    steps = handmade.steps()
    steps[1]["sample_index"][0] = -1
    steps[1]["num_tokens"][0] = 0
    steps[1]["padded_tokens"][0] = 1
    steps[0]["num_tokens"][4] = 33
    steps[0]["padded_tokens"][4] = 40
    h = handmade.header(stats={"dropped_samples": [3], "truncated_samples": [[1, 33]]})
    validate(h, batches(h, steps), handmade.LENGTHS)


def test_unknown_format_version_is_refused(tmp_path) -> None:  # noqa: ANN001
    h = handmade.header(format_version=3)
    path = write_plan(tmp_path / "v3.arrow", h, batches(h))
    with pytest.raises(ValueError, match="format version 3 is not supported.*reads versions 1, 2"):
        PlanFile(path)


def test_round_trip_and_o1_step_access(tmp_path) -> None:  # noqa: ANN001
    h = handmade.header()
    path = write_plan(tmp_path / "p.arrow", h, batches(h))
    with PlanFile(path) as f:
        assert f.header == h
        assert f.num_steps == 2
        assert f.step(1).equals(batches(h)[1])
        assert f.schema.metadata == arrow_schema(h).metadata
        validate(f.header, f, handmade.LENGTHS)
    # plain pyarrow reads it too (the notebook contract)
    t = ipc.open_file(pa.memory_map(str(path))).read_all()
    assert t.num_rows == 8
    assert t.schema.field("sample_index").type == pa.int64()


def test_write_is_deterministic_and_atomic(tmp_path) -> None:  # noqa: ANN001
    h = handmade.header()
    a = write_plan(tmp_path / "a.arrow", h, batches(h))
    b = write_plan(tmp_path / "b.arrow", h, batches(h))
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b)]
    assert digest[0] == digest[1]

    def failing():  # noqa: ANN202
        yield batches(h)[0]
        raise RuntimeError("disk full")

    target = tmp_path / "c.arrow"
    target.write_bytes(b"old plan")
    with pytest.raises(RuntimeError):
        write_plan(target, h, failing(), check=False, overwrite=True)
    assert target.read_bytes() == b"old plan"
    assert sorted(os.listdir(tmp_path)) == ["a.arrow", "b.arrow", "c.arrow"]


def test_header_is_a_json_object_under_one_key() -> None:
    import json

    meta = arrow_schema(handmade.header()).metadata
    assert list(meta) == [b"dcp.plan", b"dcp.plan.sha256"]
    d = json.loads(meta[b"dcp.plan"])
    for key in ("format_version", "dataset", "parallel", "capacity_tokens_per_rank", "cp_sizes",
                "layout", "global_batch", "seed", "cost_model", "stats"):
        assert key in d
    assert d["parallel"]["pool_size"] == 4


def test_validate_negative_microbatch_is_named() -> None:
    steps = handmade.steps()
    steps[0]["microbatch"][:] = np.array([-1, -1, -1, -1, 0])
    with pytest.raises(ValueError, match="step 0: microbatches are not numbered"):
        validate(handmade.header(), batches(steps=steps), handmade.LENGTHS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"epochs": ((0, 1), (0, 1))}, "epoch 1 starts at step 0, expected 1"),
        ({"stats": {"dropped_samples": [99], "truncated_samples": []}},
         "dropped_samples holds sample 99, the dataset has 6"),
        ({"stats": {"dropped_samples": [], "truncated_samples": [[99, 3]]}},
         "truncated_samples holds sample 99, the dataset has 6"),
        ({"layout": "foo"}, "layout 'foo'"),
        ({"capacity_tokens_per_rank": 0}, "capacity_tokens_per_rank 0"),
    ],
)
def test_validate_names_a_broken_header(overrides: dict[str, object], message: str) -> None:
    h = handmade.header(**overrides)
    with pytest.raises(ValueError, match=f"plan: invalid plan:\n  header: .*{message}"):
        validate(h, batches(h), handmade.LENGTHS)


def test_validate_zero_microbatch_group_size_is_an_error() -> None:
    from planner.planfile.schema import ParallelInfo

    h = handmade.header(parallel=ParallelInfo(dp=2, cp=2, tp=1, pp=2, vpp=2,
                                              sequence_parallel=False, pool_size=4,
                                              microbatch_group_size=0))
    with pytest.raises(ValueError, match="header: microbatch_group_size 0"):
        validate(h, batches(h), handmade.LENGTHS)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "header is not a JSON object"),
        (handmade.header().to_json().replace('"epochs":[[0,2]]', '"epochs":[[0]]'),
         "header is missing or has a malformed field"),
    ],
)
def test_malformed_header_json_names_the_source(text: str, message: str) -> None:
    from planner.planfile.schema import PlanHeader

    with pytest.raises(ValueError, match=f"p.arrow: {message}"):
        PlanHeader.from_json(text, source="p.arrow")


def test_write_plan_validates_and_writes_nothing_when_invalid(tmp_path) -> None:  # noqa: ANN001
    steps = handmade.steps()
    steps[0]["padded_tokens"][0] = 20  # over capacity
    h = handmade.header()
    target = tmp_path / "bad.arrow"
    with pytest.raises(ValueError, match="capacity"):
        write_plan(target, h, batches(h, steps), lengths=handmade.LENGTHS)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_pad_to_multiple_round_trips_and_is_enforced(tmp_path: Path) -> None:
    lengths = np.array([5, 7], dtype=np.int64)
    hdr = replace(header(lengths, dp=1, cp=1, capacity=64), pad_to_multiple=8)
    assert PlanHeader.from_json(hdr.to_json()) == hdr
    assert '"pad_to_multiple":8' in hdr.to_json()
    ok = [[(0, 0, 1, 0, 0, 5, 8), (0, 0, 1, 1, 0, 7, 8)]]
    write(tmp_path / "ok.arrow", hdr, ok)
    bad = [[(0, 0, 1, 0, 0, 5, 5), (0, 0, 1, 1, 0, 7, 8)]]
    with pytest.raises(ValueError, match="not a multiple of 8"):
        write(tmp_path / "bad.arrow", hdr, bad)
    with pytest.raises(ValueError, match="pad_to_multiple 0"):
        write(tmp_path / "zero.arrow", replace(hdr, pad_to_multiple=0), ok)
