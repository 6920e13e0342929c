"""Every plan in plans/golden/ must stay readable and valid forever.

New format versions add files here; they never rewrite old ones. Each golden plan was made from
data/sample.jsonl (see plans/README.md for the commands), so coverage is checked to the last token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from planner import read_plan
from planner.planfile.io import PlanFile
from planner.planfile.validate import validate
from planner.sources.lengths import read_lengths

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = sorted((ROOT / "plans" / "golden").glob("*.arrow"))


@pytest.fixture(scope="module")
def sample_lengths():  # noqa: ANN201
    return read_lengths(ROOT / "data" / "sample.jsonl").lengths


def test_there_are_golden_plans() -> None:
    assert len(GOLDEN) >= 2


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name)
def test_golden_plan_reads_and_validates(path: Path, sample_lengths) -> None:  # noqa: ANN001
    with PlanFile(path) as f:
        assert f.header.format_version == 1
        validate(f.header, f, sample_lengths, source=str(path))
    view = read_plan(path)
    summary = view.summary()
    assert summary.num_rows == view.num_steps
    assert view.table.num_rows == sum(view.step(i).num_rows for i in range(view.num_steps))
