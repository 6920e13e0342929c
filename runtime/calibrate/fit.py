"""Fit the planner's cost model to measured microbatch times (pure numpy; no torch, no I/O).

``dcp-calibrate`` (runtime/calibrate/run.py) times microbatches and hands them here as ``Sample``s:
a group size k, the padded document lengths of the group's whole packed buffer, and the seconds
one rank took for forward + backward. The model (planner/cost.py) says one rank of the group takes

    t = (a S + b Q) / k + [k > 1] (k - 1) (cp_fixed + cp_token S / k) + m,
    S = sum_i P_i,  Q = sum_i P_i^2.

Two fits, in this order:
1. CP=1 samples: t = m + a S + b Q is linear in (m, a, b) -> non-negative least squares.
2. CP>1 samples: subtract the fitted compute, y = t - (a S + b Q) / k - m, and fit
   y = (k - 1) cp_fixed + ((k - 1) S / k) cp_token, again non-negative.

Both minimise *relative* residuals ((fit - t) / t, rows weighted by 1/t): measured times span
milliseconds to seconds, and an absolute fit would ignore the small microbatches whose fixed costs
decide how many short documents the planner packs together.

Non-negative least squares with 2-3 unknowns is solved exactly by enumeration: the optimum's
support is some subset of the columns, and on that subset it is the unconstrained least-squares
solution, so the best non-negative unconstrained solution over all subsets is the optimum (no
scipy needed). Example: data with t = 2 + 3 S exactly gives (m, a, b) = (2, 3, 0).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from planner.cost import CostModel


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured configuration: a group of ``cp_size`` ranks and its packed buffer."""

    cp_size: int
    lengths: tuple[int, ...]
    """Padded lengths of the group's documents (the whole buffer, not one rank's shard)."""
    seconds: float
    """Median over repeats of the slowest rank's forward + backward seconds."""
    repeats: tuple[float, ...] = field(default=())
    """Every repeat's slowest-rank seconds, for the record."""

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def sum_sq(self) -> float:
        return float(sum(float(n) * n for n in self.lengths))

    def describe(self) -> str:
        """Run-length form of the lengths, longest first: ``1x32768+64x512``."""
        counts: dict[int, int] = {}
        for n in self.lengths:
            counts[n] = counts.get(n, 0) + 1
        return "+".join(f"{c}x{n}" for n, c in sorted(counts.items(), reverse=True))


@dataclass(frozen=True, slots=True)
class Fit:
    """The fitted model and how well it explains each sample."""

    model: CostModel
    samples: tuple[Sample, ...]
    predicted: tuple[float, ...]
    ring_measured: bool
    """False when no sample had cp_size > 1 (cp_fixed_s and cp_token_s are then 0)."""

    def relative_errors(self) -> NDArray[np.float64]:
        """(predicted - measured) / measured, per sample."""
        t = np.array([s.seconds for s in self.samples])
        err: NDArray[np.float64] = np.asarray(self.predicted) / t - 1.0
        return err

    def summary(self) -> dict[str, float]:
        """RMS and largest absolute relative error, over CP=1 samples and over CP>1 samples."""
        err = self.relative_errors()
        single = np.array([s.cp_size == 1 for s in self.samples])
        out: dict[str, float] = {}
        for name, sel in (("cp1", single), ("cp", ~single)):
            if sel.any():
                out[f"{name}_rms_rel_error"] = float(np.sqrt(np.mean(err[sel] ** 2)))
                out[f"{name}_max_abs_rel_error"] = float(np.abs(err[sel]).max())
        return out


def nnls(a: NDArray[np.float64], y: NDArray[np.float64]) -> NDArray[np.float64]:
    """argmin ||a x - y|| subject to x >= 0, exactly, for a handful of columns.

    Args:
        a: [rows, cols] design matrix, cols <= 8 (2^cols subsets are tried).
        y: [rows] targets.
    """
    a = np.asarray(a, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    rows, cols = a.shape
    assert cols <= 8, "enumeration is exponential in the number of columns"
    best = np.zeros(cols)
    best_res = float(y @ y)
    for size in range(1, cols + 1):
        for support in itertools.combinations(range(cols), size):
            sub = a[:, support]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            # Unconstrained solutions that leave the feasible set are not candidates; tiny
            # negatives are rounding of a zero and are clipped.
            scale = np.abs(x).max() if x.size else 0.0
            if np.any(x < -1e-12 * max(scale, 1e-300)):
                continue
            x = np.clip(x, 0.0, None)
            r = sub @ x - y
            res = float(r @ r)
            if res < best_res * (1 - 1e-12):
                best_res = res
                best = np.zeros(cols)
                best[list(support)] = x
    return best


def _weighted(a: NDArray[np.float64], y: NDArray[np.float64],
              t: NDArray[np.float64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    w = 1.0 / t
    return a * w[:, None], y * w


def fit_compute(samples: list[Sample]) -> tuple[float, float, float]:
    """(a, b, m) from the CP=1 samples: t = m + a S + b Q, relative non-negative least squares.

    Raises:
        ValueError: fewer than 3 CP=1 samples, or they do not vary both S and Q.
    """
    single = [s for s in samples if s.cp_size == 1]
    if len(single) < 3:
        raise ValueError(f"need at least 3 CP=1 samples to fit (m, a, b), got {len(single)}")
    t = np.array([s.seconds for s in single])
    design = np.column_stack([np.ones(len(single)), [s.num_tokens for s in single],
                              [s.sum_sq for s in single]])
    # Columns are rescaled to unit size so that lstsq's rank cut-off sees comparable numbers
    # (S ~ 1e4, Q ~ 1e9); the solution is scaled back afterwards.
    col = np.abs(design).max(axis=0)
    if np.linalg.matrix_rank(design / col) < 3:
        raise ValueError("CP=1 samples must vary both the total tokens and the document lengths")
    x = nnls(*_weighted(design / col, t, t)) / col
    m, a, b = (float(v) for v in x)
    return a, b, m


def fit_ring(samples: list[Sample], a: float, b: float, m: float) -> tuple[float, float]:
    """(cp_fixed, cp_token) from the CP>1 samples, given the compute terms; (0, 0) if none."""
    ring = [s for s in samples if s.cp_size > 1]
    if not ring:
        return 0.0, 0.0
    t = np.array([s.seconds for s in ring])
    k = np.array([s.cp_size for s in ring], dtype=np.float64)
    total = np.array([s.num_tokens for s in ring], dtype=np.float64)
    sum_sq = np.array([s.sum_sq for s in ring])
    y = t - (a * total + b * sum_sq) / k - m
    design = np.column_stack([k - 1, (k - 1) * total / k])
    col = np.abs(design).max(axis=0)
    x = nnls(*_weighted(design / col, y, t)) / col
    return float(x[0]), float(x[1])


def fit_cost_model(samples: list[Sample], *, name: str, description: str = "") -> Fit:
    """Both fits; returns the ``CostModel`` and its prediction for every sample."""
    a, b, m = fit_compute(samples)
    cp_fixed, cp_token = fit_ring(samples, a, b, m)
    model = CostModel(name=name, description=description, linear_s_per_token=a,
                      attention_s_per_token2=b, cp_fixed_s=cp_fixed, cp_token_s=cp_token,
                      microbatch_s=m)
    predicted = tuple(model.group_time(s.cp_size, list(s.lengths)) for s in samples)
    return Fit(model=model, samples=tuple(samples), predicted=predicted,
               ring_measured=any(s.cp_size > 1 for s in samples))


def format_table(fit: Fit) -> str:
    """Measured against fitted milliseconds, one line per sample (the last thing printed)."""
    lines = [f"{'cp':>3} {'tokens':>8} {'documents':<22} {'measured ms':>12} {'fitted ms':>10} "
             f"{'error':>7}"]
    for s, p, e in zip(fit.samples, fit.predicted, fit.relative_errors(), strict=True):
        lines.append(f"{s.cp_size:>3} {s.num_tokens:>8} {s.describe():<22} "
                     f"{s.seconds * 1e3:>12.3f} {p * 1e3:>10.3f} {e * 100:>+6.1f}%")
    for key, value in fit.summary().items():
        lines.append(f"{key}: {value * 100:.1f}%")
    return "\n".join(lines)
