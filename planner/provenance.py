"""Where a cost model comes from, which of its terms were measured, and when to warn about it.

Every number a plan shows is a prediction of its cost model, so a plan says how far to trust
it. ``of_document`` reads a cost-model JSON (a preset or a ``--cost-model FILE``) into a
provenance record that the header keeps as ``cost_model.provenance`` (docs/PLAN_FORMAT.md):

- ``kind``: ``preset`` (an estimate shipped in ``planner/presets``), ``file`` (a JSON with no
  measurement recorded: an estimate too), ``calibrated`` (written by ``dcp-calibrate``: a
  ``measured`` block) or ``fitted`` (reserved for a model fitted from a training run's log:
  a top-level ``fitted`` object with ``log``, ``date`` and ``terms``, the parameters the log
  determined);
- ``source``: the preset's name or the file's path as given; ``device``, ``date``, ``log``
  where known;
- ``terms``: per parameter ``measured`` or ``assumed``. A calibration measures the compute
  and microbatch terms; its ring terms (``cp_fixed_s``, ``cp_token_s``) only with >= 2
  processes (``measured.ring_measured``; on one process they are written as 0).

``warning`` gives one line, or None, when a term that decides the plan is assumed: the compute
and microbatch terms always decide it; the ring terms when CP > 1 groups are in use (in the
plan, or in the static-CP baseline its gain is measured against). The provenance is a function
of the cost-model file alone (no clock, no host), so plans stay byte-identical.
"""

from __future__ import annotations

from typing import Any

TERMS = ("linear_s_per_token", "attention_s_per_token2", "cp_fixed_s", "cp_token_s",
         "microbatch_s")
"""The cost model's parameters (``planner.cost.CostModel``), in formula order."""
RING = ("cp_fixed_s", "cp_token_s")
MEASURED = "measured"
ASSUMED = "assumed"
KINDS = ("preset", "file", "calibrated", "fitted")
NOT_RECORDED = "provenance not recorded (the plan was made before dcp-plan recorded it)"


def of_document(doc: dict[str, Any], *, source: str, preset: bool) -> dict[str, Any]:
    """The provenance of a cost-model JSON ``doc`` read from ``source`` (a preset's name when
    ``preset``, else the path given)."""
    fitted = doc.get("fitted")
    measured = doc.get("measured")
    if isinstance(fitted, dict):
        terms = fitted.get("terms")
        known = {t for t in (terms if isinstance(terms, list) else []) if t in TERMS}
        return {"kind": "fitted", "source": source, "log": str(fitted.get("log", "")),
                "date": str(fitted.get("date", "")), "terms": _terms(known)}
    if isinstance(measured, dict):
        samples = measured.get("samples")
        sizes = sorted({s["cp_size"] for s in (samples if isinstance(samples, list) else [])
                        if isinstance(s, dict) and type(s.get("cp_size")) is int
                        and s["cp_size"] > 1})
        ring = bool(measured.get("ring_measured", bool(sizes)))
        known = set(TERMS) - (set() if ring else set(RING))
        machine = str(measured.get("machine", "")) or "an unnamed device"
        world = measured.get("world_size")
        on = f"{world} x {machine}" if world else machine
        if measured.get("device") == "cpu":
            on += " (cpu)"
        out: dict[str, Any] = {"kind": "calibrated", "source": source, "device": on,
                               "date": str(measured.get("date", "")), "terms": _terms(known)}
        if ring and sizes:
            out["ring_cp_sizes"] = sizes
        return out
    return {"kind": "preset" if preset else "file", "source": source, "terms": _terms(set())}


def _terms(measured: set[str]) -> dict[str, str]:
    return {t: MEASURED if t in measured else ASSUMED for t in TERMS}


def label(prov: dict[str, Any] | None) -> str:
    """``preset (estimate)``, ``calibrated on 2 x NVIDIA H200 2026-11-30``, ``fitted from
    train.jsonl``, or why there is none."""
    if not prov:
        return NOT_RECORDED
    kind = prov.get("kind")
    if kind == "preset":
        return "preset (estimate)"
    if kind == "file":
        return "file (estimate: no measurement recorded)"
    date = prov.get("date") or "(date not recorded)"
    if kind == "calibrated":
        return f"calibrated on {prov.get('device', '?')} {date}"
    if kind == "fitted":
        return f"fitted from {prov.get('log') or '?'} {date}"
    return f"unknown provenance {kind!r}"


def terms_text(prov: dict[str, Any] | None) -> str:
    """``measured linear_s_per_token, ...; assumed cp_fixed_s, cp_token_s`` ('' if unknown)."""
    terms = (prov or {}).get("terms") or {}
    if not terms:
        return ""
    measured = [t for t in TERMS if terms.get(t) == MEASURED]
    assumed = [t for t in TERMS if terms.get(t) != MEASURED]
    ring = (prov or {}).get("ring_cp_sizes")
    where = f" (ring at cp {', '.join(map(str, ring))})" if ring else ""
    if not measured:
        return f"all {len(TERMS)} terms assumed"
    if not assumed:
        return f"all {len(TERMS)} terms measured{where}"
    return f"measured {', '.join(measured)}{where}; assumed {', '.join(assumed)}"


def mark(name: str, prov: dict[str, Any] | None) -> str:
    """The one-line mark every reader prints: ``dense-7b-h200: preset (estimate); all 5 terms
    assumed``."""
    text = terms_text(prov)
    return f"{name}: {label(prov)}" + (f"; {text}" if text else "")


def warning(prov: dict[str, Any] | None, parameters: dict[str, Any], *, ring_used: str
            ) -> str | None:
    """One line when a term that decides the plan is assumed, else None.

    Args:
        prov: the provenance (None: not recorded, no warning).
        parameters: the cost model's parameters (for the ring terms' values).
        ring_used: where CP > 1 groups are in use (``'cp2: 148, cp4: 21'``), '' if nowhere;
            the ring terms decide the plan only then.
    """
    terms = (prov or {}).get("terms") or {}
    if not terms:
        return None
    deciding = [t for t in TERMS if t not in RING or ring_used]
    assumed = [t for t in deciding if terms.get(t) != MEASURED]
    if not assumed:
        return None
    if len(assumed) == len(deciding) and not any(v == MEASURED for v in terms.values()):
        what = {"preset": "a preset", "file": "a file"}.get(str((prov or {}).get("kind")),
                                                             "its source")
        return (f"the cost model is an estimate ({what}; no term measured), and so is every "
                "time and gain here; dcp-calibrate measures your hardware's")
    text = ", ".join(assumed)
    ring = [t for t in assumed if t in RING]
    if ring:
        values = ", ".join(f"{t} = {float(parameters.get(t, 0.0)):g}" for t in ring)
        why = (" (one process: dcp-calibrate measured no ring)" if
               (prov or {}).get("kind") == "calibrated" else "")
        zero = all(float(parameters.get(t, 0.0)) == 0.0 for t in ring)
        return (f"assumed, not measured: {text} ({values}{why}) while CP > 1 groups are in "
                f"use ({ring_used}): " + ("CP is priced as free, so " if zero else "")
                + "the CP sizes chosen and the gain over static CP rest on a guess; "
                "calibrate on >= 2 processes")
    return (f"assumed, not measured: {text}: the plan's choices and its gain rest on a guess "
            "for them")


def ring_use(header: Any) -> str:
    """Where a plan uses CP > 1 groups: its own groups per size, and the static-CP baseline
    at cp > 1 when it was scored ('' if nowhere)."""
    groups = {int(k): int(v) for k, v in header.stats.get("cp_size_groups", {}).items()}
    used = [f"cp{k}: {v:,}" for k, v in sorted(groups.items()) if k > 1 and v]
    static = (header.stats.get("baselines") or {}).get("static-cp") or {}
    cp = int(static.get("cp", header.parallel.cp))
    if cp > 1 and static and "not_scored" not in static:
        used.append(f"static CP {cp} baseline")
    return ", ".join(used)


def of_header(header: Any) -> tuple[str, str | None]:
    """A plan's (mark, warning) from its header (an older plan: no provenance, no warning)."""
    cm = header.cost_model
    prov = cm.get("provenance")
    name = str(cm.get("name"))
    return mark(name, prov), warning(prov, cm.get("parameters", {}), ring_used=ring_use(header))
