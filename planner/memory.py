"""A rank's peak memory per microbatch, from the plan's rows and the model's shape, before
anything runs: ``dcp-train`` checks the heaviest microbatch against the device before its first
step, and ``dcp-plan --memory-per-rank 80GB --memory-model SHAPE`` refuses a plan with one over.

A rank of a CP group of k ranks whose packed buffer holds padded lengths P_i (S = sum P_i)
peaks, over forward and backward, at

    fixed + per_token * S / k + [k > 1] * per_gathered_token * S
          + per_score * (held * sum P_i^2 + transient * max P_i^2) / k

- ``fixed``: weights, gradients and Adam's two moments in fp32 (16 bytes a parameter);
  ``resident``: what a process holds at the check (the weights, 4 bytes a parameter), which a
  CPU check against the host's available memory has already paid.
- ``per_token``: activations saved for backward and the logits, per token this rank holds.
- ``per_gathered_token``: K and V all-gathered from the group and saved (reference, torch).
- scores, for the backends that hold them: the CPU reference attention (``reference``, any
  device) keeps each sequence's L x L fp32 scores per head, (L / k) x L on a rank of k, saved
  once per layer (``held`` = layers) plus two transient copies of the sequence being computed
  (``transient`` = 2): O(L^2) memory. ``torch`` on CPU (its SDPA stand-in with an explicit
  mask) is counted the same; ``te`` and ``torch`` on CUDA use fused kernels that keep none.

Measured here (CPU, fp32, 2026-12-02; ``VmHWM`` of one process, vocab 256, hidden 64, 4 heads):
one 4,096-token sequence adds 1,024 MiB of scores at 2 layers and 1,535 MiB at 4, against
4 B x 4 heads x 4096^2 x (layers + 2) = 1,024 and 1,536 MiB. The per-token term is an
estimate (24 hidden-widths and 4 MLP-widths a layer, 4 vocab-widths for the logits and their
gradient), within about a factor of 2 of what these runs showed: the scores decide long
sequences.

Trade-off: an analytic model, not a probe, so it runs offline on the plan alone; allocator
slack and fragmentation are not in it, which is why the budget is a fraction of the device.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

QUADRATIC = {("reference", "cpu"), ("reference", "cuda"), ("torch", "cpu")}
"""(attention backend, device) pairs that hold L x L scores."""
FP32 = 4
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``80GB`` (10^9), ``80GiB`` (2^30), ``512MB``, ``1e9``: a byte count; ValueError else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"not a memory size: {text!r} (e.g. 80GB, 80GiB, 512MB)")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Per-rank peak bytes of a microbatch (module docstring for the formula)."""

    fixed_bytes: float
    resident_bytes: float
    per_token: float
    per_gathered_token: float
    per_score: float
    """Bytes per score element (fp32 x heads); 0 for fused attention."""
    held: float
    transient: float = 2.0
    description: str = ""

    @classmethod
    def from_shape(cls, *, vocab_size: int, num_layers: int, hidden_size: int, num_heads: int,
                   num_query_groups: int, ffn_hidden_size: int = 0, tie_embeddings: bool = True,
                   attention: str = "reference", device: str = "cpu") -> MemoryModel:
        """The model of ``dcp-train``'s GPT (runtime/train/model.py) in fp32."""
        h, layers = hidden_size, num_layers
        ffn = ffn_hidden_size or 4 * h
        head_dim = h // num_heads
        kv = num_query_groups * head_dim
        per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h
        params = vocab_size * h * (1 if tie_embeddings else 2) + layers * per_layer + h
        quadratic = (attention, device) in QUADRATIC
        return cls(fixed_bytes=16.0 * params, resident_bytes=4.0 * params,
                   per_token=FP32 * (layers * (24 * h + 4 * ffn) + 4 * vocab_size),
                   per_gathered_token=FP32 * layers * 2 * kv if attention != "te" else 0.0,
                   per_score=FP32 * num_heads if quadratic else 0.0, held=float(layers),
                   description=f"{layers} layers, hidden {h}, {num_heads} heads, "
                               f"{attention} attention on {device}"
                               + (" (O(L^2) scores)" if quadratic else ""))

    def group_peaks(self, cp_size: NDArray[Any], s1: NDArray[Any], s2: NDArray[Any],
                    longest: NDArray[Any]) -> NDArray[np.float64]:
        """Per-rank peak bytes of groups from each one's size, sum of padded lengths, sum of
        their squares and the longest."""
        k = np.asarray(cp_size, np.float64)
        s1f, s2f = np.asarray(s1, np.float64), np.asarray(s2, np.float64)
        top = np.asarray(longest, np.float64) ** 2
        return np.asarray(self.fixed_bytes + self.per_token * s1f / k
                          + np.where(k > 1, self.per_gathered_token * s1f, 0.0)
                          + self.per_score * (self.held * s2f + self.transient * top) / k,
                          np.float64)

    def longest_fitting(self, cp_size: int, budget: float) -> int:
        """The longest single sequence a rank of a group of ``cp_size`` holds within
        ``budget`` bytes (0: none)."""
        lo, hi = 0, 1 << 31
        while lo < hi:
            mid = (lo + hi + 1) // 2
            peak = self.group_peaks(np.array([cp_size]), np.array([mid]),
                                    np.array([float(mid) ** 2]), np.array([mid]))[0]
            lo, hi = (mid, hi) if peak <= budget else (lo, mid - 1)
        return lo

    def worst_group_peak(self, length: int, sizes: tuple[int, ...], capacity: int,
                         multiples: tuple[int, ...]) -> float:
        """The highest per-rank peak of any group a plan can form when no sequence holds more
        than ``length`` real tokens: at each size k (padding multiple m), a group packed full
        (k x ``capacity`` padded tokens) with sequences of the longest padded length that fits,
        which maximizes every term (the sum of squares under a fixed sum and a cap on each is
        largest with as many at the cap as fit)."""
        worst = 0.0
        for k, m in zip(sizes, multiples, strict=True):
            hold = k * capacity // m * m
            top = min(-(-length // m) * m, hold)
            if top <= 0:
                continue
            q, r = divmod(hold, top)
            peak = self.group_peaks(np.array([k]), np.array([hold]),
                                    np.array([float(q) * top * top + float(r) * r]),
                                    np.array([top]))[0]
            worst = max(worst, float(peak))
        return worst

    def segment_cap(self, budget: float, sizes: tuple[int, ...], capacity: int,
                    multiples: tuple[int, ...], upper: int) -> int:
        """The longest segment (real tokens, at most ``upper``) that keeps every group a plan
        can form within ``budget`` (``worst_group_peak``), rounded down to the largest size's
        padding multiple where that leaves one; ``upper`` when it already does, 0 when even a
        1-token cap does not (the capacity alone is over: splitting cannot help).

        Not ``longest_fitting`` at the largest size: the solver may place a segment in the
        smallest group that holds it, where each rank holds more of its L x L scores."""
        if self.worst_group_peak(upper, sizes, capacity, multiples) <= budget:
            return upper
        if self.worst_group_peak(1, sizes, capacity, multiples) > budget:
            return 0
        lo, hi = 1, upper - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok = self.worst_group_peak(mid, sizes, capacity, multiples) <= budget
            lo, hi = (mid, hi) if ok else (lo, mid - 1)
        m = multiples[-1]
        return lo // m * m if lo >= m else lo


@dataclass(frozen=True, slots=True)
class Heaviest:
    """The microbatch of a plan with the highest per-rank peak."""

    step: int
    microbatch: int
    rank_start: int
    cp_size: int
    peak_bytes: float
    longest: int
    """Its longest padded sequence."""
    sample: int = -1
    """The sample that sequence is (of) (-1: columns without ``sample_index``)."""


def step_heaviest(model: MemoryModel, step: int, cols: dict[str, NDArray[Any]]
                  ) -> Heaviest | None:
    """The heaviest group of one step's columns (None: an empty step)."""
    mb, start = cols["microbatch"], cols["rank_start"]
    if not len(mb):
        return None
    first = np.flatnonzero(np.r_[True, (np.diff(mb) != 0) | (np.diff(start) != 0)])
    p = cols["padded_tokens"].astype(np.float64)
    peaks = model.group_peaks(cols["cp_size"][first], np.add.reduceat(p, first),
                              np.add.reduceat(p * p, first), np.maximum.reduceat(p, first))
    g = int(np.argmax(peaks))
    end = first[g + 1] if g + 1 < len(first) else len(mb)
    top = int(first[g] + np.argmax(p[first[g]:end]))
    samples = cols.get("sample_index")
    return Heaviest(step, int(mb[first[g]]), int(start[first[g]]),
                    int(cols["cp_size"][first[g]]), float(peaks[g]), int(p[top]),
                    -1 if samples is None else int(samples[top]))


def over_budget(h: Heaviest, model: MemoryModel, budget: float, what: str) -> str:
    """The refusal's text: step, microbatch, group, both figures and the longest that fits."""
    fits = model.longest_fitting(h.cp_size, budget)
    of = f" of sample {h.sample}" if h.sample >= 0 else ""
    return (f"step {h.step} microbatch {h.microbatch} (CP group of {h.cp_size} at rank "
            f"{h.rank_start}, longest sequence {h.longest:,} padded tokens{of}) needs about "
            f"{gib(h.peak_bytes)} per rank, more than {what} ({gib(budget)}); a rank of that "
            f"group holds one sequence of at most {fits:,} tokens of this model "
            f"({model.description})")


SHAPE_KEYS = {"vocab": "vocab_size", "layers": "num_layers", "hidden": "hidden_size",
              "heads": "num_heads", "query-groups": "num_query_groups",
              "ffn": "ffn_hidden_size"}
SHAPE_DEFAULTS = "vocab=256,layers=2,hidden=64,heads=4,query-groups=2,attention=reference"
"""``dcp-train``'s default model (runtime/train/model.py) and attention backend."""


def parse_shape(text: str) -> MemoryModel:
    """``layers=32,hidden=4096,heads=32,query-groups=8,vocab=128256,attention=te,device=cuda``
    (keys not given take ``SHAPE_DEFAULTS``; device defaults to cuda for te, else cpu)."""
    values: dict[str, str] = {}
    for item in [*SHAPE_DEFAULTS.split(","), *[t for t in text.split(",") if t.strip()]]:
        key, sep, value = item.strip().partition("=")
        if not sep or key not in {*SHAPE_KEYS, "attention", "device", "untied"}:
            raise ValueError(f"--memory-model: {item.strip()!r} is not KEY=VALUE with KEY one "
                             f"of {', '.join([*SHAPE_KEYS, 'attention', 'device', 'untied'])}")
        values[key] = value.strip()
    attention = values["attention"]
    if attention not in ("reference", "torch", "te"):
        raise ValueError(f"--memory-model: attention must be reference, torch or te, got "
                         f"{attention!r}")
    device = values.get("device", "cuda" if attention == "te" else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--memory-model: device must be cpu or cuda, got {device!r}")
    ints: dict[str, int] = {}
    for key, field in SHAPE_KEYS.items():
        if key in values and not values[key].isdigit():
            raise ValueError(f"--memory-model: {key} must be a whole number, got "
                             f"{values[key]!r}")
        ints[field] = int(values.get(key, "0"))
    return MemoryModel.from_shape(**ints, tie_embeddings=values.get("untied", "0") in ("0", ""),
                                  attention=attention, device=device)


REFUSAL_HINT = ("lower --max-tokens-per-rank or --cp-sizes' largest (with --long-sequences "
                "split), or plan for fused attention")


def refuse_over(steps: Iterator[dict[str, NDArray[Any]]], model: MemoryModel, budget: float,
                what: str, hint: str = REFUSAL_HINT) -> Iterator[dict[str, NDArray[Any]]]:
    """``steps`` passed through; ValueError at the first microbatch over ``budget`` bytes."""
    for i, cols in enumerate(steps):
        h = step_heaviest(model, i, cols)
        if h is not None and h.peak_bytes > budget:
            raise ValueError(f"{over_budget(h, model, budget, what)}; {hint}")
        yield cols
