"""planner.notebook.view: the per-step summary agrees with the header's stats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner import read_plan
from planner.plan import make_plan
from planner.planfile.io import write_plan
from tests.planner.test_plan import COST, config, long_tail, table


@pytest.mark.parametrize("par", [{}, {"pp": 2, "vpp": 2}, {"tp": 4, "sequence_parallel": True}])
def test_summary_sums_to_header_stats(tmp_path: Path, par: dict[str, object]) -> None:
    tab = table(long_tail(300, 1))
    plan = make_plan(tab, config(effort="fast", **par), COST)
    path = write_plan(tmp_path / "p.arrow", plan.header, plan.record_batches())
    summary = read_plan(path).summary()
    stats = plan.header.stats
    assert np.isclose(sum(summary.column("lower_bound_s").to_pylist()),
                      stats["lower_bound_seconds"], rtol=1e-12)
    assert np.isclose(sum(summary.column("simulated_s").to_pylist()),
                      stats["simulated_seconds"], rtol=1e-12)
    assert sum(summary.column("microbatches").to_pylist()) == stats["num_microbatches"]
    # The per-step tight bound is the one the planner summed into the header.
    assert np.isclose(sum(summary.column("tight_bound_s").to_pylist()),
                      stats["malleable_lower_bound_seconds"], rtol=1e-9)
    assert np.isclose(max(summary.column("time_over_tight_bound").to_pylist()),
                      stats["time_over_tight_bound_max"], rtol=1e-9)
