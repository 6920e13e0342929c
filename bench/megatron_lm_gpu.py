"""Megatron-LM's own ``pretrain_gpt.py`` with a plan on one H200, against ``dcp-train`` and the
fp32 CPU oracle.

``prepare`` (CPU machine, PyPI reachable; DIR defaults to ``out/megatron_lm_gpu``, ignored):
the Wikipedia-length dataset of ``bench/train_compare.py``, ``single.arrow`` (a pool of one GPU,
32 documents per step, 32K tokens per rank), the megatron-core 0.19.2 cp312 wheel, and
Megatron-LM's ``pretrain_gpt.py``, ``gpt_builders.py`` and ``model_provider.py`` at tag
``core_v0.19.0`` copied from a fetched checkout (``--megatron-lm REPO``) into ``.megatron-lm/``
(ignored; never committed; carry both).

``run`` (GPU machine, Transformer Engine installed), all on ``single.arrow``, the parity model
(2 layers, hidden 256, GQA 8/2, vocabulary 32128) in bf16 through TE, every weight from
``--init-seed 1``:

1. ``features``: the launcher with upstream ``pretrain_gpt.py``, full recomputation, warmup and
   cosine decay, the distributed optimizer with overlapped reduce and gather, ``--save`` at
   iteration 4 of 8; then ``resume``: ``--load`` from iteration 4. Its losses against the fp32
   CPU oracle (``--reference`` on the same command, run on this machine's CPUs meanwhile) and
   the resumed iterations against the uninterrupted ones;
2. ``constant``: the launcher at a constant learning rate, no weight decay and no clipping, as
   ``dcp-train`` trains, against ``dcp-train --framework megatron --device cuda --attention te
   --dtype bf16`` with Megatron's distributed optimizer on the same plan and weights: per-step
   loss and median tokens/s after ``--warmup`` steps.

A pool of one GPU runs CP 1 only: this checks TE's THD packs with a varying microbatch count,
bf16, Megatron-LM's loop, checkpoints and logging on a GPU, not CP groups or pipelining (those
need 2+ GPUs). Commands::

    .venv/bin/python bench/megatron_lm_gpu.py prepare --megatron-lm /path/to/Megatron-LM
    # GPU machine: carry ["out/megatron_lm_gpu", ".megatron-lm"]; install TE first
    python3 bench/megatron_lm_gpu.py run --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_common import (  # noqa: E402
    add_prepare_args,
    launch,
    median,
    out_dir,
    print_table,
    read_log,
)

DEFAULT_DIR = ROOT / "out" / "megatron_lm_gpu"
UPSTREAM = ROOT / ".megatron-lm"
TAG = "core_v0.19.0"
FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
STEPS = 8
SEED = 1
BF16_TOL = 2e-2
# The parity model in Megatron-LM's flags (NullTokenizer adds the end-of-document token:
# 32127 + 1 = 32128 = 251 x 128, so nothing is padded) and in dcp-train's.
MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "1024",
         "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
         "--position-embedding-type", "rope", "--seq-length", "32768", "--max-position-embeddings",
         "32768", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32127",
         "--micro-batch-size", "1", "--global-batch-size", "32", "--calculate-per-token-loss",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1",
         "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234"]
GPU = ["--transformer-impl", "transformer_engine", "--bf16", "--no-gradient-accumulation-fusion"]
CPU = ["--transformer-impl", "local", "--no-persist-layer-norm",
       "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
       "--no-bias-dropout-fusion", "--no-rope-fusion"]
FEATURES = ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters",
            "2", "--weight-decay", "0.1", "--clip-grad", "1.0", "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
CONSTANT = ["--lr", "3e-4", "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad",
            "0", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
DCP_TRAIN = ["--layers", "2", "--hidden-size", "256", "--heads", "8", "--query-groups", "2",
             "--ffn-hidden-size", "1024", "--vocab-size", "32128", "--lr", "3e-4",
             "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def prepare(args: argparse.Namespace) -> int:
    from bench.train_compare import prepare as prepare_plans
    from planner.cli import main as dcp_plan

    rc = prepare_plans(args)
    if rc:
        return rc
    out = Path(args.dir)
    rc = dcp_plan([str(out / "dataset.arrow"), "--dp", "1", "--cp", "1",
                   "--max-tokens-per-rank", "32768", "--global-batch-size", "32",
                   "--long-sequences", "split", "--seed", str(args.seed),
                   "-o", str(out / "single.arrow")])
    if rc:
        return rc
    UPSTREAM.mkdir(exist_ok=True)
    for name in FILES:
        text = subprocess.run(["git", "-C", args.megatron_lm, "show", f"{TAG}:{name}"],
                              check=True, capture_output=True, text=True).stdout
        (UPSTREAM / name).write_text(text)
    if args.no_wheels:
        return 0
    return subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                           "--only-binary=:all:", "--python-version", "3.12", "--platform",
                           "manylinux_2_28_x86_64", "-d", str(out / "wheels"),
                           "megatron-core==0.19.2"]).returncode


def _launcher(src: Path, log: Path, stdout: Path, flags: list[str], *, nproc: int,
              reference: bool = False, timeout: float = 900) -> int | subprocess.Popen[bytes]:
    own = ["--plan", str(src / "single.arrow"), "--dataset", str(src / "dataset.arrow"),
           "--init-seed", str(SEED), "--log-jsonl", str(log)]
    script = str(UPSTREAM / "pretrain_gpt.py")
    log.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_VCS_VERSION="1")
    if reference:  # the fp32 oracle on this machine's CPUs, in the background
        cmd = [sys.executable, "-m", "runtime.adapters.megatron_lm", "--reference", *own,
               "--", script, *flags]
        f = open(stdout, "w")  # noqa: SIM115 - the child owns it until it exits
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(env, CUDA_VISIBLE_DEVICES=""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "runtime.adapters.megatron_lm", *own, "--", script, *flags]
    with open(stdout, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def _rel(got: list[dict[str, float]], want: list[dict[str, float]]) -> float:
    ref = {int(r["step"]): float(r["loss"]) for r in want if "step" in r}
    diffs = [abs(float(r["loss"]) - ref[int(r["step"])]) / abs(ref[int(r["step"])])
             for r in got if "step" in r and int(r["step"]) in ref]
    return max(diffs) if diffs else float("nan")


def _ensure_megatron(src: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("megatron") is not None:
        return
    wheels = sorted(str(p) for p in (src / "wheels").glob("megatron_core-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *wheels], check=True)


def run(args: argparse.Namespace) -> int:
    src = Path(args.dir)
    out = out_dir(args, "out/megatron_lm_gpu_logs")
    _ensure_megatron(src)
    iters = ["--train-iters", str(STEPS)]
    oracle = _launcher(src, out / "oracle.jsonl", out / "oracle.txt",
                       [*MODEL, *CPU, *FEATURES, *iters], nproc=0, reference=True)
    rows: list[dict[str, Any]] = []
    ckpt = Path("/tmp/megatron_lm_ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    runs = {"features": [*MODEL, *GPU, *FEATURES, *iters, "--save", str(ckpt),
                         "--save-interval", "4"],
            "resume": [*MODEL, *GPU, *FEATURES, *iters, "--load", str(ckpt), "--ckpt-step",
                       "4"],
            "constant": [*MODEL, *GPU, *CONSTANT, *iters]}
    for name, flags in runs.items():
        rc = _launcher(src, out / f"{name}.jsonl", out / f"{name}.txt", flags, nproc=1)
        recs = [r for r in read_log(out / f"{name}.jsonl") if "step" in r]
        rows.append({"run": f"launcher {name}", "status": f"rc={rc}", "steps": len(recs),
                     "median_tokens_per_s": median(recs, "tokens_per_s", args.warmup),
                     "losses": [r["loss"] for r in recs]})
        print(f"{name}: rc={rc} steps={len(recs)}", flush=True)
    dcp = ["--framework", "megatron", "--plan", str(src / "single.arrow"), "--dataset",
           str(src / "dataset.arrow"), "--device", "cuda", "--attention", "te", "--dtype",
           "bf16", "--seed", str(SEED), "--steps", str(STEPS), *DCP_TRAIN]
    rc = launch(dcp, 1, out / "dcp_train.jsonl", out / "dcp_train.txt", args.timeout)
    recs = read_log(out / "dcp_train.jsonl")
    rows.append({"run": "dcp-train megatron", "status": f"rc={rc}", "steps": len(recs),
                 "median_tokens_per_s": median(recs, "tokens_per_s", args.warmup),
                 "losses": [r["loss"] for r in recs]})
    try:
        rc_ref = oracle.wait(timeout=args.timeout)  # type: ignore[union-attr]
    except subprocess.TimeoutExpired:
        oracle.kill()  # type: ignore[union-attr]
        rc_ref = 124
    logs = {n: read_log(out / f"{n}.jsonl") for n in (*runs, "oracle", "dcp_train")}
    whole = {int(r["step"]): r for r in logs["features"] if "step" in r}
    summary: dict[str, Any] = {
        "oracle_rc": rc_ref,
        "features_vs_oracle_max_rel_loss": _rel(logs["features"], logs["oracle"]),
        "resume_vs_uninterrupted_max_rel_loss": _rel(logs["resume"], list(whole.values())),
        "constant_vs_dcp_train_max_rel_loss": _rel(logs["constant"], logs["dcp_train"]),
        "launcher_over_dcp_train_tokens_per_s":
            float(rows[2]["median_tokens_per_s"]) / float(rows[3]["median_tokens_per_s"]),
        "rows": rows}
    (out / "megatron_lm_gpu.json").write_text(json.dumps(summary, indent=1))
    print_table(rows, ("run", "status", "steps", "median_tokens_per_s"))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    ok = (all(r["status"] == "rc=0" for r in rows) and rc_ref == 0
          and summary["features_vs_oracle_max_rel_loss"] <= BF16_TOL)
    print(f"Megatron-LM on one GPU: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="dataset, plan, wheel, Megatron-LM's files (CPU)")
    add_prepare_args(pp, DEFAULT_DIR)
    pp.add_argument("--megatron-lm", default="",
                    help="a Megatron-LM git checkout or mirror (git show TAG:FILE)")
    pp.add_argument("--no-wheels", action="store_true", help="skip downloading the wheel")
    pr = sub.add_parser("run", help="the runs (GPU machine)")
    pr.add_argument("--dir", default=str(DEFAULT_DIR), help="what prepare wrote")
    pr.add_argument("--out", default="", help="log directory (default $OUT)")
    pr.add_argument("--warmup", type=int, default=2, help="steps left out of the timings")
    pr.add_argument("--timeout", type=float, default=480, help="seconds per run")
    args = p.parse_args(argv)
    if args.cmd == "prepare" and not args.megatron_lm:
        p.error("prepare needs --megatron-lm (a fetched Megatron-LM repository)")
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
