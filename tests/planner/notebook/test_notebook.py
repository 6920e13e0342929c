"""planner.notebook.view: the per-step summary agrees with the header's stats."""

from __future__ import annotations

import html
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
    # The per-step gain columns weight back to the header's totals (ratios rounded to 1e-4).
    sim = np.asarray(summary.column("simulated_s"))
    for name, key in (("static-cp", "vs_static_cp"), ("megatron-greedy", "vs_megatron")):
        ratio = summary.column(key).to_pylist()
        recorded = stats["baselines"][name]
        if "not_scored" in recorded:  # VPP: Megatron is not scored; the column says nothing
            assert stats[key] is None
            assert set(ratio) == {None}
            continue
        assert ratio == recorded["per_step"]
        ok = np.array([r is not None for r in ratio])
        assert ok.sum() == len(ratio) - recorded["infeasible_steps"]
        assert min(r for r in ratio if r is not None) >= 1.0
        if stats[key] is None:  # a step static CP cannot run (a sample longer than cp x C)
            assert recorded["infeasible_steps"] > 0
            continue
        assert np.isclose((np.asarray(ratio) * sim).sum() / sim.sum(), stats[key], rtol=1e-4)


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
    s = plan.header.stats
    assert html.escape(f"{s['vs_megatron']:.3f}x over Megatron's greedy") in page


def test_old_plans_say_the_gain_was_not_recorded(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    golden = sorted((Path(__file__).resolve().parents[3] / "plans" / "golden").glob("*.arrow"))
    view = read_plan(golden[0])
    assert set(view.summary().column("vs_static_cp").to_pylist()) == {None}
    assert "not recorded" in view._repr_html_()
    assert main(["show", str(golden[0]), "--steps", "0:2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("gain: not recorded")
    assert out[-1].startswith("cost: dense-7b-h200: provenance not recorded")
    assert out[1].split()[8:10] == ["-", "-"]     # vs_static_cp, vs_megatron of step 0


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
    from matplotlib.figure import Figure

    # Every plot function returns a Figure (plot_step_load and plot_cp_mix returned Axes).
    fig = view.plot_cp_mix()
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
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
    fig = view.plot_step_load(0)
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    ticks = ax.get_xticks()
    assert np.allclose(ticks, np.round(ticks))                 # integer rank ticks
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(x.startswith("lower bound") for x in labels)
    assert any(x.startswith("microbatch 0") for x in labels)
    fig = view.plot_summary()
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 4
    # Given axes, a plot draws there and returns the figure that holds them.
    from planner.notebook.plot import plot_gain

    mine, (left, right) = plt.subplots(1, 2)
    assert view.plot_cp_mix(ax=right) is mine
    assert view.plot_step_load(0, ax=left) is mine
    assert plot_gain(view.header, view.summary()) is not mine
    assert right.get_title().startswith("CP sizes")
    gain = fig.axes[1]
    assert gain.get_title().startswith("predicted gain")
    labels = [t.get_text() for t in gain.get_legend().get_texts()]
    s = plan.header.stats
    assert f"vs Megatron's greedy ({s['vs_megatron']:.3f}x" in " ".join(labels)
    fig.savefig(tmp_path / "summary.png")
    plt.close("all")
