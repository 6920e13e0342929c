"""Render docs/planning.md's plan figures into docs/: a 32-step plan (data/sample.jsonl) and a
2,000-step plan (64,000 long-tail synthetic lengths), each as ``plot_summary`` and one step's
``plot_step_load``.

    .venv/bin/python scripts/figures.py [OUT_DIR]      # default: docs/
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from planner import read_plan  # noqa: E402
from planner.config import ParallelConfig, PlannerConfig  # noqa: E402
from planner.cost import load_cost_model  # noqa: E402
from planner.fileguard import atomic_output  # noqa: E402
from planner.plan import make_plan  # noqa: E402
from planner.planfile.io import write_plan  # noqa: E402
from planner.sources.lengths import LengthTable, read_lengths  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _long_tail(n: int, seed: int) -> LengthTable:
    rng = np.random.default_rng(seed)
    short = rng.lognormal(6.0, 1.2, n)
    long = rng.uniform(4000, 32768, n)
    lengths = np.where(rng.random(n) < 0.05, long, short).astype(np.int64).clip(1, 32768)
    return LengthTable(path="long-tail synthetic (seed 3)", format="text", lengths=lengths,
                       skipped=np.zeros(0, np.int64))


def _save(fig: Any, path: Path) -> None:
    """Through the output guard: only over a figure, written to a temporary and renamed."""
    with atomic_output(path, kind="figure") as tmp:
        fig.savefig(tmp, format="png", dpi=90)


def _render(name: str, table: LengthTable, out: Path, step: int) -> None:
    config = PlannerConfig(parallel=ParallelConfig(dp=4, cp=2), capacity_tokens_per_rank=4096,
                           global_batch_size=64 if name == "32" else 32, long_sequences="split")
    plan = make_plan(table, config, load_cost_model())
    with tempfile.TemporaryDirectory() as tmp:
        path = write_plan(Path(tmp) / "p.arrow", plan.header, plan.record_batches())
        view = read_plan(path)
        _save(view.plot_summary(), out / f"plan-summary-{name}-steps.png")
        _save(view.plot_step_load(step), out / f"plan-step-load-{name}-steps.png")
        plt.close("all")
        view.close()
    print(f"{name} steps: {out}/plan-summary-{name}-steps.png, plan-step-load-{name}-steps.png")


def main() -> None:
    os.chdir(ROOT)  # the figures name the dataset by its path in the repository
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs")
    out.mkdir(parents=True, exist_ok=True)
    _render("32", read_lengths("data/sample.jsonl"), out, step=10)
    _render("2000", _long_tail(64000, 3), out, step=7)


if __name__ == "__main__":
    main()
