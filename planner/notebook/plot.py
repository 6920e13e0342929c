"""Matplotlib plots of a plan that read at 30 steps and at 30,000 (optional dependency).

- ``plot_step_load``: one step as the simulator runs it. Each CP group is one bar spanning its
  ranks (width = CP size, labelled ``cpK``), starting when all its ranks are free, so idle time
  shows as gaps; colour tells microbatches apart; lines mark the simulated step time and the
  step's lower bound.
- ``plot_cp_mix``: the share of the step's rank-time (or real tokens) spent in groups of each CP
  size. Counting groups would hide that one group of 8 occupies 8 ranks; shares do not. Past
  ``max_bars`` steps, consecutive steps are binned (shares of the bin's total).
- ``plot_summary``: one figure, four panels over steps: simulated time over the lower bound,
  the predicted gain (static CP's and Megatron's simulated time over the plan's, per step:
  bars, or past ``max_bars`` steps each bin's min-max band and time-weighted mean), the CP
  share, and microbatches per step (binned alike).

Legends sit outside the axes, to the right, so they never cover data. Every function returns
the matplotlib ``Figure`` (``fig.savefig(...)``, or shown by a notebook); given ``ax``, it draws
there and returns the figure holding ``ax``, so panels compose into a figure of your own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from planner.cost import CostModel, group_seconds
from planner.planfile.schema import PlanHeader

__all__ = ["plot_cp_mix", "plot_gain", "plot_step_load", "plot_summary", "step_bins"]

MAX_BARS = 120
"""Above this many steps, per-step panels are binned into about this many bins."""


def _plt() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    return plt


def _axes(ax: Any, figsize: tuple[float, float] = (10, 4)) -> Any:
    if ax is not None:
        return ax
    _, ax = _plt().subplots(figsize=figsize, layout="constrained")
    return ax


def _legend_outside(ax: Any, **kwargs: Any) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False,
              **kwargs)


def _groups(cols: dict[str, NDArray[Any]]) -> tuple[NDArray[np.intp], ...]:
    """(first row, microbatch, rank_start, cp_size) of every group of a step."""
    mb, start = cols["microbatch"], cols["rank_start"]
    first = np.flatnonzero(np.r_[True, (np.diff(mb) != 0) | (np.diff(start) != 0)])
    return first, mb[first], start[first], cols["cp_size"][first]


def plot_step_load(header: PlanHeader, cost: CostModel, step: int, cols: dict[str, NDArray[Any]],
                   ax: Any = None, *, lower_bound: float | None = None) -> Any:
    """One step's schedule: rank on x, simulated seconds on y, one bar per CP group; returns
    the Figure (``ax``'s when given)."""
    ax = _axes(ax)
    n = header.parallel.pool_size
    padded = cols["padded_tokens"].astype(np.float64)
    first, g_mb, g_start, g_k = _groups(cols)
    s1 = np.add.reduceat(padded, first) if len(first) else np.zeros(0)
    s2 = np.add.reduceat(padded * padded, first) if len(first) else np.zeros(0)
    times = group_seconds(cost, g_k, s1, s2)
    real = np.add.reduceat(cols["num_tokens"].astype(np.int64), first) if len(first) else s1
    finish = np.zeros(n)
    num_mb = int(g_mb.max()) + 1 if len(g_mb) else 0
    cmap = _plt().get_cmap("tab10" if num_mb <= 10 else "viridis")
    colour = [cmap(m if num_mb <= 10 else m / max(num_mb - 1, 1)) for m in range(num_mb)]
    any_filler = False
    for m, r0, k, t, tok in zip(g_mb.tolist(), g_start.tolist(), g_k.tolist(), times, real,
                                strict=True):
        ranks = slice(r0, r0 + k)
        begin = float(finish[ranks].max())
        finish[ranks] = begin + t
        # A group of fillers only (no real tokens) still costs its microbatch: drawn faded.
        any_filler |= not tok
        ax.bar(r0 + (k - 1) / 2, t, width=k - 0.12, bottom=begin, color=colour[m],
               alpha=1.0 if tok else 0.35, edgecolor="black", linewidth=0.6)
        if k > 1 and n <= 64 and tok:
            ax.text(r0 + (k - 1) / 2, begin + t / 2, f"cp{k}", ha="center", va="center",
                    fontsize=8)
    span = float(finish.max()) if n else 0.0
    ax.axhline(span, color="black", linestyle="--", linewidth=1.0,
               label=f"step time {span:.3g} s")
    if lower_bound is not None:
        ax.axhline(lower_bound, color="tab:red", linestyle=":", linewidth=1.5,
                   label=f"lower bound {lower_bound:.3g} s")
    if n <= 32:
        ax.set_xticks(range(n))
    else:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_xlabel("pool rank")
    ax.set_ylabel("simulated seconds")
    ax.set_title(f"step {step}: {num_mb} microbatch(es), groups as bars (width = CP size)")
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    shown = range(num_mb) if num_mb <= 12 else (0, num_mb - 1)
    handles += [Patch(facecolor=colour[m], edgecolor="black", linewidth=0.6,
                      label=f"microbatch {m}") for m in shown]
    if any_filler:
        handles.append(Patch(facecolor="grey", alpha=0.35, edgecolor="black", linewidth=0.6,
                             label="padding-only group"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              frameon=False, fontsize=8)
    return ax.figure


def step_bins(num_steps: int, max_bars: int = MAX_BARS) -> NDArray[np.int64]:
    """Bin edges over steps: one bin per step up to ``max_bars`` steps, else equal-width bins."""
    if num_steps <= max_bars:
        return np.arange(num_steps + 1, dtype=np.int64)
    width = -(-num_steps // max_bars)
    edges: NDArray[np.int64] = np.r_[np.arange(0, num_steps, width), num_steps].astype(np.int64)
    return edges


def _binned_sum(values: NDArray[Any], edges: NDArray[np.int64]) -> NDArray[np.float64]:
    if len(values) == 0:
        return np.zeros(0)
    return np.add.reduceat(np.asarray(values, dtype=np.float64), edges[:-1])


def _cp_shares(header: PlanHeader, summary: pa.Table, by: str,
               edges: NDArray[np.int64]) -> dict[int, NDArray[np.float64]]:
    if by not in ("rank_time", "tokens"):
        raise ValueError(f"by must be 'rank_time' or 'tokens', got {by!r}")
    prefix = "rank_seconds_cp" if by == "rank_time" else "tokens_cp"
    sums = {k: _binned_sum(summary.column(f"{prefix}{k}").to_numpy(), edges)
            for k in sorted(header.cp_sizes)}
    total = np.maximum(sum(sums.values()), 1e-300)
    return {k: v / total for k, v in sums.items()}


def _x(edges: NDArray[np.int64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Left edges and widths of the bins, in steps (bars aligned to their steps)."""
    left = edges[:-1].astype(np.float64) - 0.5
    return left, np.diff(edges).astype(np.float64)


def plot_cp_mix(header: PlanHeader, summary: pa.Table, ax: Any = None, *,
                by: str = "rank_time", max_bars: int = MAX_BARS) -> Any:
    """Share of each step's rank-time (``by="tokens"``: real tokens) per CP size, stacked;
    returns the Figure (``ax``'s when given)."""
    ax = _axes(ax)
    edges = step_bins(summary.num_rows, max_bars)
    shares = _cp_shares(header, summary, by, edges)
    left, width = _x(edges)
    bottom = np.zeros(len(left))
    for i, (k, v) in enumerate(shares.items()):
        ax.bar(left, 100 * v, width=width, bottom=100 * bottom, align="edge", color=f"C{i}",
               edgecolor="none", label=f"cp {k}")
        bottom += v
    binned = len(edges) - 1 < summary.num_rows
    what = "rank-time" if by == "rank_time" else "real tokens"
    ax.set_ylim(0, 100)
    ax.set_xlim(-0.5, summary.num_rows - 0.5)
    ax.set_ylabel(f"% of {what}")
    ax.set_xlabel("step" + (f" (bins of {int(width[0])} steps)" if binned else ""))
    ax.set_title(f"CP sizes: share of {what} per {'bin of steps' if binned else 'step'}")
    _legend_outside(ax)
    return ax.figure


def plot_gain(header: PlanHeader, summary: pa.Table, ax: Any = None, *,
              max_bars: int = MAX_BARS) -> Any:
    """Per step, static CP's and Megatron's simulated time over the plan's (binned past
    ``max_bars``: the bin's min-max band and its time-weighted mean); a note where a baseline
    has no number (not scored, or a plan made before the gain was recorded); returns the Figure
    (``ax``'s when given)."""
    from planner.planfile.gain import KEYS, describe

    ax = _axes(ax)
    n = summary.num_rows
    edges = step_bins(n, max_bars)
    binned = len(edges) - 1 < n
    left, width = _x(edges)
    centre = left + width / 2
    sim = summary.column("simulated_s").to_numpy().astype(np.float64)
    notes = []
    top = 1.0
    info = describe(header.stats, header.parallel.cp)
    for i, (name, key) in enumerate(KEYS.items()):
        d = info[name]
        ratio = np.array(summary.column(key).to_pylist() if key in summary.column_names
                         else [None] * n, dtype=np.float64)
        if d["ratio"] is None:
            notes.append(f"{d['label']}: {d['note']}")
        if not np.isfinite(ratio).any():
            continue
        total = (f"{d['ratio']:.3f}x" if d["ratio"] is not None
                 else f"no total: {int(np.isnan(ratio).sum())} steps it cannot run")
        colour = ("C1", "C3")[i]
        if binned:
            ok = np.isfinite(ratio)
            r = np.where(ok, ratio, np.nan)
            with np.errstate(invalid="ignore", divide="ignore"):
                lo = np.fmin.reduceat(r, edges[:-1])
                hi = np.fmax.reduceat(r, edges[:-1])
                mean = (_binned_sum(np.where(ok, r * sim, 0.0), edges)
                        / _binned_sum(np.where(ok, sim, 0.0), edges))
            ax.fill_between(centre, lo, hi, step="mid", alpha=0.25, color=colour)
            ax.step(centre, mean, where="mid", color=colour,
                    label=f"vs {d['label']} ({total}; band: min-max in bin)")
        else:
            off = -0.2 if i == 0 else 0.2
            ax.bar(np.arange(n) + off, np.nan_to_num(ratio, nan=0.0), width=0.4, color=colour,
                   label=f"vs {d['label']} ({total})")
        top = max(top, float(np.nanmax(ratio)))
    if header.stats.get("baselines") is None:
        notes = notes[:1] and [notes[0].split(": ", 1)[1]]  # one reason for both
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1.0, label="no gain")
    ax.set_ylim(min(0.95, top), top * 1.05 + 1e-9)
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylabel("baseline time / plan's")
    ax.set_title("predicted gain: the baselines' simulated step time over the plan's")
    if notes:  # inside the axes, so a long reason never widens the figure
        ax.text(0.01, 0.97, "\n".join(notes), transform=ax.transAxes, ha="left", va="top",
                fontsize=7, wrap=True, bbox={"facecolor": "white", "alpha": 0.8,
                                             "edgecolor": "none"})
    ax.set_xlabel("step" + (f" (bins of {int(width[0])} steps)" if binned else ""))
    _legend_outside(ax, fontsize=8)
    return ax.figure


def plot_summary(header: PlanHeader, summary: pa.Table, *, max_bars: int = MAX_BARS,
                 title: str = "") -> Any:
    """One figure: time over bound, predicted gain, CP share of rank-time, microbatches, per
    step (binned)."""
    plt = _plt()
    fig, axes = plt.subplots(4, 1, figsize=(11, 9.5), sharex=True, layout="constrained",
                             height_ratios=(1.0, 1.0, 1.3, 0.8))
    edges = step_bins(summary.num_rows, max_bars)
    binned = len(edges) - 1 < summary.num_rows
    left, width = _x(edges)
    centre = left + width / 2
    sim = summary.column("simulated_s").to_numpy().astype(np.float64)
    lb = summary.column("lower_bound_s").to_numpy().astype(np.float64)
    ratio = sim / np.maximum(lb, 1e-300)
    ax = axes[0]
    if binned:
        lo = np.minimum.reduceat(ratio, edges[:-1])
        hi = np.maximum.reduceat(ratio, edges[:-1])
        ax.fill_between(centre, lo, hi, step="mid", alpha=0.3, color="C0", label="min-max in bin")
        ax.step(centre, _binned_sum(sim, edges) / _binned_sum(lb, edges), where="mid",
                color="C0", label="bin total")
    else:
        ax.bar(np.arange(len(ratio)), ratio, width=0.8, color="C0", label="per step")
    ax.axhline(1.0, color="tab:red", linestyle=":", label="lower bound")
    top = float(np.max(ratio)) if len(ratio) else 1.0
    ax.set_ylim(min(0.98, float(np.min(ratio)) if len(ratio) else 1.0), top * 1.02 + 1e-9)
    ax.set_ylabel("time / bound")
    ax.set_title("simulated step time over its lower bound")
    _legend_outside(ax, fontsize=8)
    plot_gain(header, summary, axes[1], max_bars=max_bars)
    axes[1].set_xlabel("")
    plot_cp_mix(header, summary, axes[2], max_bars=max_bars)
    axes[2].set_xlabel("")
    ax = axes[3]
    mb = summary.column("microbatches").to_numpy().astype(np.float64)
    if binned:
        ax.fill_between(centre, np.minimum.reduceat(mb, edges[:-1]),
                        np.maximum.reduceat(mb, edges[:-1]), step="mid", alpha=0.3, color="C2",
                        label="min-max in bin")
        ax.step(centre, _binned_sum(mb, edges) / width, where="mid", color="C2",
                label="bin mean")
    else:
        ax.bar(np.arange(len(mb)), mb, width=0.8, color="C2", label="per step")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, (float(mb.max()) if len(mb) else 1.0) + 0.5)
    ax.set_ylabel("microbatches")
    ax.set_xlabel("step" + (f" (bins of {int(width[0])} steps)" if binned else ""))
    _legend_outside(ax, fontsize=8)
    p = header.parallel
    fig.suptitle(title or f"{header.dataset.path}: {summary.num_rows:,} steps, pool "
                 f"dp{p.dp} x cp{p.cp} = {p.pool_size}, cap "
                 f"{header.capacity_tokens_per_rank:,} tokens/rank")
    return fig
