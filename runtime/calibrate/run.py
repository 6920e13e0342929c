"""The measurement behind ``dcp-calibrate`` (``runtime.calibrate.cli`` says the method): run the
grids of ``runtime.calibrate.timing`` on this world, fit the cost model, describe the machine.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.fileguard import write_atomic
from planner.groups import ZIGZAG, valid_cp_sizes
from runtime.calibrate.fit import Fit, fit_cost_model
from runtime.calibrate.memory import peak_rss, probe_max_tokens, reset_peak_rss
from runtime.calibrate.timing import DTYPES, MicrobatchTimer, ring_grid, single_grid
from runtime.train.backends import ATTENTIONS
from runtime.train.model import GPTConfig

FORMAT = "dcp-calibrate/1"
"""Version of the ``measured`` block."""
MAX_TOKENS = 65536
"""Default cap of Tmax on GPU (``--max-tokens``); the memory probe may lower it."""
CPU_MAX_TOKENS = 8192
"""Default cap of Tmax on CPU: its attention is quadratic at CPU speed (one 65,536-token buffer
of 32K documents is 42 s of CPU with the default model; the grid at 8,192 about 3 minutes)."""
QUICK_MAX_TOKENS = 4096
"""Default cap of Tmax with ``--quick``: five CP=1 buffers of at most 4,096 tokens."""
MAX_LENGTH = 32768
"""Longest document measured by default, when the cap is at least twice as long."""


def grid_defaults(*, quick: bool, device: str, max_tokens: int | None, max_length: int | None,
                  min_length: int) -> tuple[int, int]:
    """(max_tokens, max_length) with the defaults filled in.

    The cap is 65,536 tokens on GPU and 8,192 on CPU (``--quick``: 4,096 on either); the
    longest document is half the cap, at most 32,768 and at least ``min_length``, so a cap given
    alone never contradicts it.
    """
    if max_tokens is None:
        max_tokens = (QUICK_MAX_TOKENS if quick else
                      MAX_TOKENS if device == "cuda" else CPU_MAX_TOKENS)
    if max_length is None:
        max_length = max(min_length, min(MAX_LENGTH, max_tokens // 2))
    return max_tokens, max_length


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrateConfig:
    """What to measure and how; the model shape is a separate ``GPTConfig``."""

    output: str
    """JSON file to write (rank 0)."""
    name: str = ""
    """Cost-model name; empty: the output file's stem."""
    device: str = "cpu"
    """cpu or cuda."""
    attention: str = "te"
    """te (falls back to torch with a warning when unavailable), torch or reference."""
    dtype: str = "bf16"
    """bf16 (autocast, fp32 master weights) or fp32."""
    max_tokens: int = 65536
    """Upper bound of Tmax, the largest CP=1 buffer (rounded down to a power of two); the
    memory probe may lower it further (``runtime.calibrate.memory``)."""
    min_length: int = 512
    """Shortest document length measured."""
    max_length: int = 32768
    """Longest document length measured."""
    memory_fraction: float = 0.7
    """Share of the memory the largest buffer's extrapolated peak may use: the GPU's, or on CPU
    the host's available memory divided among the host's ranks."""
    warmup: int = 3
    """Untimed runs per configuration."""
    repeats: int = 7
    """Timed runs per configuration (the median is kept)."""
    quick: bool = False
    """Smaller grids (``timing.single_grid``, ``ring_grid``); ``--quick`` also lowers the cap,
    the warm-ups and the repeats (``grid_defaults``, ``runtime.calibrate.cli``)."""
    cp_sizes: tuple[int, ...] = ()
    """Group sizes > 1 to measure; empty: every valid size of the world."""
    seed: int = 0
    """Seed of the weights and of the random tokens."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got "
                             f"{self.attention!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 2 <= self.min_length <= self.max_length <= self.max_tokens:
            raise ValueError(f"need 2 <= min_length ({self.min_length}) <= max_length "
                             f"({self.max_length}) <= max_tokens ({self.max_tokens})")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(f"need warmup >= 0 and repeats >= 1, got {self.warmup}, "
                             f"{self.repeats}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


# --------------------------------------------------------------------------------------------
# The whole measurement (collective) and its record.


@dataclass(frozen=True, slots=True)
class Calibration:
    """What ``calibrate`` returns on every rank: the fit and the facts to record with it."""

    fit: Fit
    measured: dict[str, Any]


def _say(text: str, *, err: bool = False) -> None:
    """Rank 0 prints (progress on stdout, warnings on stderr)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)


def resolve_attention(cfg: CalibrateConfig) -> str:
    """The backend actually used: te falls back to torch (with a warning) when unavailable."""
    if cfg.attention != "te":
        return cfg.attention
    from runtime.attention.te import te_available

    if cfg.device == "cuda" and te_available():
        return "te"
    _say("dcp-calibrate: warning: Transformer Engine is not usable here "
         f"(device {cfg.device}); measuring --attention torch instead", err=True)
    return "torch"


def _te_version() -> str | None:
    for dist_name in ("transformer_engine", "transformer-engine"):
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _peak_bytes(device: torch.device) -> int:
    """Largest peak of any rank since the probe: CUDA allocations on GPU, the resident
    high-water mark on CPU (0 where unknown), to compare with the probe's budget."""
    if device.type != "cuda":
        peak = torch.tensor([peak_rss()], dtype=torch.int64)
    else:
        peak = torch.tensor([torch.cuda.max_memory_allocated(device)], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _description(cfg: CalibrateConfig, model_config: GPTConfig, attention: str,
                 device: torch.device) -> str:
    c = model_config
    ring = "" if dist.get_world_size() > 1 else "; ring terms NOT measured (one process)"
    return (f"Measured by dcp-calibrate on {dist.get_world_size()} x {_machine(device)}: "
            f"{c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads}q/"
            f"{c.num_query_groups}kv heads x {c.head_dim}, FFN {c.ffn_size}, vocab "
            f"{c.vocab_size}, {cfg.dtype}, {attention} attention{ring}.")


def calibrate(cfg: CalibrateConfig, model_config: GPTConfig) -> Calibration:
    """Measure and fit (a collective: every rank of the initialised world calls it alike)."""
    from runtime.dist.groups import GroupCatalog
    from runtime.dist.topology import Topology

    t_start = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda"
              else torch.device("cpu"))
    attention = resolve_attention(cfg)
    sizes = tuple(k for k in valid_cp_sizes(world_size) if k > 1)
    if cfg.cp_sizes:
        bad = sorted(set(cfg.cp_sizes) - set(sizes))
        if bad:
            raise ValueError(f"cp sizes {bad} are not valid group sizes > 1 for a world of "
                             f"{world_size} (valid: {list(sizes) or 'none'})")
        sizes = tuple(sorted(set(cfg.cp_sizes)))
    catalog = None
    if world_size > 1:
        # Collective: every rank creates every group, in the planner's catalog order.
        topology = Topology(world_size=world_size, rank=rank, dp=1, cp=world_size)
        catalog = GroupCatalog.create(topology, (1, *sizes))
    timer = MicrobatchTimer(model_config, attention=attention, dtype=cfg.dtype, device=device,
                            seed=cfg.seed)
    probe = probe_max_tokens(timer, max_tokens=cfg.max_tokens, min_length=cfg.min_length,
                             max_length=cfg.max_length, memory_fraction=cfg.memory_fraction)
    tmax = probe.max_tokens
    if device.type != "cuda":
        reset_peak_rss()  # from here on the high-water mark is the grid's
    _say(f"dcp-calibrate: {world_size} x {_machine(device)}, attention {attention}, "
         f"{cfg.dtype}, Tmax {tmax} tokens, CP sizes {list(sizes) or 'none'}")

    plan: list[tuple[int, tuple[int, ...]]] = [
        (1, lengths) for lengths in single_grid(tmax, cfg.min_length, cfg.max_length,
                                                quick=cfg.quick)]
    plan += ring_grid(tmax, cfg.min_length, cfg.max_length, sizes, quick=cfg.quick)
    samples = []
    for number, (k, lengths) in enumerate(plan):
        start = (rank // k) * k
        group = None if catalog is None or k == 1 else catalog.cp_group(start, k)
        ranks = [rank] if catalog is None or k == 1 else catalog.cp_global_ranks(start, k)
        sample = timer.measure(lengths, k, number, group=group, ranks=ranks, rank_start=start,
                               warmup=cfg.warmup, repeats=cfg.repeats)
        samples.append(sample)
        _say(f"  [{number + 1}/{len(plan)}] cp {k} {sample.describe()}: "
             f"{sample.seconds * 1e3:.3f} ms")
    if not sizes:
        _say("dcp-calibrate: warning: one process, so the ring terms were not measured: "
             "cp_fixed_s = cp_token_s = 0; run with >= 2 processes for a cost model that "
             "prices context parallelism", err=True)

    fit = fit_cost_model(samples, name=cfg.name or Path(cfg.output).stem,
                         description=_description(cfg, model_config, attention, device))
    measured = {
        "format": FORMAT,
        # The day it was measured (UTC): plans planned with this model say "calibrated on
        # <device> <date>" (planner/provenance.py).
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": _machine(device),
        "device": cfg.device,
        "world_size": world_size,
        "torch": torch.__version__,
        "transformer_engine": _te_version() if attention == "te" else None,
        "model": asdict(model_config),
        "dtype": cfg.dtype,
        "attention": attention,
        "attention_requested": cfg.attention,
        "layout": ZIGZAG,
        "max_tokens": tmax,
        "memory": {**asdict(probe), "peak_bytes": _peak_bytes(device)},
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "quick": cfg.quick,
        "ring_measured": fit.ring_measured,
        "fit": fit.summary(),
        "wall_seconds": round(time.perf_counter() - t_start, 3),
        "samples": [
            {"cp_size": s.cp_size, "documents": s.describe(), "num_tokens": s.num_tokens,
             "sum_sq_tokens": s.sum_sq, "seconds": s.seconds, "fitted_seconds": p,
             "rel_error": float(e), "repeats": list(s.repeats)}
            for s, p, e in zip(fit.samples, fit.predicted, fit.relative_errors(), strict=True)
        ],
    }
    return Calibration(fit=fit, measured=measured)


def to_json(result: Calibration) -> dict[str, Any]:
    """The cost-model file: the preset schema plus the ``measured`` block."""
    header = result.fit.model.to_header()
    return {**header, "measured": result.measured}


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write atomically (``planner.fileguard.write_atomic``: a temporary in the same folder,
    then rename; only over a JSON document, never over an input or a special file)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n", kind="cost-model")
