"""Train with a dynamic-CP plan and a static CP=2 plan of the same global batches, on 2 GPUs.

Two phases, because the GPU machines have no ortools and no time to spare:

``prepare`` (here, on the CPU machine) writes into DIR (default ``out/train_compare``, ignored by
git; carry it): ``dataset.arrow`` (synthetic token sequences with Wikipedia document lengths and
a learnable next-token rule), ``dynamic.arrow`` (dcp-plan with CP sizes 1 and 2) and
``static.arrow`` (dcp-plan with CP size 2 only), both dp 1 x cp 2, same seed and global batch,
hence the same samples in every step; and ``manifest.json`` with the exact commands.

``run`` (on the 2-GPU machine, one call) launches ``torchrun --nproc-per-node 2 -m runtime.train``
for each plan x attention (te, torch), bf16, an 8-layer hidden-2048 GQA model, writes each run's
JSON lines and stdout under OUT, and prints a table last: median step time and tokens/s over the
steps after ``--warmup``, speed-up over static with the same attention, and the largest per-step
loss difference against the first run (loss parity: same data, same initial weights, so the
curves differ only by bf16 rounding and summation order).

Commands::

    .venv/bin/python bench/train_compare.py prepare            # ~10 s, 10 MB in out/train_compare
    # on the 2-GPU machine, carry ["out/train_compare"] (TE from gpu-wheels, else te is skipped):
    python3 bench/train_compare.py run --out $OUT               # 4 runs x 12 steps
    # check the orchestration here (CPU, gloo, tiny model; ~2 min):
    .venv/bin/python bench/train_compare.py prepare --dir /tmp/tcs --samples 100 \
        --capacity 256 --global-batch-tokens 2048
    .venv/bin/python bench/train_compare.py run --smoke --dir /tmp/tcs --steps 3 --out /tmp/tc

The CPU smoke run gave identical losses (to 1e-7) for the dynamic and the static plan in fp32,
the same check the GPU table makes in bf16.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

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
    te_importable,
)

DEFAULT_DIR = ROOT / "out" / "train_compare"
PLANS = ("dynamic", "static")
ATTENTIONS = ("te", "torch")
MODEL_FLAGS = ["--layers", "8", "--hidden-size", "2048", "--heads", "16", "--query-groups", "4",
               "--ffn-hidden-size", "8192", "--vocab-size", "32000", "--dtype", "bf16"]
# --smoke: the same orchestration on CPU (gloo) with a tiny model, to check the script itself.
SMOKE_FLAGS = ["--layers", "1", "--hidden-size", "32", "--vocab-size", "32000"]


def _synthetic_tokens(lengths: np.ndarray, vocab: int, seed: int) -> list[np.ndarray]:
    """Sequences following t[i+1] = (31 t[i] + 7 + noise) mod vocab, noise in 0..3."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths.tolist():
        t = np.empty(n, dtype=np.int64)
        t[0] = rng.integers(vocab)
        noise = rng.integers(0, 4, size=n)
        for i in range(1, n):  # short loop per sample; prepare runs once
            t[i] = (31 * t[i - 1] + 7 + noise[i]) % vocab
        out.append(t.astype(np.int32))
    return out


def prepare(args: argparse.Namespace) -> int:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from bench.workloads import all_long, wikipedia
    from planner.cli import main as dcp_plan

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    pool, cap = 2, args.capacity
    if args.workload == "all-long":
        # The guard: 90% of tokens in sequences that need the whole pool (CP 2 here).
        lengths = all_long(args.num_tokens, pool, cap, seed=args.seed)
    else:
        lengths = wikipedia(args.samples, seed=args.seed)
    lengths = np.clip(lengths, 2, pool * cap)  # every sample fits the pool of 2
    seqs = _synthetic_tokens(lengths, 32000, args.seed)
    data = out / "dataset.arrow"
    table = pa.table({"input_ids": pa.array(seqs, type=pa.list_(pa.int32()))})
    with pa.OSFile(str(data), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=1024)
    common = [str(data), "--dp", "1", "--cp", "2", "--max-tokens-per-rank", str(cap),
              "--global-batch-tokens", str(args.global_batch_tokens), "--seed", str(args.seed),
              "--cost-model", args.cost_model]
    commands = {
        "dynamic": common + ["--cp-sizes", "1,2", "-o", str(out / "dynamic.arrow")],
        "static": common + ["--cp-sizes", "2", "-o", str(out / "static.arrow")],
    }
    for argv in commands.values():
        rc = dcp_plan(argv)
        if rc:
            return rc
    stats = {"n": int(lengths.size), "tokens": int(lengths.sum()),
             "median": int(np.median(lengths)), "max": int(lengths.max())}
    manifest = {"workload": args.workload, "lengths": stats, "capacity": cap,
                "plans": {k: "dcp-plan " + " ".join(v) for k, v in commands.items()}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest, indent=1))
    return 0


def _one_run(plan: Path, data: Path, attention: str, log: Path, stdout: Path,
             steps: int, timeout: float, smoke: bool, lr: float) -> tuple[int, float]:
    device, model = ("cpu", SMOKE_FLAGS) if smoke else ("cuda", MODEL_FLAGS)
    argv = ["--plan", str(plan), "--dataset", str(data), "--device", device, "--attention",
            attention, "--steps", str(steps), "--lr", str(lr), *model]
    t0 = time.perf_counter()
    rc = launch(argv, 2, log, stdout, timeout)
    return rc, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    src = Path(args.dir)
    out = out_dir(args, "out/train_compare_logs")
    data = src / "dataset.arrow"
    attentions = [a for a in args.attention.split(",") if a]
    if args.smoke:
        attentions = ["reference"]
    if "te" in attentions and not te_importable():
        print("Transformer Engine not importable: skipping the te runs", flush=True)
        attentions.remove("te")
    logs: dict[tuple[str, str], list[dict[str, float]]] = {}
    status: dict[tuple[str, str], str] = {}
    for attention in attentions:
        for plan in PLANS:
            name = f"{plan}_{attention}"
            log = out / f"{name}.jsonl"
            rc, wall = _one_run(src / f"{plan}.arrow", data, attention, log, out / f"{name}.txt",
                                args.steps, args.timeout, args.smoke, args.lr)
            logs[(plan, attention)] = read_log(log)
            status[(plan, attention)] = "ok" if rc == 0 else f"rc={rc}"
            print(f"{name}: rc={rc} wall={wall:.1f}s steps={len(logs[(plan, attention)])}",
                  flush=True)
    if (src / "manifest.json").is_file():
        shutil.copy(src / "manifest.json", out / "manifest.json")
    rows = _table(logs, status, args.warmup)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print_table(rows, ("plan", "attention", "status", "steps", "microbatches", "median_step_s",
                       "median_tokens_per_s", "speedup_vs_static", "final_loss",
                       "max_loss_diff"))
    return 0 if all(s == "ok" for s in status.values()) else 1


def _table(logs: dict[tuple[str, str], list[dict[str, float]]], status: dict[tuple[str, str], str],
           warmup: int) -> list[dict[str, object]]:
    first = next((v for v in logs.values() if v), [])
    base_loss = {int(r["step"]): float(r["loss"]) for r in first}
    rows: list[dict[str, object]] = []
    for (plan, attention), recs in logs.items():
        sec, tps = median(recs, "seconds", warmup), median(recs, "tokens_per_s", warmup)
        diffs = [abs(float(r["loss"]) - base_loss[int(r["step"])]) for r in recs
                 if int(r["step"]) in base_loss]
        rows.append({"plan": plan, "attention": attention, "status": status[(plan, attention)],
                     "steps": len(recs), "median_step_s": sec, "median_tokens_per_s": tps,
                     "microbatches": statistics.mean(int(r["microbatches"]) for r in recs)
                     if recs else 0,
                     "final_loss": float(recs[-1]["loss"]) if recs else float("nan"),
                     "max_loss_diff": max(diffs) if diffs else float("nan")})
    for r in rows:
        static = next((s for s in rows if s["plan"] == "static"
                       and s["attention"] == r["attention"]), None)
        mine, theirs = r["median_step_s"], static["median_step_s"] if static else None
        r["speedup_vs_static"] = (theirs / mine if isinstance(mine, float) and mine > 0
                                  and isinstance(theirs, float) else float("nan"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="make the dataset and both plans (CPU machine)")
    add_prepare_args(pp, DEFAULT_DIR)
    pr = sub.add_parser("run", help="train every plan x attention (2-GPU machine)")
    add_run_args(pr, DEFAULT_DIR, steps=12, timeout=240.0)
    pr.add_argument("--attention", default=",".join(ATTENTIONS), help="te,torch")
    args = p.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
