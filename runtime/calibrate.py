"""``dcp-calibrate``: measure the planner's cost model on this machine for one model shape.

Writes the JSON that ``dcp-plan --cost-model FILE`` reads (the schema of planner/presets/*.json:
name, description, parameters) plus a ``measured`` block: the raw timings, the machine, the torch
version, the model shape, dtype, attention backend and the fit's residuals.

Method. The GPT of runtime/model.py with the given shape runs single packed (THD) microbatches of
random token ids (never zeros), forward + per-token loss + backward exactly as ``dcp-train`` does
(fp32 master weights, bf16 autocast, gradients accumulated, no optimizer step), through the same
attention backends (``runtime.backends.make_backend``). A microbatch's time is measured from before
its attention binding to the end of its backward (CUDA events on GPU, a host clock on CPU), after
a barrier and with the device idle, so host-side launch and binding costs count as in training.
Each configuration runs ``--warmup`` times untimed, then ``--repeats`` times; a repeat's time is
the slowest rank's (all ranks run the same configuration at once) and a sample is the median.

1. CP=1: every rank runs whole buffers of T tokens made of T/L documents of length L, for
   L = 512, 1K, ... 32K (``--min-length``, ``--max-length``) and T = Tmax, Tmax/4, Tmax/16, plus
   one mixed buffer per T (a long document and many short ones). Tmax is the largest power of
   two <= ``--max-tokens`` whose peak memory, extrapolated from two probe runs, fits in
   ``--memory-fraction`` of the GPU (on CPU: that power of two). t = m + a T + b sum L^2 is
   fitted by non-negative least squares on relative errors (runtime/calibrate_fit.py):
   a = linear_s_per_token, b = attention_s_per_token2, m = microbatch_s.
2. With W >= 2 processes (torchrun, or ``--nproc W`` which spawns them; NCCL on GPU, gloo on
   CPU): for every valid group size k > 1 of a pool of W (planner.groups), all aligned groups of
   k ranks run at once, each holding S = k s tokens (s = Tmax/16, Tmax/4, Tmax/2 per rank) of
   documents of length Lmax/8 or Lmax, in zigzag shards. cp_fixed_s and cp_token_s are fitted on
   t_k - (a S + b sum L^2)/k - m = (k - 1)(cp_fixed + cp_token S / k). With one process the
   ring terms are not measured: they are written as 0 with a warning.

Usage (2 GPUs; ``--nproc 2`` without torchrun does the same)::

    torchrun --nproc-per-node 2 -m runtime.calibrate --device cuda --attention te --layers 8 \
        --hidden-size 2048 --heads 16 --query-groups 4 --ffn-hidden-size 8192 \
        --vocab-size 32000 --dtype bf16 --output h200-8x2048.json

Budget: measured 2026-11-30 on 2 x H200 with that model (torch attention): Tmax = 64K (the
default cap), 26 samples, 121 s wall including start-up, fit within 2.1% of every sample.
``--quick`` (2 token sizes, every other length, 1 warm-up, 3 repeats) is for smoke tests.

Trade-off: one linear model cannot follow everything (short documents run attention less
efficiently than long ones; the ring's cost depends on document length); the table printed last
and the residuals in the JSON say how far each sample is from the fit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.groups import ZIGZAG, valid_cp_sizes
from runtime.backends import ATTENTIONS
from runtime.calibrate_fit import Fit, fit_cost_model, format_table
from runtime.calibrate_timing import (
    DTYPES,
    MicrobatchTimer,
    probe_max_tokens,
    ring_grid,
    single_grid,
)
from runtime.model import GPTConfig, add_model_arguments, model_config_from_args

FORMAT = "dcp-calibrate/1"
"""Version of the ``measured`` block."""


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
    """Upper bound of Tmax, the largest CP=1 buffer (rounded down to a power of two); on GPU the
    memory probe may lower it further."""
    min_length: int = 512
    """Shortest document length measured."""
    max_length: int = 32768
    """Longest document length measured."""
    memory_fraction: float = 0.7
    """Share of GPU memory the largest buffer's extrapolated peak may use."""
    warmup: int = 3
    """Untimed runs per configuration."""
    repeats: int = 7
    """Timed runs per configuration (the median is kept)."""
    quick: bool = False
    """Smaller grid, 1 warm-up, 3 repeats."""
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
    from runtime.te_adapter import te_available

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
    """Largest allocation of any rank since the probe (0 on CPU): the headroom actually left."""
    if device.type != "cuda":
        return 0
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
    from runtime.groups import GroupCatalog
    from runtime.topology import Topology

    t_start = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda"
              else torch.device("cpu"))
    if cfg.quick:
        cfg = replace(cfg, warmup=min(cfg.warmup, 1), repeats=min(cfg.repeats, 3))
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
    """Write atomically (a temporary file in the same folder, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, target)


# --------------------------------------------------------------------------------------------
# Entry point: torchrun, a world of one, or --nproc N spawned here.


def parse_args(argv: Sequence[str] | None = None) -> tuple[CalibrateConfig, GPTConfig, int]:
    """Parse ``dcp-calibrate``'s flags into (CalibrateConfig, GPTConfig, nproc)."""
    p = argparse.ArgumentParser(prog="dcp-calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", "-o", required=True, help="cost-model JSON file to write")
    p.add_argument("--name", default="", help="cost-model name (default: the output's stem)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to measure")
    p.add_argument("--attention", choices=ATTENTIONS, default="te",
                   help="te (torch if TE is not usable), torch, or reference")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="bf16 autocast with fp32 master weights, or fp32")
    p.add_argument("--nproc", type=int, default=1,
                   help="spawn this many processes (one per GPU) unless run under torchrun")
    p.add_argument("--cp-sizes", type=int, nargs="*", default=[],
                   help="CP group sizes > 1 to measure (default: every valid size)")
    p.add_argument("--max-tokens", type=int, default=65536,
                   help="largest CP=1 buffer (GPU: lowered to what memory holds)")
    p.add_argument("--min-length", type=int, default=512, help="shortest document length")
    p.add_argument("--max-length", type=int, default=32768, help="longest document length")
    p.add_argument("--memory-fraction", type=float, default=0.7,
                   help="GPU memory share the largest buffer may use")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per configuration")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per configuration")
    p.add_argument("--quick", action="store_true", help="small grid, 1 warm-up, 3 repeats")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and tokens")
    add_model_arguments(p)
    a = p.parse_args(argv)
    try:
        model_config = model_config_from_args(a)
        cfg = CalibrateConfig(output=a.output, name=a.name, device=a.device,
                              attention=a.attention, dtype=a.dtype, max_tokens=a.max_tokens,
                              min_length=a.min_length, max_length=a.max_length,
                              memory_fraction=a.memory_fraction, warmup=a.warmup,
                              repeats=a.repeats, quick=a.quick, cp_sizes=tuple(a.cp_sizes),
                              seed=a.seed)
        if a.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {a.nproc}")
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available")
    except ValueError as e:
        p.error(str(e))
    return cfg, model_config, a.nproc


def _process(cfg: CalibrateConfig, model_config: GPTConfig, rank: int, world_size: int,
             store_path: str | None) -> None:
    """One rank: join the world, measure; rank 0 writes the file and prints the table last.

    The world comes from torchrun (env://), from ``--nproc``'s FileStore at ``store_path``, or
    is a world of one.
    """
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if store_path is not None:
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(),  # type: ignore[attr-defined]
                                rank=0, world_size=1)
    try:
        torch.manual_seed(cfg.seed)
        result = calibrate(cfg, model_config)
        if dist.get_rank() == 0:
            write_json(cfg.output, to_json(result))
            params = result.fit.model.parameters
            print("\n" + format_table(result.fit))
            print("parameters: " + ", ".join(f"{k} {v:.4g}" for k, v in params.items()))
            print(f"wrote {cfg.output}", flush=True)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, cfg: CalibrateConfig, model_config: GPTConfig, world_size: int,
             store_path: str) -> None:
    _process(cfg, model_config, rank, world_size, store_path)


def main(argv: Sequence[str] | None = None) -> int:
    """``dcp-calibrate``; returns the process exit status."""
    cfg, model_config, nproc = parse_args(argv)
    try:
        if nproc > 1 and "WORLD_SIZE" not in os.environ:
            from torch.multiprocessing.spawn import start_processes

            with tempfile.TemporaryDirectory(prefix="dcp-calibrate-") as tmp:
                # A FileStore needs no port; children inherit the environment unchanged.
                start_processes(_spawned, args=(cfg, model_config, nproc,  # type: ignore[no-untyped-call]
                                                os.path.join(tmp, "store")),
                                nprocs=nproc, start_method="spawn")
        else:
            _process(cfg, model_config, int(os.environ.get("RANK", "0")),
                     int(os.environ.get("WORLD_SIZE", "1")), None)
    except ValueError as e:
        print(f"dcp-calibrate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
