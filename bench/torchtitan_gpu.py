"""torchtitan's trainer replaying plans on H200s: bf16 parity (1 GPU), dynamic vs static CP (2).

Two phases, as ``bench/train_compare.py`` (whose ``prepare`` makes the dataset and the dp 1 x cp 2
plans):

``prepare`` (CPU machine, PyPI reachable) writes into DIR (default ``out/torchtitan_gpu``, ignored
by git; carry it, about 15 MB): ``dataset.arrow``, ``dynamic.arrow`` (CP sizes 1 and 2),
``static.arrow`` (CP 2 only), ``single.arrow`` (a pool of one GPU, the same global batches) and
``wheels/``: torchtitan 0.3.0 and the packages it imports that the GPU image lacks (spmd_types,
torchdata, torch_checkpointing, tyro, docstring_parser, typeguard, datasets, dill, multiprocess;
2.6 MB, pure Python, installed there with ``--no-deps --no-index``). torchtitan 0.3.0 runs on
the GPU machines' torch 2.11 through ``runtime.adapters.torchtitan.compat`` (the torch names it
lacks); ``run`` writes the versions and those shims to ``environment.json``.
``scripts/check_torchtitan_torch211.sh`` checks all of it on CPU under torch 2.11, installing
these wheels the way ``run`` does.

``run --gpus 1`` (1-GPU machine): ``dcp-train --framework torchtitan --device cuda --attention
torch --dtype bf16`` on ``single.arrow`` (torch's fused varlen kernel, FSDP of one rank), then the
torchtitan oracle in fp32 on the CPU (same llama3, same weights, every segment alone), and the
largest per-step relative loss difference (bf16 tolerance: 2e-2).

``run --gpus 2`` (2-GPU machine): ``torchrun --nproc-per-node 2 -m runtime.train --framework
torchtitan`` for the dynamic and the static plan (same samples in every step), attention torch
(and te when Transformer Engine is importable), an 8-layer hidden-2048 GQA llama3 in bf16; then
torchtitan's *own* static CP on the same global batches (``bench/torchtitan_static_cp.py``:
``context_parallel_degree=2``, FlexAttention with the document mask, the stock trainer, the same
weights); median step time and tokens/s after ``--warmup`` steps, speed-ups over both.

Commands::

    .venv/bin/python bench/torchtitan_gpu.py prepare
    # GPU machine, carry ["out/torchtitan_gpu"]; one call each (the fp32 CPU oracle there takes
    # ~25 s a step: 6 steps keep a --gpus 1 call near 5 minutes):
    python3 bench/torchtitan_gpu.py run --gpus 1 --steps 6 --timeout 270 --out $OUT
    python3 bench/torchtitan_gpu.py run --gpus 2 --out $OUT
    # the orchestration on this CPU machine (gloo, tiny model, reference attention; ~3 min):
    .venv/bin/python bench/torchtitan_gpu.py prepare --dir /tmp/ttg --samples 60 \
        --capacity 256 --global-batch-tokens 2048 --no-wheels
    .venv/bin/python bench/torchtitan_gpu.py run --smoke --gpus 2 --dir /tmp/ttg --out /tmp/ttgo
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_common import (  # noqa: E402
    add_prepare_args,
    add_run_args,
    imports,
    launch,
    median,
    out_dir,
    print_table,
    read_log,
    run_row,
    te_importable,
)

DEFAULT_DIR = ROOT / "out" / "torchtitan_gpu"
# What torchtitan 0.3.0 imports beyond the GPU image (KINDS.md lists the image's packages);
# versions as resolved on the CPU machine, where the adapter's tests pass.
WHEELS = ["torchtitan==0.3.0", "spmd_types==0.2.3", "torchdata==0.11.0",
          "torch_checkpointing==0.1.1", "tyro==1.0.17", "docstring_parser==0.18.0",
          "typeguard==4.6.1", "datasets==4.7.0", "dill==0.4.0", "multiprocess==0.70.18"]
BIG = ["--layers", "8", "--hidden-size", "2048", "--heads", "16", "--query-groups", "4",
       "--ffn-hidden-size", "8192", "--vocab-size", "32000", "--dtype", "bf16"]
# 1 GPU: small enough for the fp32 CPU oracle to finish in a minute or two.
PARITY = ["--layers", "2", "--hidden-size", "256", "--heads", "8", "--query-groups", "2",
          "--vocab-size", "32000"]
SMOKE = ["--layers", "1", "--hidden-size", "32", "--vocab-size", "32000"]
BF16_TOL = 2e-2


def prepare(args: argparse.Namespace) -> int:
    from bench.train_compare import prepare as prepare_plans
    from planner.cli import main as dcp_plan

    rc = prepare_plans(args)
    if rc:
        return rc
    out = Path(args.dir)
    # The same global batches for one GPU: same dataset, seed and batch tokens, a pool of 1
    # (a single rank may hold up to 2 C tokens per microbatch so that no sample is split).
    rc = dcp_plan([str(out / "dataset.arrow"), "--dp", "1", "--cp", "1", "--max-tokens-per-rank",
                   str(2 * args.capacity), "--global-batch-tokens", str(args.global_batch_tokens),
                   "--seed", str(args.seed), "--cost-model", args.cost_model,
                   "-o", str(out / "single.arrow")])
    if rc or args.no_wheels:
        return rc
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", args.wheel_python, "--platform", "manylinux2014_x86_64",
           "-d", str(out / "wheels"), *WHEELS]
    return subprocess.run(cmd).returncode


def _ensure_torchtitan(src: Path) -> None:
    if importlib.util.find_spec("torchtitan") is not None:
        return
    wheels = sorted(str(p) for p in (src / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"torchtitan is not installed and {src}/wheels has no wheels: run "
                         "prepare on the CPU machine and carry its directory")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *wheels], check=True)


def _record_environment(out: Path) -> None:
    """torch and torchtitan versions, and the torch shims torchtitan needs there
    (``runtime.adapters.torchtitan.compat``), into ``environment.json``."""
    from importlib.metadata import version

    import torch

    from runtime.adapters.torchtitan import compat

    env = {"torch": torch.__version__, "torchtitan": version("torchtitan"),
           "cuda_devices": torch.cuda.device_count(), "torch_shims": compat.install()}
    (out / "environment.json").write_text(json.dumps(env, indent=1))
    print(json.dumps(env), flush=True)


def run_parity(src: Path, out: Path, args: argparse.Namespace) -> int:
    data = str(src / "dataset.arrow")
    common = ["--framework", "torchtitan", "--plan", str(src / "single.arrow"), "--dataset",
              data, "--steps", str(args.steps), "--lr", str(args.lr),
              *(SMOKE if args.smoke else PARITY)]
    device = ["--device", "cpu", "--attention", "reference"] if args.smoke else [
        "--device", "cuda", "--attention", "torch", "--dtype", "bf16"]
    t0 = time.perf_counter()
    rc_gpu = launch(common + device, 1, out / "parity_gpu.jsonl", out / "parity_gpu.txt",
                     args.timeout)
    wall_gpu = time.perf_counter() - t0
    rc_ref = launch(common + ["--reference", "--device", "cpu"], 0, out / "parity_ref.jsonl",
                     out / "parity_ref.txt", args.timeout)
    gpu, ref = read_log(out / "parity_gpu.jsonl"), read_log(out / "parity_ref.jsonl")
    want = {int(r["step"]): float(r["loss"]) for r in ref}
    diffs = [abs(float(r["loss"]) - want[int(r["step"])]) / abs(want[int(r["step"])])
             for r in gpu if int(r["step"]) in want]
    worst = max(diffs) if diffs else float("nan")
    row = {"run": "parity 1 GPU (torch varlen, bf16) vs CPU oracle (fp32)",
           "status": f"gpu rc={rc_gpu}, oracle rc={rc_ref}", "steps": len(gpu),
           "wall_s": round(wall_gpu, 1), "max_rel_loss_diff": worst,
           "median_tokens_per_s": median(gpu, "tokens_per_s", args.warmup),
           "losses_gpu": [r["loss"] for r in gpu], "losses_oracle": [r["loss"] for r in ref]}
    (out / "parity.json").write_text(json.dumps(row, indent=1))
    print(json.dumps(row, indent=1))
    ok = rc_gpu == 0 and rc_ref == 0 and len(diffs) == args.steps and worst <= BF16_TOL
    print(f"parity: {'PASS' if ok else 'FAIL'} (max relative loss difference {worst:.3g}, "
          f"tolerance {BF16_TOL})")
    return 0 if ok else 1


def run_compare(src: Path, out: Path, args: argparse.Namespace) -> int:
    data = str(src / "dataset.arrow")
    attentions = ["reference"] if args.smoke else [a for a in args.attention.split(",") if a]
    if "te" in attentions and not te_importable():
        print("Transformer Engine not importable: skipping the te runs", flush=True)
        attentions.remove("te")
    # One row per run; values of several types (str, int, float, list of losses) that the loop
    # below reads back by key, so the rows are typed as plain JSON objects.
    rows: list[dict[str, Any]] = []

    def add(name: str, plan: str, attention: str, argv: list[str], module: str) -> None:
        rc = launch(argv, 2, out / f"{name}.jsonl", out / f"{name}.txt", args.timeout, module)
        rows.append(run_row(plan, attention, rc, read_log(out / f"{name}.jsonl"), args.warmup))
        print(f"{name}: rc={rc} steps={rows[-1]['steps']}", flush=True)

    model = SMOKE if args.smoke else BIG
    device = ["--device", "cpu" if args.smoke else "cuda"]
    for attention in attentions:
        for plan in ("dynamic", "static"):
            argv = ["--framework", "torchtitan", "--plan", str(src / f"{plan}.arrow"),
                    "--dataset", data, *device, "--attention", attention,
                    "--steps", str(args.steps), "--lr", str(args.lr), *model]
            add(f"{plan}_{attention}", plan, attention, argv, "runtime.train")
    # torchtitan's own CP (fixed cp=2, FlexAttention with the document mask) on the same
    # global batches. On CPU (--smoke) torchtitan's CP cannot run (no CPU sharding rule for
    # SDPA, no Flex backward): the smoke run checks the packing and the loop with cp=1.
    titan = (["--cp", "1", "--inner", "sdpa"] if args.smoke else ["--cp", "2", "--inner", "flex"])
    add("titan_cp", "titan-cp", "flex" if not args.smoke else "sdpa",
        [*titan, "--plan", str(src / "static.arrow"), "--dataset", data, *device,
         "--steps", str(args.steps), "--lr", str(args.lr), *model], "bench.torchtitan_static_cp")
    titan_row = rows[-1]
    for r in rows:
        # titan-cp is compared with the first static-plan row (its attention differs).
        static = next((s for s in rows if s["plan"] == "static"
                       and s["attention"] == r["attention"]),
                      next(s for s in rows if s["plan"] == "static"))
        r["speedup_vs_static"] = float(static["median_step_s"]) / float(r["median_step_s"])
        r["speedup_vs_titan_cp"] = (float(titan_row["median_step_s"])
                                    / float(r["median_step_s"]))
        r["max_loss_diff_vs_static"] = max(
            (abs(a - b) for a, b in zip(r["losses"], static["losses"], strict=False)),
            default=float("nan"))
    (out / "compare.json").write_text(json.dumps(rows, indent=1))
    head = ("plan", "attention", "status", "steps", "microbatches", "median_step_s",
            "median_tokens_per_s", "speedup_vs_static", "speedup_vs_titan_cp",
            "max_loss_diff_vs_static")
    print_table(rows, head)
    return 0 if all(r["status"] == "rc=0" for r in rows) else 1


def run(args: argparse.Namespace) -> int:
    src = Path(args.dir)
    out = out_dir(args, "out/torchtitan_gpu_logs")
    _ensure_torchtitan(src)
    if not imports("runtime.adapters.torchtitan.launch"):
        return 1
    _record_environment(out)
    return run_parity(src, out, args) if args.gpus == 1 else run_compare(src, out, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="dataset, plans and wheels (CPU machine)")
    add_prepare_args(pp, DEFAULT_DIR)
    pp.add_argument("--no-wheels", action="store_true", help="skip downloading the wheels")
    pp.add_argument("--wheel-python", default="3.12",
                    help="Python version the wheels are for (the GPU machines': 3.12)")
    pr = sub.add_parser("run", help="parity (--gpus 1) or dynamic vs static (--gpus 2)")
    add_run_args(pr, DEFAULT_DIR, steps=8, timeout=300.0)
    pr.add_argument("--gpus", type=int, choices=(1, 2), required=True, help="GPUs of the machine")
    pr.add_argument("--attention", default="torch,te", help="--gpus 2: attentions to compare")
    args = p.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
