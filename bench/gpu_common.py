"""What the GPU bench scripts share: their flags, the runs they launch and the table they print.

``bench/train_compare.py``, ``bench/torchtitan_gpu.py``, ``bench/megatron_gpu.py`` (and
``megatron_gpu_moe.py``) have the same two phases: ``prepare`` on the CPU machine (a dataset
and plans from ``train_compare.prepare``; ``add_prepare_args``) and ``run`` on the GPU machine
(``add_run_args``), which launches ``dcp-train`` once per configuration under ``torchrun``
(``launch``), reads each run's JSON lines (``read_log``), summarises a run as one row
(``run_row``, ``median`` after the warm-up steps) and prints the rows as one table
(``print_table``). Only the standard library is imported here: the scripts' ``--help`` works
anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SMOKE_HELP = "CPU, gloo, tiny model, reference attention: checks the script only"


def add_prepare_args(p: argparse.ArgumentParser, default_dir: Path) -> None:
    """``prepare``'s flags that ``train_compare.prepare`` reads (workload, plan and directory)."""
    p.add_argument("--dir", default=str(default_dir), help="output directory")
    p.add_argument("--workload", choices=("wikipedia", "all-long"), default="wikipedia",
                   help="long-tail Wikipedia lengths, or the all-long guard")
    p.add_argument("--samples", type=int, default=2500, help="documents (wikipedia)")
    p.add_argument("--num-tokens", type=int, default=2_400_000, help="tokens (all-long)")
    p.add_argument("--cost-model", default="small-2048-h200",
                   help="cost model the dynamic plan is made with (preset or JSON)")
    p.add_argument("--capacity", type=int, default=16384, help="tokens per rank (C)")
    p.add_argument("--global-batch-tokens", type=int, default=131072, help="tokens per step")
    p.add_argument("--seed", type=int, default=0, help="workload and plan seed")


def add_run_args(p: argparse.ArgumentParser, default_dir: Path, *, steps: int,
                 timeout: float) -> None:
    """``run``'s flags common to every script: directories, steps, timings, lr, ``--smoke``."""
    p.add_argument("--dir", default=str(default_dir), help="what prepare wrote")
    p.add_argument("--out", default="", help="log directory (default $OUT)")
    p.add_argument("--steps", type=int, default=steps, help="steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timings")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per run")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def out_dir(args: argparse.Namespace, default: str) -> Path:
    """``--out``, else ``$OUT``, else ``default``; created."""
    out = Path(args.out or os.environ.get("OUT", default))
    out.mkdir(parents=True, exist_ok=True)
    return out


def te_importable() -> bool:
    """Whether Transformer Engine imports (probed in a child: a broken TE may abort)."""
    probe = ("import sys\nfrom runtime.attention.te import te_available\n"
             "sys.exit(0 if te_available() else 1)")
    return subprocess.run([sys.executable, "-c", probe], cwd=ROOT,
                          capture_output=True).returncode == 0


def imports(module: str) -> bool:
    """Whether ``module`` imports in a fresh interpreter here; if not, print why (the last 30
    lines), before minutes of runs that would all fail the same way."""
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT,
                           capture_output=True, text=True)
    if probe.returncode:
        print(f"{module} does not import:\n"
              + "\n".join((probe.stdout + probe.stderr).splitlines()[-30:]), flush=True)
    return probe.returncode == 0


def launch(argv: list[str], nproc: int, log: Path, stdout: Path, timeout: float,
           module: str = "runtime.train", last: tuple[str, ...] = ()) -> int:
    """``python -m MODULE ARGV --log-jsonl LOG --quiet LAST`` under ``torchrun --nproc-per-node
    NPROC`` (one plain process at ``nproc`` 0), its output in ``stdout`` after the command line;
    the exit status, 124 past ``timeout`` seconds. ``log`` is removed first. ``LAST``: what must
    come after every flag (a tyro subcommand such as torchtitan's ``activation_checkpoint:none``
    takes the flags that follow it as its own)."""
    if nproc > 0:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), "-m", module, *argv]
    else:  # one plain process (the oracle)
        cmd = [sys.executable, "-m", module, *argv]
    cmd += ["--log-jsonl", str(log), "--quiet", *last]
    log.unlink(missing_ok=True)
    with open(stdout, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
        except subprocess.TimeoutExpired:
            return 124


def read_log(path: Path) -> list[dict[str, Any]]:
    """A run's ``--log-jsonl`` records ([] when it wrote none)."""
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def median(recs: list[dict[str, Any]], key: str, warmup: int) -> float:
    """The median of ``key`` over the steps from ``warmup`` on (all steps if none; nan: no
    steps)."""
    timed = [r for r in recs if int(r["step"]) >= warmup] or recs
    return statistics.median(float(r[key]) for r in timed) if timed else float("nan")


def run_row(plan: str, attention: str, rc: int, recs: list[dict[str, Any]],
            warmup: int) -> dict[str, Any]:
    """One run as a table row: status, steps, mean microbatches, median step time and tokens/s
    after ``warmup``, and the losses (for the comparisons the scripts add)."""
    return {"plan": plan, "attention": attention, "status": f"rc={rc}", "steps": len(recs),
            "microbatches": statistics.mean(r["microbatches"] for r in recs) if recs else 0,
            "median_step_s": median(recs, "seconds", warmup),
            "median_tokens_per_s": median(recs, "tokens_per_s", warmup),
            "losses": [r["loss"] for r in recs]}


def print_table(rows: list[dict[str, Any]], head: tuple[str, ...]) -> None:
    """``head``'s columns of ``rows``, ``|``-separated after a blank line; floats to 4 digits."""
    print("\n" + " | ".join(head))
    for r in rows:
        print(" | ".join(f"{r[h]:.4g}" if isinstance(r[h], float) else str(r[h]) for h in head))
