"""Cost model (as data) and the step simulator that every plan, ours or a baseline's, is scored by.

A group of size k whose packed buffer holds padded lengths P_i takes, on each of its k ranks,

    t = sum_i(a * P_i + b * P_i^2) / k                       # GEMMs + causal attention, k ways
        + [k > 1] * (k - 1) * (cp_fixed_s + cp_token_s * S / k)   # ring exchange of K/V chunks
        + microbatch_s                                       # per-microbatch fixed cost

with S = sum_i P_i. The ring term: each of the k-1 ring steps moves one rank's S/k tokens of K/V
and pays a fixed latency. Parameters are seconds for one forward+backward of the whole model on
one rank; they live in JSON files (``planner/presets``) and are recorded in the plan header.

Evaluation plans have no backward: ``CostModel.forward_only`` scales the per-token terms (a, b,
cp_token_s) by ``forward_fraction`` (default 1/3: a GEMM's backward is two GEMMs of the same size,
flash attention's backward costs about 2-2.5x its forward, and the ring's backward moves K/V and
dK/dV, twice the forward's traffic), halves cp_fixed_s (the forward runs k-1 of the 2(k-1) ring
steps) and keeps microbatch_s whole (a fixed cost per microbatch). A cost-model JSON may carry its
own ``forward_fraction`` (top level) where it was measured.

Step time is the critical path through the microbatches: a group starts microbatch m when every
member has finished its microbatch m-1 (``simulate_step``). Lower bound of a step:
max(sum of each sequence's cheapest per-rank work / N, the most expensive single sequence at its
best size).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.fileguard import check_input
from planner.groups import pad_multiple
from planner.jit import kernel
from planner.provenance import of_document

PRESET_DIR = Path(__file__).with_name("presets")
DEFAULT_PRESET = "dense-7b-h200"
DEFAULT_FORWARD_FRACTION = 1.0 / 3.0
"""Forward seconds / (forward + backward) seconds of the per-token terms (module docstring)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Per-rank time of a group; see the module docstring for the formula."""

    name: str
    linear_s_per_token: float
    """a: GEMM (and other per-token) seconds per padded token, fwd+bwd, whole model."""
    attention_s_per_token2: float
    """b: causal attention seconds per padded length squared, fwd+bwd, whole model."""
    cp_fixed_s: float = 0.0
    """Latency of one ring step of K/V exchange (k-1 steps per microbatch at size k)."""
    cp_token_s: float = 0.0
    """Seconds per token of K/V received in one ring step (a rank's S/k tokens)."""
    microbatch_s: float = 0.0
    """Fixed seconds per microbatch (launches, optimizer-free per-microbatch work)."""
    description: str = ""
    forward_fraction: float = DEFAULT_FORWARD_FRACTION
    """Forward share of the per-token terms, used by ``forward_only`` (eval plans); in (0, 1]."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """Where the parameters come from and which were measured (``planner.provenance``; set by
    ``load_cost_model``); empty: unknown, and absent from the header."""

    def __post_init__(self) -> None:
        share = self.forward_fraction
        if not (isinstance(share, (int, float)) and 0.0 < share <= 1.0):
            raise ValueError(f"cost model {self.name!r}: forward_fraction must be in (0, 1], "
                             f"got {share!r}")
        for f in ("linear_s_per_token", "attention_s_per_token2", "cp_fixed_s", "cp_token_s",
                  "microbatch_s"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"cost model {self.name!r}: {f} must be a finite number >= 0, "
                                 f"got {v!r}")

    @property
    def parameters(self) -> dict[str, float]:
        d = asdict(self)
        d.pop("name")
        d.pop("description")
        d.pop("forward_fraction")
        d.pop("provenance")
        return d

    def to_header(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "parameters": self.parameters,
                                  "description": self.description}
        if self.provenance:
            out["provenance"] = dict(self.provenance)
        return out

    def as_array(self) -> NDArray[np.float64]:
        """(a, b, cp_fixed, cp_token, microbatch) for numba kernels."""
        return np.array([self.linear_s_per_token, self.attention_s_per_token2, self.cp_fixed_s,
                         self.cp_token_s, self.microbatch_s], dtype=np.float64)

    def forward_only(self) -> CostModel:
        """The forward-only cost of this model (eval plans; see the module docstring)."""
        f = self.forward_fraction
        return CostModel(
            name=f"{self.name}/forward", linear_s_per_token=self.linear_s_per_token * f,
            attention_s_per_token2=self.attention_s_per_token2 * f,
            cp_fixed_s=self.cp_fixed_s / 2, cp_token_s=self.cp_token_s * f,
            microbatch_s=self.microbatch_s, forward_fraction=1.0,
            description=f"forward only (forward_fraction {f:.6g}) of {self.name}: "
                        f"{self.description}".rstrip(": "), provenance=self.provenance)

    def group_time(self, cp_size: int, padded: NDArray[np.integer] | list[int]) -> float:
        """Per-rank seconds of one group of size ``cp_size`` holding ``padded`` lengths."""
        p = np.asarray(padded, dtype=np.float64)
        return float(_group_time(self.as_array(), cp_size, p.sum(), (p * p).sum()))

    def sequence_time(self, cp_size: int, padded: int) -> float:
        """Per-rank seconds of a group holding only this sequence, without the microbatch cost."""
        return self.group_time(cp_size, [padded]) - self.microbatch_s

    @classmethod
    def from_dict(cls, d: dict[str, object], *, source: str = "cost model") -> CostModel:
        params = d.get("parameters", d)
        if not isinstance(params, dict):
            raise ValueError(f"{source}: 'parameters' must be an object")
        known = {"linear_s_per_token", "attention_s_per_token2", "cp_fixed_s", "cp_token_s",
                 "microbatch_s"}
        unknown = set(params) - known - {"name", "description", "forward_fraction"}
        if unknown:
            raise ValueError(f"{source}: unknown cost-model parameters {sorted(unknown)}")
        missing = {"linear_s_per_token", "attention_s_per_token2"} - set(params)
        if missing:
            raise ValueError(f"{source}: missing cost-model parameters {sorted(missing)}")
        fraction = d.get("forward_fraction", params.get("forward_fraction",
                                                        DEFAULT_FORWARD_FRACTION))
        if not isinstance(fraction, (int, float)):
            raise ValueError(f"{source}: forward_fraction must be a number, got {fraction!r}")
        values: dict[str, Any] = {}  # (Any: mypy would match provenance too)
        for k, v in params.items():
            if k not in known:
                continue
            # bool is an int subclass, and float("1e-6") would accept a string: numbers only.
            if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{source}: cost-model parameter {k} must be a finite number "
                                 f">= 0, got {v!r}")
            values[k] = float(v)
        return cls(name=str(d.get("name", source)), description=str(d.get("description", "")),
                   forward_fraction=float(fraction), **values)


def load_cost_model(name_or_path: str = "default") -> CostModel:
    """A preset by name (``default`` = dense-7b-h200) or a JSON file by path."""
    if name_or_path in ("", "default"):
        name_or_path = DEFAULT_PRESET
    path = Path(name_or_path)
    preset = not path.suffix
    if preset:
        path = PRESET_DIR / f"{name_or_path}.json"
        if not path.is_file():
            names = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
            raise ValueError(f"unknown cost model {name_or_path!r} (presets: {', '.join(names)})")
    if not path.exists():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
        raise ValueError(f"{path}: no such cost model file (a JSON file, e.g. from "
                         f"dcp-calibrate, or a preset name: {', '.join(names)})")
    check_input(path, "a cost model")  # a FIFO would block the read
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read cost model: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: cost model must be a JSON object")
    model = CostModel.from_dict(d, source=str(path))
    origin = of_document(d, source=name_or_path if preset else str(path), preset=preset)
    return replace(model, provenance=origin)


@kernel
def _group_time(c: NDArray[np.float64], k: int, s1: float, s2: float) -> float:
    t: float = (c[0] * s1 + c[1] * s2) / k + c[4]
    if k > 1:
        t += (k - 1) * (c[2] + c[3] * s1 / k)
    return t


@kernel
def _simulate(c: NDArray[np.float64], pool_size: int, mb: NDArray[np.int32],
              start: NDArray[np.int32], k: NDArray[np.int32], padded: NDArray[np.int32]
              ) -> tuple[float, float]:
    """Critical-path time and the sum over ranks of busy time, for one step's rows."""
    finish = np.zeros(pool_size, dtype=np.float64)
    busy = 0.0
    n = len(mb)
    i = 0
    while i < n:
        j = i
        s1 = 0.0
        s2 = 0.0
        while j < n and mb[j] == mb[i] and start[j] == start[i]:
            p = float(padded[j])
            s1 += p
            s2 += p * p
            j += 1
        kk = k[i]
        t = _group_time(c, kk, s1, s2)
        r0 = start[i]
        begin = 0.0
        for r in range(r0, r0 + kk):
            if finish[r] > begin:
                begin = finish[r]
        for r in range(r0, r0 + kk):
            finish[r] = begin + t
        busy += t * kk
        i = j
    return finish.max(), busy


@kernel
def _terms(c: NDArray[np.float64], pool_size: int, mb: NDArray[np.int64],
           start: NDArray[np.int64], k: NDArray[np.int64], padded: NDArray[np.int64],
           real: NDArray[np.int64]) -> NDArray[np.float64]:
    """(padding, ring, microbatch) seconds per rank of one step's rows: the rank-seconds of
    each term summed over its groups, over N (``step_terms``)."""
    out = np.zeros(3, dtype=np.float64)
    ranks = 0
    n = len(mb)
    i = 0
    while i < n:
        j = i
        s1 = 0.0
        while j < n and mb[j] == mb[i] and start[j] == start[i]:
            p = float(padded[j])
            q = float(real[j])
            s1 += p
            # Padding is charged at the cost of the tokens it adds: a (P - L) + b (P^2 - L^2).
            out[0] += c[0] * (p - q) + c[1] * (p * p - q * q)
            j += 1
        kk = k[i]
        if kk > 1:
            out[1] += kk * (kk - 1) * (c[2] + c[3] * s1 / kk)
        ranks += kk
        i = j
    # Counted in ranks (an integer), so two layouts of as many microbatches give equal bits.
    out[2] = ranks * c[4]
    return out / pool_size


def step_terms(cost: NDArray[np.float64], pool_size: int, microbatch: NDArray[np.integer],
               rank_start: NDArray[np.integer], cp_size: NDArray[np.integer],
               padded_tokens: NDArray[np.integer], num_tokens: NDArray[np.integer]
               ) -> NDArray[np.float64]:
    """A step's time split by the cost model's terms: (padding, ring, microbatch) seconds.

    Each is the rank-seconds the term costs over the step's groups, over N: a group of size k
    pays each term on its k ranks (``group_time``), so the step's total rank-seconds over N are
    real compute + padding + ring + microbatch exactly. The critical path exceeds that mean by
    the ranks' imbalance (idle time): ``simulate_step - (real + the three terms)``. Real
    compute (a L + b L^2 of every segment) is the same for any layout of the same segments, so
    the difference of two layouts' step times is the difference of these three terms plus the
    difference of their imbalance (planfile/gain.py's parts).
    """
    return np.asarray(_terms(np.asarray(cost, np.float64), pool_size,
                             np.asarray(microbatch, np.int64), np.asarray(rank_start, np.int64),
                             np.asarray(cp_size, np.int64), np.asarray(padded_tokens, np.int64),
                             np.asarray(num_tokens, np.int64)), dtype=np.float64)


def group_seconds(cost: CostModel, cp_size: NDArray[np.integer], s1: NDArray[np.floating],
                  s2: NDArray[np.floating]) -> NDArray[np.float64]:
    """Per-rank seconds of groups (vectorised ``CostModel.group_time``) from each group's sum
    of padded lengths ``s1`` and of their squares ``s2``."""
    a, b, cp_fixed, cp_token, micro = cost.as_array()
    k = np.asarray(cp_size, dtype=np.float64)
    ring = np.where(k > 1, (k - 1) * (cp_fixed + cp_token * s1 / k), 0.0)
    return np.asarray((a * s1 + b * s2) / k + micro + ring, dtype=np.float64)


def simulate_step(cost: CostModel, pool_size: int, microbatch: NDArray[np.integer],
                  rank_start: NDArray[np.integer], cp_size: NDArray[np.integer],
                  padded_tokens: NDArray[np.integer]) -> float:
    """Simulated seconds of one step: the critical path through its microbatches.

    Rows must be sorted by (microbatch, rank_start), as in a plan file.
    """
    t, _ = _simulate(cost.as_array(), pool_size, np.asarray(microbatch, np.int32),
                     np.asarray(rank_start, np.int32), np.asarray(cp_size, np.int32),
                     np.asarray(padded_tokens, np.int32))
    return float(t)


@kernel
def _cheapest(lengths: NDArray[np.int64], sizes: NDArray[np.int64], mults: NDArray[np.int64],
              capacity: int, c: NDArray[np.float64]) -> tuple[NDArray[np.float64],
                                                             NDArray[np.float64]]:
    """Per sequence, (its cheapest work, its fastest time) over the sizes that hold it (inf:
    none does); ``step_lower_bound``'s terms, with numpy's operation order, so the same bits."""
    n = len(lengths)
    best_work = np.full(n, np.inf)
    best_time = np.full(n, np.inf)
    for lv in range(len(sizes)):
        k = sizes[lv]
        m = mults[lv]
        lat = (k - 1) * c[2] if k > 1 else 0.0
        mask = -m if m & (m - 1) == 0 else 0      # a power of two rounds up by a mask
        for i in range(n):
            p = float((lengths[i] + m - 1) & mask if mask else -(-lengths[i] // m) * m)
            if k * capacity >= p:
                work = c[0] * p + c[1] * p * p + (k - 1) * c[3] * p
                best_work[i] = min(best_work[i], work)
                best_time[i] = min(best_time[i], work / k + lat)
    return best_work, best_time


def step_lower_bound(cost: CostModel, pool_size: int, lengths: NDArray[np.integer],
                     sizes: tuple[int, ...], capacity: int, tp_eff: int, layout: str,
                     num_microbatches_min: int = 1, *, pad_to: int = 1) -> float:
    """max(sum of each sequence's cheapest rank-seconds / N, the costliest single sequence).

    A sequence's cheapest work is min over feasible k of k * t(k) (rank-seconds, no microbatch
    cost) without the ring's fixed latency, which a group pays once however many sequences it
    packs (charging it per sequence would overstate the bound); its fastest time is min over
    feasible k of t(k), latency included, since the group holding it pays at least that.
    ``num_microbatches_min`` microbatch costs are added: every rank runs that many microbatches.
    """
    L = np.asarray(lengths, dtype=np.int64)
    ks = np.asarray(sizes, dtype=np.int64)
    ms = np.array([pad_multiple(int(k), tp_eff, layout, pad_to) for k in ks], dtype=np.int64)
    best_work, best_time = _cheapest(L, ks, ms, capacity, cost.as_array())
    finite = np.isfinite(best_work)
    work = float(best_work[finite].sum()) / pool_size
    single = float(best_time[finite].max()) if finite.any() else 0.0
    return max(work, single) + num_microbatches_min * cost.microbatch_s
