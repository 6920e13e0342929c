"""Megatron-core's schedules replaying plans on H200s: bf16 loss parity (1 GPU), dynamic vs static
CP and 1F1B over NCCL (2 GPUs).

Two phases, as ``bench/torchtitan_gpu.py`` (the flags, launches and table they share are
``bench/gpu_common.py``'s; the dataset and the dp 1 x cp 2 plans come from
``bench/train_compare.py``'s ``prepare``):

``prepare`` (CPU machine, PyPI reachable) writes into DIR (default ``out/megatron_gpu``, ignored
by git; carry it, about 15 MB): ``dataset.arrow``, ``dynamic.arrow`` (CP sizes 1 and 2),
``static.arrow`` (CP 2 only), ``single.arrow`` (a pool of one GPU, the same global batches),
``pp2.arrow`` (the same batches for pp 2 x pool 1) and ``wheels/``: the megatron-core 0.19.2
wheel for cp312 (the GPU machines' Python; its needs, numpy, packaging, psutil and torch, are in
the GPU image). Transformer Engine comes from ``shared/gpu-wheels`` (its README:
``install-te.sh``); without it the runs fall back to ``--attention reference`` (this project's
all-gather attention behind Megatron's spec, slow but exact).

``run --gpus 1``, Megatron as a production job runs it (``--attention te --dtype bf16``:
Megatron's TE layer spec, ``TEDotProductAttention`` in THD, Megatron's bf16 with fp32 main
weights; its DDP with ``--overlap-grad-reduce``, ``--use-distributed-optimizer`` with
``--overlap-param-gather``), on ``single.arrow``:

1. parity: the small model against the Megatron oracle in fp32 on the CPU (same GPTModel shape
   and initial weights, every segment alone; it runs beside the GPU runs), the largest per-step
   relative loss difference (bf16 tolerance 2e-2);
2. throughput: the 8-layer model, median tokens/s after ``--warmup`` steps, Megatron's DDP and
   distributed optimizer against ``--grad-sync pool`` (the adapter's plain all-reduce per
   gradient and AdamW, bf16 autocast over fp32 weights) on the same plan;
3. save and resume on the GPU: ``--save-every 2`` for 4 steps, then ``--resume`` from step 2;
   the resumed steps' losses against the uninterrupted run's.

``run --gpus 1 --moe``: only the mixture-of-experts parity (``bench/megatron_gpu_moe.py``):
the parity model with 4 experts (top 2) per layer, ``seq_aux_loss`` and ``global_aux_loss``,
through TE in bf16 against the fp32 CPU oracle (loss and load-balancing term per step, the
share of routing choices that differ, ``global_aux_loss``'s statistics pass in tokens/s).

``run --gpus 2``: ``torchrun --nproc-per-node 2 -m runtime.train --framework megatron`` for the
dynamic and the static plan (same samples in every step), an 8-layer hidden-2048 GQA model in
bf16: median step time and tokens/s after ``--warmup`` steps, speed-up of dynamic over static;
then ``pp2.arrow`` through Megatron's 1F1B schedule over NCCL (variable THD lengths between the
two stages), its losses against the 1-GPU-shaped run of the same batches.

Commands::

    .venv/bin/python bench/megatron_gpu.py prepare
    # GPU machine, carry ["out/megatron_gpu"]; install TE first (shared/gpu-wheels/README.md):
    python3 bench/megatron_gpu.py run --gpus 1 --out $OUT
    python3 bench/megatron_gpu.py run --gpus 2 --out $OUT
    python3 bench/megatron_gpu.py run --gpus 1 --moe --steps 4 --warmup 1 --out $OUT
    # the orchestration on this CPU machine (gloo, tiny model, reference attention; ~3 min):
    .venv/bin/python bench/megatron_gpu.py prepare --dir /tmp/mg --samples 60 --capacity 256 \\
        --global-batch-tokens 2048 --no-wheels
    .venv/bin/python bench/megatron_gpu.py run --smoke --gpus 2 --dir /tmp/mg --out /tmp/mgo
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_common import (  # noqa: E402
    add_prepare_args,
    add_run_args,
    launch,
    median,
    out_dir,
    print_table,
    read_log,
    run_row,
    te_importable,
)
from bench.megatron_gpu_moe import TYPES as MOE_TYPES  # noqa: E402
from bench.megatron_gpu_moe import run_moe  # noqa: E402

DEFAULT_DIR = ROOT / "out" / "megatron_gpu"
WHEELS = ["megatron-core==0.19.2"]
PRODUCTION = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
BIG = ["--layers", "8", "--hidden-size", "2048", "--heads", "16", "--query-groups", "4",
       "--ffn-hidden-size", "8192", "--vocab-size", "32000", "--dtype", "bf16"]
PARITY = ["--layers", "2", "--hidden-size", "256", "--heads", "8", "--query-groups", "2",
          "--vocab-size", "32000"]
SMOKE = ["--layers", "2", "--hidden-size", "32", "--heads", "4", "--query-groups", "2",
         "--vocab-size", "32000"]
BF16_TOL = 2e-2


def prepare(args: argparse.Namespace) -> int:
    from bench.train_compare import prepare as prepare_plans
    from planner.cli import main as dcp_plan

    rc = prepare_plans(args)
    if rc:
        return rc
    out = Path(args.dir)
    common = [str(out / "dataset.arrow"), "--global-batch-tokens", str(args.global_batch_tokens),
              "--seed", str(args.seed), "--cost-model", args.cost_model]
    # The same global batches on one GPU, and on two pipeline stages of one pool rank (a rank
    # holds up to 2 C tokens per microbatch, so no sample is split).
    for name, par in (("single", ["--dp", "1", "--cp", "1"]),
                      ("pp2", ["--dp", "1", "--cp", "1", "--pp", "2"])):
        rc = dcp_plan(common + par + ["--max-tokens-per-rank", str(2 * args.capacity),
                                      "-o", str(out / f"{name}.arrow")])
        if rc:
            return rc
    if args.no_wheels:
        return 0
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
           "-d", str(out / "wheels"), *WHEELS]
    return subprocess.run(cmd).returncode


def _ensure_megatron(src: Path) -> None:
    try:
        if importlib.util.find_spec("megatron.core") is not None:
            return
    except ModuleNotFoundError:  # no "megatron" package at all
        pass
    wheels = sorted(str(p) for p in (src / "wheels").glob("megatron_core-*.whl"))
    if not wheels:
        raise SystemExit(f"megatron-core is not installed and {src}/wheels has no wheel: run "
                         "prepare on the CPU machine and carry its directory")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *wheels], check=True)
    importlib.invalidate_caches()


def _attention(args: argparse.Namespace) -> str:
    if args.smoke:
        return "reference"
    if te_importable():
        return "te"
    print("Transformer Engine not importable: --attention reference", flush=True)
    return "reference"


def _rel_diffs(got: list[dict[str, float]], want: list[dict[str, float]]) -> list[float]:
    ref = {int(r["step"]): float(r["loss"]) for r in want if "step" in r}
    return [abs(float(r["loss"]) - ref[int(r["step"])]) / abs(ref[int(r["step"])])
            for r in got if "step" in r and int(r["step"]) in ref]


def _start_oracle(argv: list[str], log: Path, stdout: Path) -> subprocess.Popen[bytes]:
    """The CPU oracle as a background process (it needs minutes; the GPU runs go on)."""
    cmd = [sys.executable, "-m", "runtime.train", *argv, "--log-jsonl", str(log), "--quiet"]
    log.unlink(missing_ok=True)
    f = open(stdout, "w")  # noqa: SIM115 - the child owns it until it exits
    f.write(" ".join(cmd) + "\n")
    f.flush()
    return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _one_gpu_flags(args: argparse.Namespace) -> tuple[str, list[str], list[str], list[str]]:
    """(attention, the parity model's flags, the device's, the production run's)."""
    attention = _attention(args)
    small = SMOKE if args.smoke else PARITY
    device = ["--device", "cpu"] if args.smoke else ["--device", "cuda", "--dtype", "bf16"]
    return attention, small, device, device + ["--attention", attention] + PRODUCTION


def run_one_gpu(src: Path, out: Path, args: argparse.Namespace) -> int:
    attention, small, device, production = _one_gpu_flags(args)
    data = ["--framework", "megatron", "--plan", str(src / "single.arrow"), "--dataset",
            str(src / "dataset.arrow"), "--lr", str(args.lr)]
    oracle = _start_oracle(data + small + ["--steps", str(args.steps), "--reference",
                                           "--device", "cpu"],
                           out / "parity_ref.jsonl", out / "parity_ref.txt")
    rows: dict[str, object] = {"attention": attention}
    # 1. the parity run (its oracle is running on the CPU meanwhile)
    rc = launch(data + small + production + ["--steps", str(args.steps), "--summary-json",
                                              str(out / "parity_summary.json")],
                 1, out / "parity_gpu.jsonl", out / "parity_gpu.txt", args.timeout)
    summary_path = out / "parity_summary.json"
    rows["parity_run"] = {"rc": rc, "summary": json.loads(summary_path.read_text())
                          if summary_path.is_file() else None}
    # 2. throughput: Megatron's DDP + distributed optimizer against PoolGradSync + AdamW
    big = SMOKE if args.smoke else [x for x in BIG if x not in ("--dtype", "bf16")]
    for name, extra in (("megatron-ddp", production), ("pool", device + [
            "--attention", attention, "--grad-sync", "pool"])):
        log = out / f"tput_{name}.jsonl"
        rc = launch(data + big + extra + ["--steps", str(args.steps)], 1, log,
                     out / f"tput_{name}.txt", args.timeout)
        recs = read_log(log)
        rows[f"throughput_{name}"] = {
            "rc": rc, "steps": len(recs),
            "median_tokens_per_s": median(recs, "tokens_per_s", args.warmup),
            "median_step_s": median(recs, "seconds", args.warmup),
            "losses": [r["loss"] for r in recs]}
    ddp_rate = rows["throughput_megatron-ddp"]["median_tokens_per_s"]  # type: ignore[index]
    pool_rate = rows["throughput_pool"]["median_tokens_per_s"]  # type: ignore[index]
    rows["ddp_over_pool_tokens_per_s"] = float(ddp_rate) / float(pool_rate)
    # 3. save every 2 steps for 4 steps, then resume from step 2 (on the GPU)
    ckpt = Path(args.checkpoint_dir)
    shutil.rmtree(ckpt, ignore_errors=True)
    resume = data + small + production + ["--steps", "4"]
    rc_full = launch(resume + ["--save", str(ckpt), "--save-every", "2"], 1,
                      out / "resume_full.jsonl", out / "resume_full.txt", args.timeout)
    rc_res = launch(resume + ["--resume", str(ckpt / "step-00000002")], 1,
                     out / "resume_part.jsonl", out / "resume_part.txt", args.timeout)
    full = {int(r["step"]): r["loss"] for r in read_log(out / "resume_full.jsonl")}
    part = {int(r["step"]): r["loss"] for r in read_log(out / "resume_part.jsonl")}
    rows["resume"] = {"rc": [rc_full, rc_res], "uninterrupted": full, "resumed": part,
                      "max_abs_diff": max((abs(part[s] - full[s]) for s in part if s in full),
                                          default=float("nan"))}
    # 1. (the oracle's half)
    try:
        rc_ref = oracle.wait(timeout=max(args.timeout, 1.0))
    except subprocess.TimeoutExpired:
        oracle.kill()
        rc_ref = 124
    gpu, ref = read_log(out / "parity_gpu.jsonl"), read_log(out / "parity_ref.jsonl")
    diffs = _rel_diffs(gpu, ref)
    worst = max(diffs) if diffs else float("nan")
    rows["parity"] = {"oracle_rc": rc_ref, "steps_compared": len(diffs),
                      "max_rel_loss_diff": worst, "losses_gpu": [r["loss"] for r in gpu],
                      "losses_oracle": [r["loss"] for r in ref],
                      "median_tokens_per_s": median(gpu, "tokens_per_s", args.warmup)}
    (out / "one_gpu.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows, indent=1))
    ok = (rows["parity_run"]["rc"] == 0 and diffs and worst <= BF16_TOL  # type: ignore[index]
          and rows["resume"]["rc"] == [0, 0])  # type: ignore[index]
    print(f"one GPU: {'PASS' if ok else 'FAIL'} (parity {worst:.3g} over {len(diffs)} steps, "
          f"tolerance {BF16_TOL}; DDP / pool tokens/s {rows['ddp_over_pool_tokens_per_s']:.3f};"
          f" resume max |diff| {rows['resume']['max_abs_diff']})")  # type: ignore[index]
    return 0 if ok else 1


def run_compare(src: Path, out: Path, args: argparse.Namespace) -> int:
    attention = _attention(args)
    shape = SMOKE if args.smoke else BIG
    device = "cpu" if args.smoke else "cuda"
    rows = []
    for plan in ("dynamic", "static", "pp2"):
        argv = ["--framework", "megatron", "--plan", str(src / f"{plan}.arrow"), "--dataset",
                str(src / "dataset.arrow"), "--device", device, "--attention", attention,
                "--steps", str(args.steps), "--lr", str(args.lr), *shape]
        rc = launch(argv, 2, out / f"{plan}.jsonl", out / f"{plan}.txt", args.timeout)
        rows.append(run_row(plan, attention, rc, read_log(out / f"{plan}.jsonl"), args.warmup))
        print(f"{plan}: rc={rc} steps={rows[-1]['steps']}", flush=True)
    static = rows[1]
    for r in rows:
        r["speedup_vs_static"] = float(static["median_step_s"]) / float(r["median_step_s"])
        r["max_rel_loss_diff_vs_static"] = max(
            (abs(a - b) / abs(b) for a, b in zip(r["losses"], static["losses"], strict=False)),
            default=float("nan"))
    (out / "compare.json").write_text(json.dumps(rows, indent=1))
    head = ("plan", "attention", "status", "steps", "microbatches", "median_step_s",
            "median_tokens_per_s", "speedup_vs_static", "max_rel_loss_diff_vs_static")
    print_table(rows, head)
    return 0 if all(r["status"] == "rc=0" for r in rows) else 1


def run(args: argparse.Namespace) -> int:
    src = Path(args.dir)
    out = out_dir(args, "out/megatron_gpu_logs")
    if args.moe and args.gpus != 1:
        raise SystemExit("--moe runs on one GPU: use --gpus 1")
    _ensure_megatron(src)
    if args.moe:
        _, small, _, production = _one_gpu_flags(args)
        return run_moe(src, out, args, small=small, production=production,
                       start_oracle=_start_oracle, tol=BF16_TOL)
    return run_one_gpu(src, out, args) if args.gpus == 1 else run_compare(src, out, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="dataset, plans and the megatron-core wheel (CPU)")
    add_prepare_args(pp, DEFAULT_DIR)
    pp.add_argument("--no-wheels", action="store_true", help="skip downloading the wheel")
    pr = sub.add_parser("run", help="parity (--gpus 1) or dynamic vs static + pp2 (--gpus 2)")
    add_run_args(pr, DEFAULT_DIR, steps=8, timeout=300.0)
    pr.add_argument("--gpus", type=int, choices=(1, 2), required=True, help="GPUs of the machine")
    pr.add_argument("--checkpoint-dir", default="/tmp/dcp-megatron-gpu-ckpt",
                    help="where the save/resume check writes (removed first)")
    pr.add_argument("--moe", action="store_true",
                    help="only the mixture-of-experts parity (bench/megatron_gpu_moe.py)")
    pr.add_argument("--moe-types", default=",".join(MOE_TYPES),
                    help="--moe: the load-balancing types, comma-separated")
    args = p.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
