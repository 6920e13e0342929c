"""Optional matplotlib plots for notebooks: per-rank load of one step and the CP-size mix."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from planner.cost import CostModel
from planner.planfile.schema import PlanHeader


def _axes(ax: Any) -> Any:
    if ax is not None:
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    _, ax = plt.subplots(figsize=(10, 4))
    return ax


def plot_step_load(header: PlanHeader, cost: CostModel, step: int,
                   cols: dict[str, np.ndarray], ax: Any = None) -> Any:
    """Per-rank busy seconds of one step, one stacked segment per microbatch, coloured by size."""
    ax = _axes(ax)
    n = header.parallel.pool_size
    mb, start, k = cols["microbatch"], cols["rank_start"], cols["cp_size"]
    padded = cols["padded_tokens"]
    bottoms = np.zeros(n)
    sizes = sorted(header.cp_sizes)
    cmap = {s: f"C{i}" for i, s in enumerate(sizes)}
    first = np.flatnonzero(np.r_[True, (np.diff(mb) != 0) | (np.diff(start) != 0)])
    ends = np.r_[first[1:], len(mb)]
    seen: set[int] = set()
    for a, b in zip(first, ends, strict=True):
        kk, r0 = int(k[a]), int(start[a])
        t = cost.group_time(kk, padded[a:b])
        ranks = np.arange(r0, r0 + kk)
        ax.bar(ranks, t, bottom=bottoms[ranks], color=cmap[kk], edgecolor="white", linewidth=0.3,
               label=f"cp {kk}" if kk not in seen else None)
        seen.add(kk)
        bottoms[ranks] += t
    ax.set_xlabel("pool rank")
    ax.set_ylabel("simulated seconds")
    ax.set_title(f"step {step}: per-rank load by microbatch")
    ax.legend()
    return ax


def plot_cp_mix(header: PlanHeader, summary: pa.Table, ax: Any = None) -> Any:
    """Number of groups of each CP size per step, stacked."""
    ax = _axes(ax)
    steps = summary.column("step").to_numpy()
    bottom = np.zeros(len(steps))
    for i, s in enumerate(sorted(header.cp_sizes)):
        v = summary.column(f"groups_cp{s}").to_numpy().astype(float)
        ax.bar(steps, v, bottom=bottom, color=f"C{i}", label=f"cp {s}")
        bottom += v
    ax.set_xlabel("step")
    ax.set_ylabel("groups")
    ax.set_title("CP group sizes per step")
    ax.legend()
    return ax
