"""``dcp-calibrate``: measure the planner's cost model on this machine for one model shape.

Writes the JSON that ``dcp-plan --cost-model FILE`` reads (the schema of planner/presets/*.json:
name, description, parameters) plus a ``measured`` block: the raw timings, the machine, the day
(UTC), the torch version, the model shape, dtype, attention backend and the fit's residuals. A
plan made with it says ``calibrated on <machine> <day>`` (planner/provenance.py).

Method. The GPT of runtime/train/model.py with the given shape runs single packed (THD)
microbatches of
random token ids (never zeros), forward + per-token loss + backward exactly as ``dcp-train`` does
(fp32 master weights, bf16 autocast, gradients accumulated, no optimizer step), through the same
attention backends (``runtime.train.backends.make_backend``). A microbatch's time is measured from
before
its attention binding to the end of its backward (CUDA events on GPU, a host clock on CPU), after
a barrier and with the device idle, so host-side launch and binding costs count as in training.
Each configuration runs ``--warmup`` times untimed, then ``--repeats`` times; a repeat's time is
the slowest rank's (all ranks run the same configuration at once) and a sample is the median.

1. CP=1: every rank runs whole buffers of T tokens made of T/L documents of length L, for
   L = 512, 1K, ... 32K (``--min-length``, ``--max-length``) and T = Tmax, Tmax/4, Tmax/16, plus
   one mixed buffer per T (a long document and many short ones). Tmax is the largest power of
   two <= ``--max-tokens`` whose peak memory, extrapolated from three probe runs, fits in
   ``--memory-fraction`` of the GPU, or on CPU of the host's available memory shared by its
   ranks (``runtime.calibrate.memory``). t = m + a T + b sum L^2 is
   fitted by non-negative least squares on relative errors (runtime/calibrate/fit.py):
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
default cap), 26 samples, 121 s wall including start-up, fit within 2.1% of every sample. On
CPU the default cap is 8,192 (the run checks the tool; its times are the CPU's): about 160 s of
CPU with the default model on a shared 2-core host. ``--quick`` (Tmax 4,096, 2 token sizes,
every other length, 1 warm-up, 3 repeats) is for smoke tests: about 8 s of CPU there.

Trade-off: one linear model cannot follow everything (short documents run attention less
efficiently than long ones; the ring's cost depends on document length); the table printed last
and the residuals in the JSON say how far each sample is from the fit.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence

import torch
import torch.distributed as dist

from planner.cli.args import (
    ArgumentParser,
    HelpFormatter,
    add_json_arguments,
    add_version,
    emit_summary,
    flag_message,
    int_at_least,
    nonnegative_int,
    positive_float,
    positive_int,
    seed_int,
)
from planner.fileguard import check_output
from runtime.calibrate.fit import format_table
from runtime.calibrate.run import (
    CPU_MAX_TOKENS,
    MAX_LENGTH,
    MAX_TOKENS,
    QUICK_MAX_TOKENS,
    CalibrateConfig,
    calibrate,
    grid_defaults,
    to_json,
    write_json,
)
from runtime.calibrate.timing import DTYPES
from runtime.train.backends import ATTENTIONS
from runtime.train.model import (
    MODEL_FLAGS,
    GPTConfig,
    add_model_arguments,
    model_config_from_args,
)

EPILOG = f"""\
what the defaults cost:
  GPU: Tmax {MAX_TOKENS:,} tokens, documents 512..32,768, 20 CP=1 buffers plus 6 per CP size,
  3 warm-ups + 7 timed runs each: 121 s wall on 2 x H200 for an 8-layer, 2048-wide model.
  CPU: Tmax {CPU_MAX_TOKENS:,} (a check of the tool: the times are the CPU's), 10 buffers: about
  160 s of CPU on a shared 2-core host with the default model; --quick ({QUICK_MAX_TOKENS:,}
  tokens, 5 buffers, 1 + 3 runs): about 8 s of CPU and 0.6 GB.
  Memory: three small probe runs fit the peak of a buffer (per token and per squared document
  length); Tmax is lowered until the largest buffer fits --memory-fraction of the GPU, or on
  CPU of the host's available memory (cgroup limits included) shared by its ranks. The JSON's
  measured.memory records the budget, the predicted and the measured peak.
"""

CALIBRATE_FLAGS = {**MODEL_FLAGS, "max_tokens": "--max-tokens", "min_length": "--min-length",
                   "max_length": "--max-length", "memory_fraction": "--memory-fraction",
                   "cp_sizes": "--cp-sizes"}
"""Config fields -> flags, for error messages."""

# --------------------------------------------------------------------------------------------
# Entry point: torchrun, a world of one, or --nproc N spawned here.


Report = tuple[bool, str]
"""(--json, --summary-json FILE): how rank 0 reports the fit."""


def parse_args(argv: Sequence[str] | None = None
               ) -> tuple[CalibrateConfig, GPTConfig, int, Report]:
    """Parse ``dcp-calibrate``'s flags into (CalibrateConfig, GPTConfig, nproc, report)."""
    p = ArgumentParser(prog="dcp-calibrate", description=__doc__.split("\n\n")[0],
                       formatter_class=HelpFormatter, epilog=EPILOG)
    add_version(p)
    p.add_argument("--output", "-o", required=True, help="cost-model JSON file to write")
    p.add_argument("--name", default="", help="cost-model name (default: the output's stem)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to measure")
    p.add_argument("--attention", choices=ATTENTIONS, default="te",
                   help="te (torch if TE is not usable), torch, or reference")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="bf16 autocast with fp32 master weights, or fp32")
    p.add_argument("--nproc", type=positive_int, default=1,
                   help="spawn this many processes (one per GPU) unless run under torchrun")
    p.add_argument("--cp-sizes", type=int_at_least(2), nargs="*", default=[],
                   help="CP group sizes > 1 to measure (default: every valid size)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help=f"cap of the largest CP=1 buffer, Tmax (default {MAX_TOKENS:,} on GPU, "
                   f"{CPU_MAX_TOKENS:,} on CPU; --quick: {QUICK_MAX_TOKENS:,}); lowered to "
                   "what memory holds (see below)")
    p.add_argument("--min-length", type=positive_int, default=512, help="shortest document length")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help=f"longest document length (default: half of --max-tokens, at most "
                   f"{MAX_LENGTH:,})")
    p.add_argument("--memory-fraction", type=positive_float, default=0.7,
                   help="share of the memory the largest buffer may use: of the GPU's, or on "
                   "CPU of the host's available memory split among the ranks on the host")
    p.add_argument("--warmup", type=nonnegative_int, default=None,
                   help="untimed runs per configuration (default 3; --quick: 1)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed runs per configuration (default 7; --quick: 3)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: Tmax {QUICK_MAX_TOKENS:,} and documents up to half of "
                   "it (unless given), every other length, 1 warm-up, 3 repeats")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of weights and tokens")
    add_json_arguments(p)
    add_model_arguments(p)
    a = p.parse_args(argv)
    try:
        model_config = model_config_from_args(a)
        max_tokens, max_length = grid_defaults(quick=a.quick, device=a.device,
                                               max_tokens=a.max_tokens,
                                               max_length=a.max_length,
                                               min_length=a.min_length)
        warmup = (1 if a.quick else 3) if a.warmup is None else a.warmup
        repeats = (3 if a.quick else 7) if a.repeats is None else a.repeats
        cfg = CalibrateConfig(output=a.output, name=a.name, device=a.device,
                              attention=a.attention, dtype=a.dtype, max_tokens=max_tokens,
                              min_length=a.min_length, max_length=max_length,
                              memory_fraction=a.memory_fraction, warmup=warmup,
                              repeats=repeats, quick=a.quick, cp_sizes=tuple(a.cp_sizes),
                              seed=a.seed)
        if a.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {a.nproc}")
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available")
    except ValueError as e:
        p.error(flag_message(str(e), CALIBRATE_FLAGS))
    return cfg, model_config, a.nproc, (a.json, a.summary_json)


def _process(cfg: CalibrateConfig, model_config: GPTConfig, rank: int, world_size: int,
             store_path: str | None, report: Report = (False, "")) -> None:
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
            text = ("\n" + format_table(result.fit) + "\nparameters: "
                    + ", ".join(f"{k} {v:.4g}" for k, v in params.items())
                    + f"\nwrote {cfg.output}")
            summary = {"output": cfg.output, "name": result.fit.model.name,
                       "parameters": params, "num_samples": len(result.fit.samples),
                       "ring_measured": result.fit.ring_measured, **result.fit.summary()}
            emit_summary(summary, text, as_json=report[0], json_path=report[1])
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, cfg: CalibrateConfig, model_config: GPTConfig, world_size: int,
             store_path: str, report: Report) -> None:
    _process(cfg, model_config, rank, world_size, store_path, report)


def main(argv: Sequence[str] | None = None) -> int:
    """``dcp-calibrate``; returns the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--from-log" or a.startswith("--from-log=") for a in args):
        from runtime.calibrate.fromlog import main as from_log

        return from_log(args)  # a fit to a run's log: nothing is measured here
    cfg, model_config, nproc, report = parse_args(argv)
    try:
        # Before measuring: the outputs must be writable and replace only their own kind.
        check_output(cfg.output, kind="cost-model", flag="-o/--output")
        if report[1]:
            check_output(report[1], kind="summary", others={"-o/--output": cfg.output},
                         flag="--summary-json")
        if nproc > 1 and "WORLD_SIZE" not in os.environ:
            from torch.multiprocessing.spawn import start_processes

            with tempfile.TemporaryDirectory(prefix="dcp-calibrate-") as tmp:
                # A FileStore needs no port; children inherit the environment unchanged.
                start_processes(_spawned, args=(cfg, model_config, nproc,  # type: ignore[no-untyped-call]
                                                os.path.join(tmp, "store"), report),
                                nprocs=nproc, start_method="spawn")
        else:
            _process(cfg, model_config, int(os.environ.get("RANK", "0")),
                     int(os.environ.get("WORLD_SIZE", "1")), None, report)
    except (ValueError, OSError) as e:
        print(f"dcp-calibrate: error: {flag_message(str(e), CALIBRATE_FLAGS)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dcp-calibrate: interrupted", file=sys.stderr)
        return 130
    return 0

