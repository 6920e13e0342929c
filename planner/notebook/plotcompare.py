"""The figure of ``dcp-plan compare``: one bar per setup, in the table's order (matplotlib).

Two panels sharing the setups: tokens/s of the whole job (bars, with the sampling error of the
step time as an error bar) and per GPU (bars), each bar labelled with its speed-up over static
CP and Megatron's greedy. Setups are labelled ``N, C``; legends and notes sit outside
the axes, so nothing covers a bar.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["compare_figure", "plot_compare"]


def plot_compare(doc: dict[str, Any]) -> Any:
    """The comparison of ``dcp-plan compare --json``'s document as a matplotlib Figure."""
    from planner.notebook.plot import _plt

    plt = _plt()
    rows = doc["setups"]
    labels = [f"N={r['pool_size']}\nC={r['capacity_tokens_per_rank']:,}" for r in rows]
    x = np.arange(len(rows))
    width = max(8.0, 0.9 * len(rows) + 3.5)
    fig, axes = plt.subplots(2, 1, figsize=(width, 6.5), sharex=True, layout="constrained")
    rate = np.array([r["tokens_per_second"] for r in rows])
    err = rate * np.array([r["step_seconds_error"] for r in rows])
    axes[0].bar(x, rate, yerr=err, color="C0", capsize=3,
                label=("tokens/s (error bar: 95% sampling error)" if doc["sampled"]
                       else "tokens/s") + "\nabove a bar: its speed-up over\nstatic CP at each "
                "cp and\nover Megatron's greedy")
    for i, r in enumerate(rows):
        gain = [f"{v:.2f}x cp{c}" for c, v in r["vs_static_cp"].items() if v is not None]
        if r["vs_megatron"] is not None:
            gain.append(f"{r['vs_megatron']:.2f}x Meg.")
        axes[0].text(i, rate[i], "\n".join(gain) or "no baseline", ha="center", va="bottom",
                     fontsize=7)
    axes[0].set_ylabel("tokens/s (whole job)")
    axes[0].set_ylim(0, rate.max() * 1.3 if len(rate) else 1)
    sampled = (f"{doc['sampled_steps']} sampled of {doc['num_steps']:,} steps" if doc["sampled"]
               else f"all {doc['num_steps']:,} steps")
    fig.suptitle(f"{doc['dataset']['path']}: global batch {doc['global_batch']}\n{sampled}, "
                 f"cost model {doc.get('cost_model_mark', doc['cost_model'])}", fontsize=9)
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    per_gpu = np.array([r["tokens_per_second_per_gpu"] for r in rows])
    axes[1].bar(x, per_gpu, color="C2", label="tokens/s per GPU")
    axes[1].set_ylabel("tokens/s per GPU")
    axes[1].set_xticks(x, labels, fontsize=8)
    axes[1].set_xlabel("setup: pool N ranks, capacity C tokens per rank")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    if doc["refused"]:  # beside the legend, outside the axes
        axes[1].text(1.01, 0.0, "refused (see the table):\n" + "\n".join(
            f"N={r['pool_size']}, C={r['capacity_tokens_per_rank']:,}"
            for r in doc["refused"]), transform=axes[1].transAxes, fontsize=7, va="bottom")
    return fig


def compare_figure(doc: dict[str, Any], path: str) -> bytes:
    """The figure as file bytes, in the format of ``path``'s extension (PNG by default)."""
    from planner.notebook.plot import _plt

    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    if fmt not in ("png", "svg", "pdf"):
        raise ValueError(f"--figure {path}: give a .png, .svg or .pdf file")
    fig = plot_compare(doc)
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110)
    _plt().close(fig)
    return buf.getvalue()
