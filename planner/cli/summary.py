"""The end-of-run summary of ``dcp-plan``: one dict of every figure, and its text rendering.

``plan_summary`` is what ``dcp-plan --json`` prints and ``--summary-json FILE`` writes; the text
that ``dcp-plan`` prints is rendered from the same dict, so the two can never disagree. Keys are
stable (scripts read them): counts are integers, ratios plain fractions (``padding_overhead``
0.00015 means 0.015%), times seconds.

numba's compile (the first run after an install, planner/numbacache.py) is a phase of its own,
``seconds.compile``: the other phases and the speed exclude it, ``seconds.total`` is the whole
wall time. Worker processes compile at the same time as one another, so the longest worker's
compile is what the run waited for; Ray tasks on a cluster's other nodes cannot report theirs
and are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner import provenance
from planner.numbacache import CompileTotals
from planner.planfile.gain import describe, gain_text
from planner.planfile.schema import PlanHeader, describe_launch

__all__ = ["Compiles", "format_summary", "plan_summary"]


@dataclass(frozen=True, slots=True)
class Compiles:
    """The run's numba compiles: this process's seconds in each phase, and each worker's."""

    by_phase: dict[str, float] = field(default_factory=dict)
    signatures: int = 0
    workers: tuple[CompileTotals, ...] = ()
    worker_phase: str = "plan"
    """The phase the workers' compiles fall in (they plan the steps)."""

    @classmethod
    def of(cls, marks: Sequence[tuple[str, CompileTotals]],
           workers: Sequence[CompileTotals] = ()) -> Compiles:
        """From this process's totals at the start and at each phase's end, in order."""
        by_phase = {name: (b - a).seconds
                    for (_, a), (name, b) in zip(marks, marks[1:], strict=False)}
        return cls(by_phase=by_phase, signatures=(marks[-1][1] - marks[0][1]).signatures,
                   workers=tuple(w for w in workers if w.seconds > 0))


def plan_summary(header: PlanHeader, out: str | Path, phases: dict[str, float],
                 compiles: Compiles | None = None) -> dict[str, Any]:
    """Every summary figure of a plan as JSON-ready values.

    Args:
        header: the plan's header.
        out: where the plan was written.
        phases: wall-clock seconds per phase (``read``, ``plan``, ``validate+write``), numba's
            compiles included.
        compiles: the numba compiles in those phases (none: nothing compiled).
    """
    s = header.stats
    p = header.parallel
    d = header.dataset
    total = float(sum(phases.values()))
    c = compiles or Compiles()
    in_workers = max((w.seconds for w in c.workers), default=0.0)
    net = {k: max(0.0, float(v) - c.by_phase.get(k, 0.0)
                  - (in_workers if k == c.worker_phase else 0.0)) for k, v in phases.items()}
    work = sum(net.values())
    bound = float(s["lower_bound_seconds"])
    drawn = d.num_samples * len(header.epochs)
    mark, warning = provenance.of_header(header)
    files = [dict(f) for f in getattr(d, "files", ())] or [
        {"path": d.path, "format": d.format, "num_samples": d.num_samples,
         "num_tokens": d.num_tokens, "fingerprint": d.fingerprint, "group": 0}]
    return {
        "plan": str(out),
        "format_version": header.format_version,
        "dataset": {"path": d.path, "format": d.format, "num_samples": d.num_samples,
                    "num_tokens": d.num_tokens, "fingerprint": d.fingerprint, "files": files,
                    **({"content_fingerprint": d.content_fingerprint}
                       if d.content_fingerprint else {}),
                    **({"field": d.field} if d.field else {}),
                    **({"tokenizer": dict(d.tokenizer)} if d.tokenizer else {}),
                    **_megatron(d.megatron_unit, files)},
        "parallel": {"dp": p.dp, "cp": p.cp, "tp": p.tp, "pp": p.pp, "vpp": p.vpp,
                     "sequence_parallel": p.sequence_parallel, "pool_size": p.pool_size,
                     "microbatch_group_size": p.microbatch_group_size},
        # What to start: every rank of the plan is one process (pool x tp x pp).
        "world_size": p.world_size,
        "launch": p.launch,
        "capacity_tokens_per_rank": header.capacity_tokens_per_rank,
        "cp_sizes": list(header.cp_sizes),
        "layout": header.layout,
        "global_batch": dict(header.global_batch),
        "blend_entries": _blend_entries(header.global_batch.get("blend"), files),
        "seed": header.seed,
        "kind": header.kind,
        "num_steps": int(s["num_steps"]),
        "num_epochs": len(header.epochs),
        "microbatches_per_step": dict(s["microbatches_per_step"]),
        "cp_size_groups": {str(k): int(v) for k, v in sorted(
            s["cp_size_groups"].items(), key=lambda kv: int(kv[0]))},
        "padding_overhead": float(s["padding_overhead"]),
        "alignment_padding": float(s["alignment_padding"]),
        "slot_fill": float(s["slot_fill"]),
        "simulated_seconds": float(s["simulated_seconds"]),
        "lower_bound_seconds": bound,
        "time_over_bound": float(s["simulated_seconds"]) / max(bound, 1e-12),
        "cost_model": str(header.cost_model.get("name")),
        # Where the cost model comes from and which terms were measured (planner/provenance.py),
        # and one line when a term that decides the plan is assumed (null: none is).
        "cost_model_provenance": header.cost_model.get("provenance"),
        "cost_model_mark": mark,
        "cost_model_warning": warning,
        # The predicted gain (planfile/gain.py): a baseline's simulated time over the plan's,
        # null where it is not scored or cannot run a step ("gain" says why).
        "vs_static_cp": s.get("vs_static_cp"),
        "vs_megatron": s.get("vs_megatron"),
        "gain": {name: {k: v for k, v in d.items() if k != "per_step"}
                 for name, d in describe(s, p.cp).items()},
        "gain_text": gain_text(s, p.cp),
        "split_samples": len(s.get("split_samples", [])),
        # Of them, samples the pool holds whole but --memory-per-rank's cap does not.
        "split_for_memory": len(s.get("split_for_memory", [])),
        "truncated_samples": len(s.get("truncated_samples", [])),
        "dropped_samples": len(s.get("dropped_samples", [])),
        "skipped_bad_records": int(s.get("skipped_bad_records", 0)),
        "seconds": {**net, "compile": total - work, "total": total},
        "compile": {"signatures_here": c.signatures, "seconds_here": sum(c.by_phase.values()),
                    "worker_processes": len(c.workers), "worker_seconds_max": in_workers},
        "samples_per_second": drawn / work if work > 0 else None,
    }


def _megatron(unit: str, files: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"megatron": {unit, num_documents, num_sequences}}`` for a dataset with Megatron files
    (what a sample of them is, and how many of each the indexes hold); else empty."""
    mg = [f for f in files if f.get("format") == "megatron"]
    if not unit or not mg:
        return {}
    return {"megatron": {"unit": unit, "files": len(mg),
                         "path": str(mg[0]["path"]) if len(mg) == 1 else "",
                         "num_documents": sum(int(f.get("num_documents", 0)) for f in mg),
                         "num_sequences": sum(int(f.get("num_sequences", 0)) for f in mg)}}


def _megatron_line(m: dict[str, Any]) -> str:
    """``data      50 documents (150 sequences) of x.idx, planned as documents``."""
    docs, seqs = f"{m['num_documents']:,} documents", f"{m['num_sequences']:,} sequences"
    counts = (f"{docs} ({seqs})" if m["unit"] == "document" else
              f"{seqs} ({docs})" if m["num_documents"] else f"{seqs} (no document index)")
    where = m["path"] if m["path"] else f"{m['files']} Megatron files"
    return f"data      {counts} of {where}, planned as {m['unit']}s"


def _blend_entries(blend: dict[str, Any] | None, files: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    """Per ``--data-path`` entry: its samples, and how many each epoch drew and left undrawn.

    An epoch of a blend ends when its first entry runs out of samples (every step draws fixed
    counts), so the other entries leave samples undrawn; the header records what each epoch
    drew (``global_batch.blend.drawn_per_epoch``), so this needs no replanning.
    """
    if not blend:
        return []
    drawn = [list(map(int, d)) for d in blend.get("drawn_per_epoch", [])]
    out = []
    for g, (count, weight) in enumerate(zip(blend["samples_per_step"], blend["weights"],
                                            strict=True)):
        samples = sum(int(f["num_samples"]) for f in files if int(f.get("group", 0)) == g)
        per_epoch = [d[g] for d in drawn]
        out.append({"entry": g, "weight": weight, "samples_per_step": int(count),
                    "samples": samples, "drawn_per_epoch": per_epoch,
                    "undrawn_per_epoch": [samples - d for d in per_epoch]})
    return out


def _blend_lines(entries: list[dict[str, Any]]) -> list[str]:
    """``  entry 0 418 of 1,000 samples drawn, 582 never drawn`` per entry."""
    lines = []
    for e in entries:
        drawn, undrawn = e["drawn_per_epoch"], e["undrawn_per_epoch"]
        if not drawn:
            continue
        if len(drawn) == 1:
            text = f"{drawn[0]:,} of {e['samples']:,} samples drawn, " + (
                f"{undrawn[0]:,} never drawn" if undrawn[0] else "none left out")
        else:  # every epoch draws the same counts, from a fresh permutation
            text = f"{drawn[0]:,} of {e['samples']:,} samples drawn per epoch, " + (
                f"{undrawn[0]:,} left out of each (other ones each epoch)" if undrawn[0]
                else "none left out")
        lines.append(f"  entry {e['entry']} {text}")
    ends = [e for e in entries if e["drawn_per_epoch"]
            and e["undrawn_per_epoch"][0] < e["samples_per_step"]]
    if ends and any(e["undrawn_per_epoch"][0] for e in entries if e["drawn_per_epoch"]):
        e = ends[0]
        lines.append(f"          (an epoch ends when entry {e['entry']} has fewer than the "
                     f"{e['samples_per_step']} samples a step draws from it)")
    return lines


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable summary (what ``dcp-plan`` prints) of ``plan_summary``'s dict."""
    s = summary
    d, p = s["dataset"], s["parallel"]
    mb = s["microbatches_per_step"]
    lines = [
        f"plan      {s['plan']}",
        f"dataset   {d['path']}: {d['num_samples']:,} samples, {d['num_tokens']:,} tokens "
        f"({d['format']}" + (f", field {d['field']!r}" if d.get("field") else "") + ")",
    ]
    if d.get("tokenizer"):
        from planner.sources.textenc import TokenizerSpec

        lines.append(f"tokenizer {TokenizerSpec.from_dict(d['tokenizer']).policy_text()}")
    if d.get("megatron"):
        lines.append(_megatron_line(d["megatron"]))
    if len(d["files"]) > 1:
        for f in d["files"]:
            lines.append(f"  file    {f['path']}: {f['num_samples']:,} samples, "
                         f"{f['num_tokens']:,} tokens")
    blend = s["global_batch"].get("blend")
    if blend:
        lines.append("blend     per step " + ", ".join(
            f"{c} from entry {g} (weight {w:g})" for g, (c, w) in enumerate(
                zip(blend["samples_per_step"], blend["weights"], strict=True))))
        lines += _blend_lines(s.get("blend_entries", []))
    lines += [
        f"pool      dp {p['dp']} x cp {p['cp']} = {p['pool_size']} ranks (tp {p['tp']}, "
        f"pp {p['pp']}, vpp {p['vpp']}), cap {s['capacity_tokens_per_rank']:,} tokens/rank, "
        f"sizes {s['cp_sizes']}, {s['layout']}",
        f"launch    {describe_launch(p['dp'], p['cp'], p['tp'], p['pp'])}",
        f"steps     {s['num_steps']:,} ("
        + ("eval: one pass in file order" if s["kind"] == "eval"
           else f"{s['num_epochs']} epoch(s)") + "), microbatches per step "
        f"{mb['min']}-{mb['max']} (mean {mb['mean']:.2f})",
        "groups    " + ", ".join(f"cp{k}: {v:,}" for k, v in s["cp_size_groups"].items()),
        f"padding   {100 * s['padding_overhead']:.3f}% of real tokens "
        f"(alignment {100 * s['alignment_padding']:.3f}%)",
        f"slot fill {s['slot_fill']:.3f} (real tokens / (N x CAP x microbatches))",
        f"time      {s['simulated_seconds']:.2f} s simulated vs lower bound "
        f"{s['lower_bound_seconds']:.2f} s ({s['time_over_bound']:.3f}x) [{s['cost_model']}]",
    ]
    lines.append(f"cost      {s['cost_model_mark']}")
    for i, line in enumerate(s["gain_text"]):
        lines.append(("gain      " if i == 0 else "          ") + line)
    if s.get("cost_model_warning"):
        lines.append(f"warning   {s['cost_model_warning']}")
    policy = [f"{s[k]} {k.split('_')[0]}" for k in
              ("split_samples", "truncated_samples", "dropped_samples") if s[k]]
    if s["split_for_memory"]:
        policy[0] += f" ({s['split_for_memory']} for --memory-per-rank)"
    if s["skipped_bad_records"]:
        policy.append(f"{s['skipped_bad_records']} bad records skipped")
    if policy:
        lines.append("long/bad  " + ", ".join(policy))
    seconds = s["seconds"]
    compiled = seconds.get("compile", 0.0)
    if compiled > 0:
        lines.append(f"compile   numba kernels compiled once: {compiled:.1f} s "
                     f"({_compile_detail(s['compile'])}cached for later runs)")
    phases = {k: v for k, v in seconds.items() if k not in ("compile", "total")}
    detail = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
    rate = s["samples_per_second"]
    speed = f"{rate:,.0f} sequences/s" if rate is not None else "inf sequences/s"
    lines.append(f"speed     {speed} in {sum(phases.values()):.2f} s ({detail}"
                 + ("; the compile excluded" if compiled > 0 else "") + ")")
    return "\n".join(lines)


def _compile_detail(c: dict[str, Any]) -> str:
    """``68 signatures; `` or, with workers, where the compile's seconds went."""
    if not c["worker_processes"]:
        return f"{c['signatures_here']} signatures; "
    return (f"{c['seconds_here']:.1f} s here, up to {c['worker_seconds_max']:.1f} s in each of "
            f"{c['worker_processes']} worker processes at the same time; ")
