"""torchtitan's own entry point replaying a plan on one H200, against ``dcp-train`` and the oracle.

Issue 34 item 4. Three runs of the same plan (``single.arrow`` from ``bench/torchtitan_gpu.py
prepare``), the same llama3 (2 layers x 256, vocabulary 32,000), the same initial weights (seed
0) and the same optimizer (AdamW 3e-4, no weight decay, constant rate, no clipping):

1. ``registry``: ``torchrun --nproc-per-node 1 -m torchtitan.train --module
   bench.torchtitan_registry_config --config llama3_bench_parity --plan.path single.arrow ...``:
   torchtitan's ``llama3_debugmodel`` job from ``runtime.adapters.torchtitan.registry.with_plan``
   with the bench's model (torchtitan keeps the model off its command line, so the shape is a
   config function: ``bench/torchtitan_registry_config.py``); everything else by torchtitan's
   flags (``REGISTRY_FLAGS``): bf16 through torchtitan's FSDP mixed precision
   (``--training.mixed_precision_param bfloat16``, fp32 reductions: what ``dcp-train --dtype
   bf16`` sets), activation checkpointing off (``activation_checkpoint:none``; the debug config
   has selective), and the adapter's ``--attention torch`` (torch's fused flash varlen kernel;
   ``te`` when Transformer Engine imports there, which the GPU image's does not). Under torch
   2.11 ``import torchtitan.train`` fails before ``--module`` is read (it imports a name 2.11
   lacks), so there the same module runs after ``compat.install`` (``--entry``, default auto:
   ``bench/torchtitan_train_shimmed.py``);
2. ``dcp-train``: ``dcp-train --framework torchtitan --device cuda --attention torch --dtype
   bf16`` (the ``PlanTrainer.Config`` that ``config.trainer_config`` builds), as
   ``bench/torchtitan_gpu.py run --gpus 1`` runs it;
3. ``oracle``: ``dcp-train --framework torchtitan --reference`` in fp32 on the host's CPU (every
   document alone), the first ``--steps`` steps.

The GPU runs train ``--timing-steps`` steps (the plan's 20 by default) so that the median
tokens/s after ``--warmup`` has enough steps; the losses are compared over the oracle's steps:
registry vs oracle and dcp-train vs oracle (largest relative difference, bf16 tolerance 2e-2),
registry vs dcp-train (the same trainer under two configs: equal up to GPU nondeterminism).
``numbers.json`` holds everything printed.

Commands::

    .venv/bin/python bench/torchtitan_gpu.py prepare          # CPU machine, once
    # the H200, carry ["out/torchtitan_gpu"] (~4-5 minutes, most of it the CPU oracle):
    python3 bench/torchtitan_registry_gpu.py run --steps 6 --out $OUT
    # this CPU machine (gloo, the 1 x 32 smoke model, reference attention, fp32: every run must
    # equal the oracle to 1e-5; ~1 minute):
    .venv/bin/python bench/torchtitan_gpu.py prepare --dir /tmp/ttg --samples 60 \\
        --capacity 256 --global-batch-tokens 2048 --no-wheels
    .venv/bin/python bench/torchtitan_registry_gpu.py run --smoke --dir /tmp/ttg --out /tmp/ttgr
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_common import (  # noqa: E402
    add_run_args,
    imports,
    launch,
    median,
    out_dir,
    print_table,
    read_log,
    te_importable,
)
from bench.torchtitan_gpu import (  # noqa: E402
    BF16_TOL,
    DEFAULT_DIR,
    PARITY,
    SMOKE,
    _ensure_torchtitan,
    _record_environment,
)

SHIMMED = "bench.torchtitan_train_shimmed"
FP32_TOL = 1e-5
"""--smoke: every run is fp32 on the CPU, so it must equal the oracle to fp32 rounding."""


def registry_flags(args: argparse.Namespace, src: Path, out: Path, attention: str,
                   steps: int) -> list[str]:
    """torchtitan's flags for run 1: the optimizer, schedule, clipping and precision that
    ``dcp-train``'s config sets, spelled as a torchtitan user spells them."""
    return [
        "--module", "bench.torchtitan_registry_config", "--config",
        "llama3_bench_smoke" if args.smoke else "llama3_bench_parity",
        "--plan.path", str(src / "single.arrow"), "--plan.dataset", str(src / "dataset.arrow"),
        "--training.steps", str(steps), "--seed", "0", "--attention", attention,
        "--optimizer.implementation", "for-loop",
        "--optimizer.param-groups.0.optimizer-kwargs.lr", str(args.lr),
        "--optimizer.param-groups.0.optimizer-kwargs.weight-decay", "0.0",
        "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0.0",
        "--training.max_norm", "inf",
        "--training.mixed_precision_param", "float32" if args.smoke else "bfloat16",
        "--training.mixed_precision_reduce", "float32",
        "--checkpoint.no-initial-load-model-only", "--dump_folder", str(out / "titan_dump")]


def _worst(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> float:
    """Largest relative loss difference over the steps both runs logged (nan: none)."""
    ref = {int(r["step"]): float(r["loss"]) for r in want}
    diffs = [abs(float(r["loss"]) - ref[int(r["step"])]) / abs(ref[int(r["step"])])
             for r in got if int(r["step"]) in ref]
    return max(diffs) if diffs else float("nan")


def _entry(choice: str, out: Path) -> str:
    """The module torchrun starts for run 1: ``torchtitan.train`` itself, or (``auto``, when
    ``import torchtitan.train`` fails here: torch 2.11 lacks a name it imports) the same module
    after ``compat.install`` (``bench/torchtitan_train_shimmed.py``); the probe's error is
    kept in ``entry_probe.txt``."""
    if choice != "auto":
        return choice
    probe = subprocess.run([sys.executable, "-c", "import torchtitan.train"], cwd=ROOT,
                           capture_output=True, text=True)
    if probe.returncode == 0:
        return "torchtitan.train"
    tail = "\n".join((probe.stdout + probe.stderr).splitlines()[-15:])
    (out / "entry_probe.txt").write_text(f"python -c 'import torchtitan.train':\n{tail}\n")
    print(f"import torchtitan.train failed here ({tail.splitlines()[-1] if tail else '?'}): "
          f"running it after compat.install ({SHIMMED})", flush=True)
    return SHIMMED


def run(args: argparse.Namespace) -> int:
    src = Path(args.dir)
    out = out_dir(args, "out/torchtitan_registry_logs")
    _ensure_torchtitan(src)
    if not imports("bench.torchtitan_registry_config"):
        return 1
    _record_environment(out)
    entry = _entry(args.entry, out)
    attention = "reference" if args.smoke else (
        "te" if args.attention == "te" and te_importable() else "torch")
    from runtime.data.plan_reader import PlanReader

    with PlanReader(str(src / "single.arrow")) as reader:  # the registry refuses more steps
        timing = min(max(args.timing_steps, args.steps), reader.num_steps)
    rcs, wall = {}, {}

    def add(name: str, argv: list[str], nproc: int, module: str,
            last: tuple[str, ...] = ()) -> None:
        t0 = time.perf_counter()
        rcs[name] = launch(argv, nproc, out / f"{name}.jsonl", out / f"{name}.txt", args.timeout,
                           module, last)
        wall[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: rc={rcs[name]} in {wall[name]} s", flush=True)

    add("registry", registry_flags(args, src, out, attention, timing), 1, entry,
        ("activation_checkpoint:none",))
    common = ["--framework", "torchtitan", "--plan", str(src / "single.arrow"), "--dataset",
              str(src / "dataset.arrow"), "--lr", str(args.lr),
              *(SMOKE if args.smoke else PARITY)]
    device = ["--device", "cpu"] if args.smoke else ["--device", "cuda", "--dtype", "bf16"]
    add("dcp_train", [*common, *device, "--attention", attention, "--steps", str(timing)], 1,
        "runtime.train")
    add("oracle", [*common, "--reference", "--device", "cpu", "--steps", str(args.steps)], 0,
        "runtime.train")
    logs = {name: read_log(out / f"{name}.jsonl") for name in rcs}
    rows: list[dict[str, Any]] = [
        {"run": name, "status": f"rc={rcs[name]}", "steps": len(logs[name]), "wall_s": wall[name],
         "median_tokens_per_s": median(logs[name], "tokens_per_s", args.warmup),
         "median_step_s": median(logs[name], "seconds", args.warmup),
         "max_rel_loss_diff_vs_oracle": _worst(logs[name], logs["oracle"])}
        for name in rcs]
    tol = FP32_TOL if args.smoke else BF16_TOL
    registry_vs_dcp = _worst(logs["registry"], logs["dcp_train"])
    ok = (all(rc == 0 for rc in rcs.values()) and len(logs["oracle"]) == args.steps
          and all(r["max_rel_loss_diff_vs_oracle"] <= tol for r in rows[:2]))
    numbers = {"entry": entry, "attention": attention, "dtype": "fp32" if args.smoke else "bf16",
               "tolerance": tol, "warmup": args.warmup, "oracle_steps": args.steps,
               "timing_steps": timing, "registry_vs_dcp_train_max_rel_loss_diff": registry_vs_dcp,
               "tokens_per_s_registry_over_dcp_train":
                   rows[0]["median_tokens_per_s"] / rows[1]["median_tokens_per_s"],
               "pass": ok, "runs": rows,
               "losses": {name: [r["loss"] for r in logs[name]] for name in rcs}}
    (out / "numbers.json").write_text(json.dumps(numbers, indent=1))
    print_table(rows, ("run", "status", "steps", "wall_s", "median_tokens_per_s",
                       "median_step_s", "max_rel_loss_diff_vs_oracle"))
    print(f"registry vs dcp-train: max relative loss difference {registry_vs_dcp:.3g}; "
          f"tokens/s ratio {numbers['tokens_per_s_registry_over_dcp_train']:.4g}")
    print(f"parity: {'PASS' if ok else 'FAIL'} (tolerance {tol})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("run", help="registry vs dcp-train vs the CPU oracle (1 GPU); the "
                        "directory is bench/torchtitan_gpu.py prepare's")
    add_run_args(pr, DEFAULT_DIR, steps=6, timeout=300.0)
    pr.add_argument("--timing-steps", type=int, default=20,
                    help="steps of the two GPU runs (the plan's 20; losses compared over --steps)")
    pr.add_argument("--attention", choices=("torch", "te"), default="torch",
                    help="the adapter's CUDA attention (te only where Transformer Engine imports)")
    pr.add_argument("--entry", choices=("auto", "torchtitan.train", SHIMMED), default="auto",
                    help="module of run 1 (auto: torchtitan.train, or the shimmed one where "
                    "it does not import)")
    args = p.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
