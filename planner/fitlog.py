"""Fit the cost model to a training run's own step times (``dcp-calibrate --from-log``).

A step's simulated time (planner/cost.py) is the critical path through its microbatches: a
chain of groups, one per microbatch, whose per-rank times add up. For a fixed chain that sum is
linear in the coefficients: a group of k ranks holding padded lengths P_i (S = sum P_i,
Q = sum P_i^2) contributes

    a S / k + b Q / k + [k > 1] (k - 1) cp_fixed + [k > 1] (k - 1) S / k cp_token + m.

So each step gives one row of a least-squares problem, plus ``step_s``, a per-step constant
(the optimizer, the gradient all-reduce, data loading: in the measured seconds, not in the
cost model, fitted and reported but not written into it). The chain depends on the
coefficients, so the fit alternates: chains under the current coefficients (the plan's to
start), solve, again, until the chains stop changing (at most ``ROUNDS``). Rows are weighted by
1 / measured (relative residuals, as runtime/calibrate/fit.py).

Each coefficient comes with its standard error (sigma^2 (X^T W X)^-1, sigma^2 from the
residuals). A term is refused, with its reason, and kept at the plan's value (marked assumed in
the provenance) when the log cannot determine it: its column is zero (no step's critical path
holds a CP group of more than one rank: the ring terms), it is a combination of the others
(the columns' rank does not grow with it), or its fit is negative or smaller than its error.
The ring terms are also fitted per CP size used (``per_cp_size``), reported, not written: the
cost model has one pair for every k.

Trade-off: the chain is that of the plan's schedule under the model, not what the run did; a
rank that waits on a collective outside the model (the gradient all-reduce) is in ``step_s``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.cost import CostModel
from planner.planfile.io import PlanFile
from planner.planfile.schema import column_numpy
from planner.provenance import TERMS

ROUNDS = 8
STEP = "step_s"


def chain_features(c: NDArray[np.float64], pool_size: int, cols: dict[str, NDArray[Any]],
                   ring_sizes: tuple[int, ...] = ()) -> NDArray[np.float64]:
    """The critical chain's (S/k, Q/k, ring latency, ring tokens, microbatches) sums under
    coefficients ``c``; with ``ring_sizes``, the two ring columns once per size instead."""
    mb, start, k = cols["microbatch"], cols["rank_start"], cols["cp_size"]
    p = cols["padded_tokens"].astype(np.float64)
    width = 3 + (2 * len(ring_sizes) if ring_sizes else 2)
    finish = np.zeros(pool_size)
    feats = np.zeros((pool_size, width))
    first = np.flatnonzero(np.r_[True, (np.diff(mb) != 0) | (np.diff(start) != 0)]) \
        if len(mb) else np.zeros(0, np.intp)
    ends = np.r_[first[1:], len(mb)]
    for i, j in zip(first, ends, strict=True):
        kk, r0 = int(k[i]), int(start[i])
        s1, s2 = float(p[i:j].sum()), float((p[i:j] ** 2).sum())
        f = np.zeros(width)
        f[0], f[1], f[-1] = s1 / kk, s2 / kk, 1.0
        if kk > 1:
            at = 2 + 2 * ring_sizes.index(kk) if ring_sizes else 2
            f[at], f[at + 1] = kk - 1, (kk - 1) * s1 / kk
        t = (c[0] * s1 + c[1] * s2) / kk + c[4] + (
            (kk - 1) * (c[2] + c[3] * s1 / kk) if kk > 1 else 0.0)
        ranks = slice(r0, r0 + kk)
        lead = r0 + int(np.argmax(finish[ranks]))
        finish[ranks] = finish[lead] + t
        feats[ranks] = feats[lead] + f
    return np.asarray(feats[int(np.argmax(finish))], np.float64)


def _solve(x: NDArray[np.float64], y: NDArray[np.float64], w: NDArray[np.float64]
           ) -> tuple[NDArray[np.float64], NDArray[np.float64], float]:
    xw, yw = x * w[:, None], y * w
    # Columns scaled to unit norm first: S^2 and 1 differ by 10^8, and (X^T X)^-1 of the raw
    # columns would lose the small ones' errors to rounding.
    scale = np.linalg.norm(xw, axis=0)
    scale[scale == 0] = 1.0
    xs = xw / scale
    beta_s, *_ = np.linalg.lstsq(xs, yw, rcond=None)
    resid = yw - xs @ beta_s
    dof = max(len(y) - x.shape[1], 1)
    sigma2 = float(resid @ resid) / dof
    cov = sigma2 * np.linalg.pinv(xs.T @ xs)
    se = np.sqrt(np.maximum(np.diag(cov), 0.0)) / scale
    return beta_s / scale, se, float(np.sqrt(sigma2))


def _fit(x: NDArray[np.float64], y: NDArray[np.float64], names: list[str],
         prior: dict[str, float], reasons: dict[str, str], *, refuse: bool = True
         ) -> tuple[dict[str, float], dict[str, float], dict[str, str], float]:
    """Least squares over the determinable columns; (values, errors, refused, rel. rms).
    ``refuse=False``: terms fitted negative or below their error are kept (between rounds)."""
    w = 1.0 / np.maximum(y, 1e-12)
    refused = dict(reasons)
    while True:
        keep: list[int] = []
        for i, name in enumerate(names):
            if name in refused:
                continue
            if not np.any(x[:, i]):
                refused[name] = reasons.get(name, "its column is zero in every step")
            elif np.linalg.matrix_rank(x[:, np.array([*keep, i])] * w[:, None]) <= len(keep):
                refused[name] = "a combination of the other terms in this log"
            else:
                keep.append(i)
        fixed = np.array([i for i, n in enumerate(names) if n in refused], np.intp)
        target = y - x[:, fixed] @ np.array([prior.get(names[i], 0.0) for i in fixed])
        beta, se, rms = _solve(x[:, np.array(keep, np.intp)], target, w)
        bad = [(names[i], b, s) for i, b, s in zip(keep, beta, se, strict=True)
               if names[i] != STEP and (b < 0 or s >= abs(b))]
        if not bad or not refuse:
            return ({names[i]: float(b) for i, b in zip(keep, beta, strict=True)},
                    {names[i]: float(s) for i, s in zip(keep, se, strict=True)}, refused, rms)
        name, b, s = max(bad, key=lambda t: t[2] / max(abs(t[1]), 1e-300))
        refused[name] = f"not determined by this log: fitted {b:.3g} +- {s:.3g}"


def fit_log(plan: str, rows: list[dict[str, Any]], *, warmup: int) -> dict[str, Any]:
    """The fit of ``plan``'s cost model to the step lines ``rows`` after the first ``warmup``
    (module docstring). ValueError when fewer steps remain than terms to fit."""
    with PlanFile(plan) as f:
        header = f.header
        cm = header.cost_model
        prior_model = CostModel.from_dict({"name": cm.get("name", "plan"),
                                           "parameters": cm.get("parameters", {})})
        kept = rows[warmup:]
        if len(kept) < len(TERMS) + 2:
            raise ValueError(f"{len(kept)} steps after the {warmup} warm-up steps; the fit "
                             f"needs at least {len(TERMS) + 2} (a longer run)")
        for d in kept:
            if type(d["step"]) is not int or not 0 <= d["step"] < f.num_steps:
                raise ValueError(f"step {d['step']!r} is not a step of {plan} "
                                 f"({f.num_steps} steps): a log of another plan?")
        steps = {d["step"]: {n: column_numpy(f.step(d["step"]), n) for n in
                             ("microbatch", "rank_start", "cp_size", "padded_tokens")}
                 for d in kept}
    n = header.parallel.pool_size
    y = np.array([float(d["seconds"]) for d in kept])
    sizes = tuple(sorted({int(k) for c in steps.values() for k in np.unique(c["cp_size"])
                          if k > 1}))
    prior = dict(prior_model.parameters)
    ring_reason = ("no step's critical path holds a CP group of more than one rank"
                   if not sizes else "")
    c = prior_model.as_array()
    names = [*TERMS[:4], "microbatch_s", STEP]
    order = [TERMS[0], TERMS[1], "cp_fixed_s", "cp_token_s", "microbatch_s"]
    reasons = {t: ring_reason for t in TERMS[2:4] if ring_reason}
    for _ in range(ROUNDS):
        # The chains under c; the coefficients they give (negatives clipped for the next
        # chains: the refusals are decided once the chains have settled).
        x = np.array([[*chain_features(c, n, steps[d["step"]]), 1.0] for d in kept])
        values, errors, refused, rms = _fit(x, y, names, prior, reasons, refuse=False)
        new = np.array([max(values.get(t, prior[t]), 0.0) for t in order])
        if np.allclose(new, c, rtol=1e-9, atol=0.0):
            break
        c = new
    x = np.array([[*chain_features(c, n, steps[d["step"]]), 1.0] for d in kept])
    values, errors, refused, rms = _fit(x, y, names, prior, reasons)
    per_k: dict[str, Any] = {}
    if sizes:
        xk = np.array([[*chain_features(c, n, steps[d["step"]], sizes), 1.0] for d in kept])
        kn = [TERMS[0], TERMS[1], *[f"{t}@{k}" for k in sizes for t in TERMS[2:4]],
              "microbatch_s", STEP]
        vk, ek, rk, _ = _fit(xk, y, kn, prior, {})
        for k in sizes:
            per_k[str(k)] = {t: ({"value": vk[f"{t}@{k}"], "error": ek[f"{t}@{k}"]}
                                 if f"{t}@{k}" in vk else {"refused": rk[f"{t}@{k}"]})
                             for t in TERMS[2:4]}
    fitted: dict[str, Any] = {t: values[t] for t in TERMS if t in values}
    model = replace(prior_model, **fitted)
    return {"model": model, "values": values, "errors": errors, "refused": refused,
            "relative_rms": rms, "steps": [d["step"] for d in kept],
            "warmup_steps": [d["step"] for d in rows[:warmup]], "cp_sizes": list(sizes),
            "per_cp_size": per_k}
