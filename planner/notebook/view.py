"""Reading plans in notebooks: ``read_plan(path)`` -> PlanView.

A PlanView wraps the memory-mapped file: the parsed header, the whole pyarrow table on demand,
O(1) access to one step, a per-step summary table, conversions to pandas / polars (when
installed) and plots (matplotlib, optional). Example::

    from planner import read_plan
    plan = read_plan("plans/sample.arrow")
    plan.header.stats["slot_fill"]
    plan.summary().to_pandas()            # one row per step
    plan.step(3).to_pandas()              # that step's rows
    plan.plot_step_load(3); plan.plot_cp_mix(); plan.plot_summary()
    plan                                   # in Jupyter: a table of the plan's key figures

``repr(plan)`` is one line of the key figures; ``_repr_html_`` the same as a table (Jupyter).
"""

from __future__ import annotations

import html
import os
from typing import Any

import numpy as np
import pyarrow as pa

from planner.cost import CostModel, group_seconds, simulate_step, step_lower_bound
from planner.planfile.gain import KEYS, gain_text
from planner.planfile.io import PlanFile
from planner.planfile.schema import COLUMN_NAMES, PlanHeader, column_numpy
from planner.planfile.stats import min_num_microbatches
from planner.solver.step import tight_lower_bound


def read_plan(path: str | os.PathLike[str]) -> PlanView:
    """Open a plan file for reading (memory-mapped)."""
    return PlanView(path)


def _cols(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    return {n: column_numpy(batch, n) for n in COLUMN_NAMES}


def step_summary_row(header: PlanHeader, cost: CostModel, step: int,
                     cols: dict[str, np.ndarray]) -> dict[str, Any]:
    """One step's summary: microbatches, groups per size, tokens, fill, simulated time, bound."""
    n = header.parallel.pool_size
    cap = header.capacity_tokens_per_rank
    mb, start, k = cols["microbatch"], cols["rank_start"], cols["cp_size"]
    sample, ntok, padded = cols["sample_index"], cols["num_tokens"], cols["padded_tokens"]
    num_mb = int(mb.max()) + 1 if len(mb) else 0
    group_first = np.r_[True, (np.diff(mb) != 0) | (np.diff(start) != 0)] if len(mb) else mb
    real = int(ntok.sum())
    seg = ntok[sample >= 0].astype(np.int64)
    tp_eff = header.parallel.tp_eff
    row: dict[str, Any] = {
        "step": step,
        "microbatches": num_mb,
        "groups": int(group_first.sum()),
        "samples": int(np.unique(sample[sample >= 0]).size),
        "real_tokens": real,
        "padded_tokens": int(padded[sample >= 0].sum()),
        "slot_fill": real / (n * cap * num_mb) if num_mb else 0.0,
        "simulated_s": simulate_step(cost, n, mb, start, k, padded),
    }
    pad_to = header.pad_to_multiple
    need = min_num_microbatches(seg, header.cp_sizes, cap, tp_eff, header.layout, n,
                                header.parallel.microbatch_multiple, pad_to)
    row["lower_bound_s"] = step_lower_bound(cost, n, seg, header.cp_sizes, cap, tp_eff,
                                            header.layout, need, pad_to=pad_to)
    # The tight bound (solver/bounds.py) and how far the step's time is above it.
    tight = tight_lower_bound(seg, header.cp_sizes, cap, tp_eff, header.layout, n,
                              cost.as_array(), need, pad_to) if len(seg) else 0.0
    row["tight_bound_s"] = tight
    row["time_over_tight_bound"] = row["simulated_s"] / tight if tight > 0 else 0.0
    # The predicted gain per step (planfile/gain.py): the baseline's time over this step's;
    # None where the plan does not record it (older plans, a baseline not scored or not able
    # to run the step).
    for name, key in KEYS.items():
        per_step = (header.stats.get("baselines") or {}).get(name, {}).get("per_step")
        row[key] = per_step[step] if per_step and step < len(per_step) else None
    for size in header.cp_sizes:
        row[f"groups_cp{size}"] = int((group_first & (k == size)).sum())
    # Rank-time per CP size: a group of k ranks busy t seconds uses k t rank-seconds, which is
    # what a group count hides (one group of 8 holds 8 ranks). Tokens: real tokens per size.
    first = np.flatnonzero(group_first)
    if len(first):
        p = padded.astype(np.float64)
        g_k = k[first]
        t = group_seconds(cost, g_k, np.add.reduceat(p, first), np.add.reduceat(p * p, first))
        g_tok = np.add.reduceat(ntok.astype(np.int64), first)
    else:
        g_k, t, g_tok = k, np.zeros(0), np.zeros(0, np.int64)
    for size in header.cp_sizes:
        sel = g_k == size
        row[f"rank_seconds_cp{size}"] = float((t[sel] * size).sum())
        row[f"tokens_cp{size}"] = int(g_tok[sel].sum())
    return row


class PlanView:
    """A plan opened for inspection. See the module docstring for an example."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = PlanFile(path)
        self.path = self._file.path
        self.header: PlanHeader = self._file.header
        self._table: pa.Table | None = None
        self._summary: pa.Table | None = None

    @property
    def num_steps(self) -> int:
        return self._file.num_steps

    def _figures(self) -> dict[str, str]:
        h, s, p, d = self.header, self.header.stats, self.header.parallel, self.header.dataset
        files = len(d.files) or 1
        ratio = s["simulated_seconds"] / max(s["lower_bound_seconds"], 1e-12)
        mb = s["microbatches_per_step"]
        return {
            "plan": str(self.path),
            "dataset": f"{d.path} ({d.num_samples:,} samples, {d.num_tokens:,} tokens"
                       + (f", {files} files)" if files > 1 else ")"),
            "pool": f"dp {p.dp} x cp {p.cp} = {p.pool_size} ranks (tp {p.tp}, pp {p.pp}, "
                    f"vpp {p.vpp})",
            "capacity": f"{h.capacity_tokens_per_rank:,} tokens/rank, sizes {list(h.cp_sizes)}, "
                        f"{h.layout}",
            "steps": f"{self.num_steps:,} ({len(h.epochs)} epoch(s)), microbatches "
                     f"{mb['min']}-{mb['max']} (mean {mb['mean']:.2f})",
            "groups": ", ".join(f"cp{k}: {v:,}" for k, v in sorted(
                s["cp_size_groups"].items(), key=lambda kv: int(kv[0]))),
            "slot fill": f"{s['slot_fill']:.3f}",
            "time": f"{s['simulated_seconds']:.3f} s simulated, {ratio:.3f}x the lower bound "
                    f"[{h.cost_model.get('name')}]",
            "gain": "; ".join(gain_text(s, p.cp)),
            **_cost_rows(h),
            "format": str(h.format_version),
        }

    def __repr__(self) -> str:
        f = self._figures()
        return (f"<PlanView {f['plan']}: {f['steps']}; pool {f['pool']}; cap {f['capacity']}; "
                f"time {f['time']}>")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                       f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                       for k, v in self._figures().items())
        return f"<table><caption>dcp plan</caption>{rows}</table>"

    def __len__(self) -> int:
        return self.num_steps

    @property
    def cost_model(self) -> CostModel:
        cm = self.header.cost_model
        return CostModel.from_dict({"name": cm.get("name", "plan"),
                                    "parameters": cm.get("parameters", {})})

    @property
    def table(self) -> pa.Table:
        """Every row of every step as one pyarrow Table."""
        if self._table is None:
            self._table = self._file.table()
        return self._table

    def step(self, i: int) -> pa.Table:
        """Step ``i``'s rows (O(1): one record batch of the memory-mapped file)."""
        return pa.Table.from_batches([self._file.step(i)])

    def step_columns(self, i: int) -> dict[str, np.ndarray]:
        """Step ``i``'s columns as numpy arrays (zero-copy where Arrow allows)."""
        return _cols(self._file.step(i))

    def summary(self) -> pa.Table:
        """One row per step: microbatches, groups per size, tokens, fill, simulated time, bound."""
        if self._summary is None:
            cost = self.cost_model
            rows = [step_summary_row(self.header, cost, i, self.step_columns(i))
                    for i in range(self.num_steps)]
            self._summary = pa.Table.from_pylist(rows)
        return self._summary

    def to_pandas(self) -> Any:
        """All rows as a pandas DataFrame (needs pandas)."""
        return self.table.to_pandas()

    def to_polars(self) -> Any:
        """All rows as a polars DataFrame (needs polars)."""
        try:
            import polars as pl
        except ImportError as e:
            raise ImportError("to_polars() needs polars: pip install polars") from e
        return pl.from_arrow(self.table)

    def plot_step_load(self, i: int, ax: Any = None) -> Any:
        """One step's schedule: a bar per CP group over its ranks, coloured by microbatch, with
        the simulated step time and the step's lower bound as lines; returns the Figure."""
        from planner.notebook.plot import plot_step_load

        cols = self.step_columns(i)
        bound = step_summary_row(self.header, self.cost_model, i, cols)["lower_bound_s"]
        return plot_step_load(self.header, self.cost_model, i, cols, ax=ax, lower_bound=bound)

    def plot_cp_mix(self, ax: Any = None, *, by: str = "rank_time") -> Any:
        """Share of each step's rank-time (or ``by="tokens"``) per CP size; binned past 120;
        returns the Figure."""
        from planner.notebook.plot import plot_cp_mix

        return plot_cp_mix(self.header, self.summary(), ax=ax, by=by)

    def plot_summary(self) -> Any:
        """One figure: time over bound, predicted gain, CP share of rank-time, microbatches,
        per step; returns the Figure."""
        from planner.notebook.plot import plot_summary

        return plot_summary(self.header, self.summary())

    def close(self) -> None:
        self._file.close()


def _cost_rows(header: PlanHeader) -> dict[str, str]:
    """The cost model's mark, and its warning when a deciding term is assumed (provenance.py)."""
    from planner.provenance import of_header

    mark, warning = of_header(header)
    return {"cost model": mark, **({"warning": warning} if warning else {})}
