"""runtime.data.plan_reader: O(1) steps, job and dataset checks, and each rank's group rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from planner.planfile.schema import HEADER_KEY
from runtime.data.plan_reader import PlanReader
from runtime.dist.topology import Topology
from tests.runtime import planfactory

LENGTHS = np.array([10, 40, 7, 16, 3, 12], dtype=np.int64)

# Pool of 4. Step 0: mb 0 = groups (0,1) (1,1) (2,2); mb 1 = (0,4). Step 1: (0,1) (1,1) (2,2).
STEPS: list[list[planfactory.Row]] = [
    [(0, 0, 1, 0, 0, 10, 10), (0, 1, 1, 2, 0, 7, 7), (0, 2, 2, 5, 0, 12, 12),
     (0, 2, 2, 4, 0, 3, 4), (1, 0, 4, 1, 0, 40, 40)],
    [(0, 0, 1, 3, 0, 16, 16), (0, 1, 1, -1, 0, 0, 1), (0, 2, 2, -1, 0, 0, 4)],
]


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    hdr = planfactory.header(LENGTHS, dp=2, cp=2, capacity=16, num_steps=2)
    return planfactory.write(tmp_path / "p.arrow", hdr, STEPS)


def test_steps_and_groups(plan: Path) -> None:
    reader = PlanReader(plan)
    assert reader.num_steps == 2
    assert reader.pool_size == 4
    assert reader.layout == "zigzag"
    step = reader.step(0)
    assert step.num_microbatches == 2
    g = step.group_for(0, 3)
    assert (g.microbatch, g.rank_start, g.cp_size, g.cp_rank) == (0, 2, 2, 1)
    assert g.sample_index.tolist() == [5, 4]  # packing order kept
    assert g.num_tokens.tolist() == [12, 3]
    assert g.padded_tokens.tolist() == [12, 4]
    assert g.token_offset.tolist() == [0, 0]
    assert step.group_for(0, 2).cp_rank == 0
    assert step.group_for(0, 1).sample_index.tolist() == [2]
    for r in range(4):
        g = step.group_for(1, r)
        assert (g.rank_start, g.cp_size, g.cp_rank) == (0, 4, r)
        assert g.sample_index.tolist() == [1]
    s1 = reader.step(1)  # steps are independent: no need to read step 0 first
    assert s1.num_microbatches == 1
    assert s1.group_for(0, 2).sample_index.tolist() == [-1]
    with pytest.raises(ValueError, match="microbatch 1 out of range"):
        s1.group_for(1, 0)
    with pytest.raises(ValueError, match="pool rank 4 out of range"):
        s1.group_for(0, 4)
    with pytest.raises(IndexError, match="step 2 out of range"):
        reader.step(2)


def test_union_of_ranks_is_the_step(plan: Path) -> None:
    reader = PlanReader(plan)
    for i in range(reader.num_steps):
        step = reader.step(i)
        seen = []
        for m in range(step.num_microbatches):
            for r in range(reader.pool_size):
                g = step.group_for(m, r)
                if g.cp_rank == 0:
                    seen += [(m, g.rank_start, int(s)) for s in g.sample_index]
        want = [(r[0], r[1], r[3]) for r in STEPS[i]]
        assert sorted(seen) == sorted(want)


def test_check_job(plan: Path) -> None:
    reader = PlanReader(plan)
    reader.check_job(Topology(world_size=4, rank=3, dp=2, cp=2))
    reader.check_job(Topology(world_size=4, rank=0, dp=4, cp=1))  # same pool, other split
    with pytest.raises(ValueError, match=r"plan built for world_size=4 \(dp 2 x cp 2 x tp 1 x pp "
                                         r"1\), got world_size=8 \(dp 2 x cp 2 x tp 2 x pp 1\)"):
        reader.check_job(Topology(world_size=8, rank=0, dp=2, cp=2, tp=2))
    with pytest.raises(ValueError, match="got world_size=8 .dp 2 x cp 2 x tp 1 x pp 2"):
        reader.check_job(Topology(world_size=8, rank=0, dp=2, cp=2, pp=2))
    with pytest.raises(ValueError, match="got world_size=8 .dp 4 x cp 2"):
        reader.check_job(Topology(world_size=8, rank=0, dp=4, cp=2))


def test_check_dataset(plan: Path) -> None:
    reader = PlanReader(plan)
    reader.check_dataset(LENGTHS)
    other = LENGTHS.copy()
    other[2] += 1
    with pytest.raises(ValueError, match=r"fingerprint sha256:\w+ \(test\), got sha256:\w+"):
        reader.check_dataset(other)
    with pytest.raises(ValueError, match="dataset of 6 samples .test., got 5"):
        reader.check_dataset(LENGTHS[:5])


def test_validate_on_load(tmp_path: Path) -> None:
    hdr = planfactory.header(LENGTHS, dp=2, cp=2, capacity=16, num_steps=2)
    bad = [list(STEPS[0]), list(STEPS[1])]
    bad[0][4] = (1, 0, 4, 1, 0, 40, 42)  # 42 is not a multiple of 2k = 8
    path = planfactory.write(tmp_path / "bad.arrow", hdr, bad, check=False)
    with pytest.raises(ValueError, match="padded to 42, not a multiple of 8"):
        PlanReader(path)
    reader = PlanReader(path, validate=False)  # trusted: loads, and replays what it holds
    assert reader.step(0).group_for(1, 0).padded_tokens.tolist() == [42]


def test_unknown_format_version(tmp_path: Path, plan: Path) -> None:
    with pa.memory_map(str(plan)) as src:
        table = ipc.open_file(src).read_all()
    meta = json.loads(table.schema.metadata[HEADER_KEY])
    meta["format_version"] = 3
    table = table.replace_schema_metadata({HEADER_KEY: json.dumps(meta).encode()})
    path = tmp_path / "v3.arrow"
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(ValueError, match="version 3 is not supported .this dcp-planner reads "
                                         "versions 1, 2"):
        PlanReader(path)


def test_random_plans_validate_and_partition(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 100, size=50)
    for dp, cp in ((1, 6), (4, 2), (3, 4)):
        path = planfactory.random_plan(tmp_path / f"{dp}x{cp}.arrow", lengths, dp=dp, cp=cp,
                                       num_steps=3, microbatches=3, seed=dp)
        reader = PlanReader(path)
        for i in range(reader.num_steps):
            step = reader.step(i)
            for m in range(step.num_microbatches):
                groups = {(step.group_for(m, r).rank_start, step.group_for(m, r).cp_size)
                          for r in range(dp * cp)}
                assert sum(k for _, k in groups) == dp * cp
