"""Benchmark workloads: deterministic, seeded sequence-length mixes as int64 arrays.

Four mixes (see data/workloads/README.md for the shapes they imitate):

- ``wikipedia``: a seeded sample (without replacement) of the FlexSP Wikipedia document lengths
  (median 347, p99 ~10.9K, a tail to 1.8M).
- ``bytescale``: a ByteScale-like ("Byted") mix capped at 2M tokens: ~80% of samples <= 4K,
  ~1% >= 128K holding ~44% of the tokens, 0.05% at the 2M cap holding ~12%.
- ``lognormal``: Megatron's dynamic-CP functional-test mix, lognormal in [128, 8192] with
  median 1024 and sigma 1.5 (a guess: we read Megatron's "mean 1024" as numpy's ``mean``
  parameter, i.e. mu = ln 1024, then clip; the clipped mean is ~2.1K).
- ``all-long``: the guard case of the GB200 anchor: 90% of the tokens sit in sequences that need
  the pool's largest group size (longer than the largest smaller size x C), the rest are short.
  It is the only mix that depends on the pool and the capacity.

Every generator is a pure function of its arguments: the same call gives the same array. Rare
classes (the 2M samples, the long sequences) are placed by count, not by chance, so a small
sample still has the advertised shape. Sizes are chosen by the caller (``num_tokens``), so the
benchmark can size each workload to a number of steps.

Example: ``make_workload("lognormal", num_tokens=1_000_000, pool_size=8, capacity=4096)`` gives
~470 lengths in [128, 8192].
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from planner.groups import valid_cp_sizes

ROOT = Path(__file__).resolve().parents[1]
WIKIPEDIA_PATH = ROOT / "data" / "workloads" / "flexsp_wikipedia_lengths.txt.gz"
"""Shipped in the repository (Apache-2.0, with its licence file beside it), gzip-compressed."""
BYTESCALE_CAP = 2 * 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSpec:
    """A workload's name, nominal capacity C (tokens per rank) and mean length (for sizing)."""

    name: str
    capacity: int
    """Nominal C for this mix; the bench raises it when the longest sample would not fit N x C."""
    mean_tokens: float
    """Approximate mean sample length, used to turn a token budget into a sample count."""
    description: str


SPECS: dict[str, WorkloadSpec] = {
    "wikipedia": WorkloadSpec(name="wikipedia", capacity=16384, mean_tokens=1014.0,
                              description="FlexSP Wikipedia document lengths (sampled)"),
    "bytescale": WorkloadSpec(name="bytescale", capacity=32768, mean_tokens=8300.0,
                              description="ByteScale-like mix, 80% <= 4K, 1% >= 128K, cap 2M"),
    "lognormal": WorkloadSpec(name="lognormal", capacity=4096, mean_tokens=2120.0,
                              description="Megatron's lognormal [128, 8192], median 1024, s=1.5"),
    "all-long": WorkloadSpec(name="all-long", capacity=8192, mean_tokens=0.0,
                             description="90% of tokens in sequences needing the largest size"),
}
NAMES = tuple(SPECS)

_wikipedia_cache: NDArray[np.int64] | None = None


def _wikipedia_lengths() -> NDArray[np.int64]:
    global _wikipedia_cache
    if _wikipedia_cache is None:
        _wikipedia_cache = read_length_file(WIKIPEDIA_PATH)
    return _wikipedia_cache


def read_length_file(path: Path) -> NDArray[np.int64]:
    """One integer length per line, from a plain or a gzip-compressed (``.gz``) text file."""
    if not path.is_file():
        raise ValueError(f"{path}: lengths file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        # split() + one array: ~30x faster than np.loadtxt on a million lines.
        return np.array(f.read().split(), dtype=np.int64)


def wikipedia(num_samples: int, seed: int = 0) -> NDArray[np.int64]:
    """``num_samples`` lengths drawn without replacement from the Wikipedia file, in file order."""
    all_lengths = _wikipedia_lengths()
    num_samples = min(num_samples, all_lengths.size)
    rng = np.random.default_rng([seed, 1])
    pick = np.sort(rng.choice(all_lengths.size, size=num_samples, replace=False))
    return all_lengths[pick].copy()


def _log_uniform(rng: np.random.Generator, lo: float, hi: float, n: int) -> NDArray[np.float64]:
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size=n))


def bytescale(num_samples: int, seed: int = 0) -> NDArray[np.int64]:
    """A ByteScale-like mix capped at 2M tokens, shuffled.

    Classes by count: 0.05% at the 2M cap; 0.95% in [128K, 2M) (log-uniform on [128K, 570K),
    mean ~295K); 19% in (4K, 128K) (log-uniform on (4K, 60K), mean ~21K); 80% short (lognormal,
    median 700, sigma 1, clipped to [32, 4096]). That puts ~44% of the tokens in samples >= 128K
    and ~12% in the 2M ones, as the paper reports; the paper's 2M+ tail is cut at the cap.
    """
    rng = np.random.default_rng([seed, 2])
    n_cap = max(1, round(0.0005 * num_samples))
    n_long = max(1, round(0.0095 * num_samples))
    n_mid = round(0.19 * num_samples)
    n_short = max(0, num_samples - n_cap - n_long - n_mid)
    cap = np.full(n_cap, BYTESCALE_CAP, dtype=np.float64)
    long_ = _log_uniform(rng, 128 * 1024, 570 * 1024, n_long)
    mid = _log_uniform(rng, 4097, 60 * 1024, n_mid)
    short = np.clip(rng.lognormal(np.log(700.0), 1.0, n_short), 32, 4096)
    out = np.concatenate([cap, long_, mid, short]).astype(np.int64)
    return rng.permutation(out)


def lognormal(num_samples: int, seed: int = 0) -> NDArray[np.int64]:
    """Megatron's functional-test mix: lognormal(mu=ln 1024, sigma=1.5) clipped to [128, 8192]."""
    rng = np.random.default_rng([seed, 3])
    x = rng.lognormal(np.log(1024.0), 1.5, num_samples)
    return np.clip(np.round(x), 128, 8192).astype(np.int64)


def all_long(num_tokens: int, pool_size: int, capacity: int, seed: int = 0) -> NDArray[np.int64]:
    """90% of ``num_tokens`` in sequences that need group size ``pool_size``, the rest short.

    A long sequence is uniform in (s*C, N*C - 2N], where s is the largest valid size below N, so
    its minimum size is N under every padding rule used here (ours and Megatron's 2N multiple).
    Short ones are lognormal (median 1024, sigma 1, clipped to [64, C]).
    """
    rng = np.random.default_rng([seed, 4, pool_size, capacity])
    sizes = valid_cp_sizes(pool_size)
    below = sizes[-2] if len(sizes) > 1 else 0
    lo, hi = below * capacity + 1, pool_size * capacity - 2 * pool_size
    if hi <= lo:
        raise ValueError(f"pool {pool_size} x C {capacity} leaves no room for an all-long sample")
    mean_long = (lo + hi) / 2
    n_long = max(1, round(0.9 * num_tokens / mean_long))
    long_ = rng.integers(lo, hi + 1, size=n_long)
    short_tokens = long_.sum() / 9.0
    short = np.clip(rng.lognormal(np.log(1024.0), 1.0, max(1, int(short_tokens / 1650))),
                    64, capacity).astype(np.int64)
    return rng.permutation(np.concatenate([long_, short]).astype(np.int64))


def make_workload(name: str, *, num_tokens: int, pool_size: int, capacity: int,
                  seed: int = 0) -> NDArray[np.int64]:
    """Lengths of workload ``name`` holding about ``num_tokens`` real tokens.

    Args:
        name: one of ``NAMES``.
        num_tokens: approximate total tokens (sets the sample count from the mix's mean).
        pool_size: N, the dynamic pool (only ``all-long`` uses it).
        capacity: C, tokens per rank (only ``all-long`` uses it).
        seed: workload seed.

    Returns:
        int64 lengths, one per sample, all >= 1.
    """
    if name not in SPECS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(NAMES)})")
    if name == "all-long":
        return all_long(num_tokens, pool_size, capacity, seed)
    num_samples = max(1, round(num_tokens / SPECS[name].mean_tokens))
    if name == "wikipedia":
        return wikipedia(num_samples, seed)
    if name == "bytescale":
        return bytescale(num_samples, seed)
    return lognormal(num_samples, seed)


def describe(lengths: NDArray[np.int64]) -> str:
    """One line: count, tokens, median, p99, max and the share of tokens in samples >= 128K."""
    x = np.asarray(lengths, dtype=np.int64)
    big = x[x >= 128 * 1024].sum() / max(1, x.sum())
    return (f"n={x.size:,} tokens={int(x.sum()):,} median={int(np.median(x)):,} "
            f"p99={int(np.percentile(x, 99)):,} max={int(x.max()):,} tokens>=128K={big:.1%}")
