"""A plan as one self-contained HTML page (``dcp-plan report PLAN -o report.html``).

The page needs nothing but itself: inline CSS, figures as inline SVG (matplotlib, text kept as
text so the page's words are searchable and the figures scale), no script, no font, no link
out. Sections: the predicted gain (planfile/gain.py: the number per baseline and its per-step
quantiles, or why there is none; its parts; the cost model's provenance and, when a deciding
term is assumed, the warning: planner/provenance.py), the summary (the same figures as
``dcp-plan``'s), then the figures over steps (time against the lower bound, the gain, the
CP-size mix, padding, microbatches) and the slowest step's schedule. Per-step figures are
binned past ``plot.MAX_BARS`` steps (notebook/plot.py), so 32 steps and 20,000 read alike. No
clock or host name goes in, so the same plan gives the same page.
"""

from __future__ import annotations

import html
import io
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from planner.planfile.gain import PARTS, QUANTILES, breakdown, describe, gain_text
from planner.planfile.schema import PlanHeader

if TYPE_CHECKING:
    from planner.notebook.view import PlanView

CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { text-align: left; padding: 0.2em 0.8em; border-bottom: 1px solid #eee; }
.gain { display: flex; gap: 1em; flex-wrap: wrap; }
.card { border: 1px solid #ccc; border-radius: 6px; padding: 0.8em 1.2em; min-width: 20em; }
.big { font-size: 2.2em; font-weight: bold; color: #1f5fa6; }
.note { color: #8a4b00; } figure { margin: 1em 0; } svg { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: 0.9em; }
"""

FIGURES = (
    ("time", "Step time against its lower bound",
     "Simulated seconds of each step over the step's lower bound (1.0 = no schedule can do "
     "better); past 120 steps, each bin's total and min-max."),
    ("gain", "Predicted gain per step",
     "Static CP's and Megatron's greedy's simulated time over the plan's, per step."),
    ("mix", "CP-size mix",
     "Share of each step's rank-time spent in groups of each CP size."),
    ("padding", "Padding per step",
     "Alignment padding of the real segments over their real tokens, per step (fillers "
     "excluded); past 120 steps, each bin's total and maximum."),
    ("microbatches", "Microbatches per step", "Microbatches each step runs."),
    ("load", "Load of the slowest step",
     "The slowest step as the simulator runs it: a bar per CP group over its ranks, stacked by "
     "microbatch; the lines are its step time and its lower bound."),
)


def _svg(fig: Any) -> str:
    """``fig`` as inline SVG markup (text as text, no timestamp, stable ids)."""
    from planner.notebook.plot import _plt

    plt = _plt()
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "dcp-report"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _figure(key: str, header: PlanHeader, view: PlanView, summary: pa.Table) -> Any:
    from planner.notebook import plot

    n = summary.num_rows
    if key == "gain":
        return plot.plot_gain(header, summary)
    if key == "mix":
        return plot.plot_cp_mix(header, summary)
    if key == "load":
        slowest = int(np.argmax(summary.column("simulated_s").to_numpy()))
        return view.plot_step_load(slowest)
    ax = plot._axes(None, figsize=(10, 3.2))
    edges = plot.step_bins(n)
    binned = len(edges) - 1 < n
    left, width = plot._x(edges)
    centre = left + width / 2
    if key == "time":
        top = summary.column("simulated_s").to_numpy().astype(np.float64)
        below = summary.column("lower_bound_s").to_numpy().astype(np.float64)
        label, colour = "time / lower bound", "C0"
    elif key == "padding":
        real = summary.column("real_tokens").to_numpy().astype(np.float64)
        top = summary.column("padded_tokens").to_numpy().astype(np.float64) - real
        below = real / 100.0  # in percent
        label, colour = "padding, % of real tokens", "C4"
    else:
        top = summary.column("microbatches").to_numpy().astype(np.float64)
        below = np.ones(n)
        label, colour = "microbatches", "C2"
    ratio = top / np.maximum(below, 1e-300)
    if binned:
        ax.fill_between(centre, np.minimum.reduceat(ratio, edges[:-1]),
                        np.maximum.reduceat(ratio, edges[:-1]), step="mid", alpha=0.3,
                        color=colour, label="min-max in bin")
        ax.step(centre, plot._binned_sum(top, edges) / plot._binned_sum(below, edges),
                where="mid", color=colour,
                label="bin mean" if key == "microbatches" else "bin total")
    else:
        ax.bar(np.arange(n), ratio, width=0.8, color=colour, label="per step")
    if key == "time":
        ax.axhline(1.0, color="tab:red", linestyle=":", label="lower bound")
        ax.set_ylim(min(0.98, float(ratio.min())), float(ratio.max()) * 1.02 + 1e-9)
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylabel(label)
    ax.set_xlabel("step" + (f" (bins of {int(width[0])} steps)" if binned else ""))
    ax.set_title(dict((k, t) for k, t, _ in FIGURES)[key])
    plot._legend_outside(ax, fontsize=8)
    return ax.figure


def _gain_cards(header: PlanHeader) -> str:
    cards = []
    for name, d in describe(header.stats, header.parallel.cp).items():
        e = html.escape
        if d["ratio"] is not None:
            body = (f"<div class='big'>{d['ratio']:.3f}x</div><div>faster than "
                    f"{e(d['label'])} (its simulated time over the plan's)</div>")
        else:
            body = f"<div class='note'>{e(d['label'])}: {e(str(d['note']))}</div>"
        q = d["quantiles"]
        if q:
            names = [k for k, _ in QUANTILES]
            body += ("<table><tr><th>per step</th>" + "".join(f"<th>{k}</th>" for k in names)
                     + "</tr><tr><td>ratio</td>" + "".join(f"<td>{q[k]:.3f}</td>" for k in names)
                     + "</tr></table>")
        cards.append(f"<div class='card' id='gain-{name}'>{body}</div>")
    return "<div class='gain'>" + "".join(cards) + "</div>"


def _parts_table(header: PlanHeader) -> str:
    """The gain's parts per baseline (planfile/gain.py): seconds and share of the plan's time."""
    e = html.escape
    rows = []
    for name, d in breakdown(header.stats, header.parallel.cp).items():
        if "parts" not in d:
            rows.append(f"<tr><th>{e(d['label'])}</th><td colspan='6' class='note'>"
                        f"{e(str(d['note']))}</td></tr>")
            continue
        cells = "".join(f"<td>{p['seconds']:+.3f} s ({p['share']:+.3f}x)</td>"
                        for p in d["parts"].values())
        extra = d["baseline_seconds"] - d["plan_seconds"]
        rows.append(f"<tr id='parts-{name}'><th>{e(d['label'])}</th><td>{d['ratio']:.3f}x over "
                    f"{d['steps']} steps</td>{cells}<td>{extra:+.3f} s "
                    f"({d['ratio'] - 1:+.3f}x)</td></tr>")
    head = "".join(f"<th>{e(label)}</th>" for label in
                   ("baseline", "ratio", *PARTS.values(), "total"))
    return (f"<table id='gain-parts'><tr>{head}</tr>" + "".join(rows) + "</table>"
            "<p><small>Each part: the baseline's extra simulated seconds there and their share "
            "of the plan's time (the parts add up to the ratio less 1); load balance is the "
            "ranks' idle time, the rest of the difference.</small></p>")


def _cost_mark(header: PlanHeader) -> str:
    from planner.provenance import of_header

    mark, warning = of_header(header)
    e = html.escape
    return (f"<p id='cost-model'>Cost model {e(mark)}</p>"
            + (f"<p class='note' id='cost-warning'>Warning: {e(warning)}</p>" if warning else ""))


def _summary_table(view: PlanView) -> str:
    h, s = view.header, view.header.stats
    rows = dict(view._figures())
    rows["padding"] = (f"{100 * s['padding_overhead']:.3f}% of real tokens (alignment "
                       f"{100 * s['alignment_padding']:.3f}%)")
    rows["lower bound"] = f"{s['lower_bound_seconds']:.3f} s"
    rows["kind"] = h.kind
    rows.pop("gain", None)
    rows.pop("warning", None)  # shown under the gain
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td>"
                               "</tr>" for k, v in rows.items()) + "</table>"


def render_report(view: PlanView, log: list[dict[str, Any]] | None = None,
                  log_source: str = "") -> str:
    """The whole page for an opened plan (validate it first: the numbers are the plan's);
    ``log``: a run's step lines (``planner.prediction.read_step_log``), for the
    predicted-vs-measured panel (notebook/reportlog.py), read from ``log_source``."""
    from planner.planfile.schema import CREATOR_VERSION, FORMAT_VERSION

    header = view.header
    summary = view.summary()
    e = html.escape
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>dcp plan report: {e(str(view.path))}</title><style>{CSS}</style></head><body>",
        f"<h1>dcp plan report: {e(str(view.path))}</h1>",
        f"<p>{view.num_steps:,} steps, pool dp {header.parallel.dp} x cp "
        f"{header.parallel.cp} = {header.parallel.pool_size} ranks, capacity "
        f"{header.capacity_tokens_per_rank:,} tokens per rank; every time is simulated under "
        f"the plan's cost model ({e(str(header.cost_model.get('name')))}).</p>",
        "<h2 id='gain'>Predicted gain</h2>",
        "<p>" + "<br>".join(e(line) for line in gain_text(header.stats, header.parallel.cp))
        + "</p>", _cost_mark(header), _gain_cards(header), _parts_table(header),
        "<h2 id='summary'>Summary</h2>", _summary_table(view),
    ]
    if log is not None:
        from planner.notebook.reportlog import panel

        parts.append(panel(view, log, log_source, _svg))
    for key, title, caption in FIGURES:
        svg = _svg(_figure(key, header, view, summary))
        parts.append(f"<h2 id='{key}'>{e(title)}</h2><figure>{svg}"
                     f"<figcaption>{e(caption)}</figcaption></figure>")
    parts.append(f"<p><small>dcp-plan report {e(CREATOR_VERSION)}, plan format "
                 f"{header.format_version} (this dcp-plan writes {FORMAT_VERSION})</small></p>"
                 "</body></html>")
    return "\n".join(parts)
