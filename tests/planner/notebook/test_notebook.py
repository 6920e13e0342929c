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


def test_repr_and_html_name_the_key_figures(tmp_path: Path) -> None:
    plan = make_plan(table(long_tail(300, 1)), config(effort="fast"), COST)
    path = write_plan(tmp_path / "p.arrow", plan.header, plan.record_batches())
    view = read_plan(path)
    text = repr(view)
    assert text.startswith("<PlanView ")
    assert "object at 0x" not in text
    assert f"{view.num_steps} (1 epoch(s))" in text
    assert "dp 4 x cp 2 = 8" in text
    page = view._repr_html_()
    assert page.startswith("<table>")
    assert "slot fill" in page
    assert "lower bound" in page


def test_rank_time_and_token_shares_add_up(tmp_path: Path) -> None:
    plan = make_plan(table(long_tail(600, 2)), config(effort="fast"), COST)
    path = write_plan(tmp_path / "p.arrow", plan.header, plan.record_batches())
    view = read_plan(path)
    s = view.summary()
    sizes = plan.header.cp_sizes
    tokens = sum(np.asarray(s.column(f"tokens_cp{k}")) for k in sizes)
    assert np.array_equal(tokens, np.asarray(s.column("real_tokens")))
    # Rank-seconds per size: every group's k x t, so a group of 8 counts 8 ranks.
    cols = view.step_columns(0)
    first = np.flatnonzero(np.r_[True, (np.diff(cols["microbatch"]) != 0)
                                 | (np.diff(cols["rank_start"]) != 0)])
    ends = np.r_[first[1:], len(cols["microbatch"])]
    want = {k: 0.0 for k in sizes}
    for a, b in zip(first, ends, strict=True):
        k = int(cols["cp_size"][a])
        want[k] += k * COST.group_time(k, cols["padded_tokens"][a:b])
    for k in sizes:
        assert np.isclose(s.column(f"rank_seconds_cp{k}")[0].as_py(), want[k], rtol=1e-12)


@pytest.mark.parametrize("num_samples", [32 * 32, 2000 * 32])
def test_plots_at_32_and_2000_steps(tmp_path: Path, num_samples: int) -> None:
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    plan = make_plan(table(long_tail(num_samples, 3)), config(effort="fast"), COST)
    path = write_plan(tmp_path / "p.arrow", plan.header, plan.record_batches())
    view = read_plan(path)
    ax = view.plot_cp_mix()
    bars = ax.patches
    # Binned past 120 steps; the shares of every bin stack to 100%.
    from planner.notebook.plot import step_bins

    num_bins = len(step_bins(view.num_steps)) - 1
    assert num_bins == (view.num_steps if view.num_steps <= 120 else 118)
    assert len(bars) == len(plan.header.cp_sizes) * num_bins
    tops = {}
    for b in bars:
        tops[round(b.get_x(), 6)] = max(tops.get(round(b.get_x(), 6), 0.0),
                                        b.get_y() + b.get_height())
    assert np.allclose(list(tops.values()), 100.0)
    assert ax.get_legend() is not None
    ax = view.plot_step_load(0)
    ticks = ax.get_xticks()
    assert np.allclose(ticks, np.round(ticks))                 # integer rank ticks
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(x.startswith("lower bound") for x in labels)
    assert any(x.startswith("microbatch 0") for x in labels)
    fig = view.plot_summary()
    assert len(fig.axes) == 3
    fig.savefig(tmp_path / "summary.png")
    plt.close("all")
