"""``bench/megatron_gpu.py run --gpus 1 --moe``: a mixture-of-experts model through Megatron's TE
layer spec in bf16 on one GPU against the fp32 CPU oracle (issue 21).

For each load-balancing type of ``--moe-types`` (default ``seq_aux_loss,global_aux_loss``, the
two whose loss does not depend on the packing) the small parity model with ``--num-experts 4
--moe-router-topk 2 --moe-aux-loss-coeff 0.01`` (experts half the dense FFN wide) runs on
``single.arrow`` as a production job does (``--attention te --dtype bf16``, Megatron's DDP and
distributed optimizer, SequentialMLP experts of TE linears, the alltoall dispatcher), while
the oracle of the same flags (fp32, CPU, every segment alone, its own reading of the
load-balancing term) runs beside it. The oracles start first, all at once, sharing the host's
cores; the GPU runs go one after the other.

Per type (``moe.json``): every step's LM loss and load-balancing term (``moe_aux_loss``) on
both sides, their largest relative differences (PASS needs both within the bf16 tolerance), the
share of routing choices that differ (``moe_tokens_per_expert``: bf16 logits break near-ties
otherwise than fp32 ones; reported, not gated) and the GPU's median tokens/s. The ratio of
``global_aux_loss``'s tokens/s to ``seq_aux_loss``'s is the cost of the statistics pass (one
forward-only pass per step) on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from bench.gpu_common import launch, median, read_log

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
TYPES = ("seq_aux_loss", "global_aux_loss")


def max_rel(got: list[dict[str, Any]], want: list[dict[str, Any]], key: str) -> float:
    """The largest relative difference of ``key`` over the steps both logs hold (nan: none)."""
    ref = {int(r["step"]): float(r[key]) for r in want if "step" in r and key in r}
    diffs = [abs(float(r[key]) - ref[int(r["step"])]) / max(abs(ref[int(r["step"])]), 1e-30)
             for r in got if "step" in r and key in r and int(r["step"]) in ref]
    return max(diffs) if diffs else float("nan")


def routing_diff(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> list[float]:
    """Per common step: the share of the step's routing choices whose expert differs (half the
    L1 distance of the per-layer tokens-per-expert counts over the choices)."""
    ref = {int(r["step"]): r["moe_tokens_per_expert"] for r in want
           if "moe_tokens_per_expert" in r}
    out = []
    for r in got:
        step = int(r.get("step", -1))
        if step not in ref or "moe_tokens_per_expert" not in r:
            continue
        moved = sum(abs(a - b) for la, lb in zip(r["moe_tokens_per_expert"], ref[step],
                                                  strict=True)
                    for a, b in zip(la, lb, strict=True))
        total = sum(sum(layer) for layer in ref[step])
        out.append(moved / 2 / max(total, 1))
    return out


def compare(kind: str, gpu: list[dict[str, Any]], ref: list[dict[str, Any]], *, rc: int,
            oracle_rc: int, warmup: int, tol: float) -> dict[str, Any]:
    """One type's row of ``moe.json`` (``ok``: both runs finished, a step compared, the loss
    and the load-balancing term within ``tol``)."""
    steps = sorted({int(r["step"]) for r in gpu} & {int(r["step"]) for r in ref})
    loss, aux = max_rel(gpu, ref, "loss"), max_rel(gpu, ref, "moe_aux_loss")
    return {"type": kind, "rc": rc, "oracle_rc": oracle_rc, "steps_compared": len(steps),
            "max_rel_loss_diff": loss, "max_rel_aux_diff": aux,
            "routing_choices_differing": routing_diff(gpu, ref),
            "losses_gpu": [r["loss"] for r in gpu], "losses_oracle": [r["loss"] for r in ref],
            "aux_gpu": [r.get("moe_aux_loss") for r in gpu],
            "aux_oracle": [r.get("moe_aux_loss") for r in ref],
            "median_tokens_per_s": median(gpu, "tokens_per_s", warmup),
            "ok": rc == 0 and bool(steps) and loss <= tol and aux <= tol}


def moe_argv(src: Path, args: argparse.Namespace, kind: str, *, small: list[str],
             production: list[str]) -> tuple[list[str], list[str]]:
    """``dcp-train``'s arguments for one type: (the GPU run's, the oracle's). Each expert is
    half the dense FFN wide (2 x hidden), so top-2 routing costs what the dense MLP does."""
    hidden = int(small[small.index("--hidden-size") + 1])
    common = ["--framework", "megatron", "--plan", str(src / "single.arrow"), "--dataset",
              str(src / "dataset.arrow"), "--lr", str(args.lr), "--steps", str(args.steps),
              *small, *MOE, "--moe-ffn-hidden-size", str(2 * hidden),
              "--moe-router-load-balancing-type", kind]
    return common + production, common + ["--reference", "--device", "cpu"]


def run_moe(src: Path, out: Path, args: argparse.Namespace, *, small: list[str],
            production: list[str], start_oracle: Any, tol: float) -> int:
    """The MoE parity (module docstring); ``small``: the model flags, ``production``: the GPU
    run's device and Megatron flags, ``start_oracle``: ``megatron_gpu._start_oracle``."""
    kinds = [k for k in args.moe_types.split(",") if k]
    bad = [k for k in kinds if k not in TYPES + ("aux_loss",)]
    if not kinds or bad:
        raise SystemExit(f"--moe-types: load-balancing types of {TYPES + ('aux_loss',)}, got "
                         f"{args.moe_types!r}")
    argv = {k: moe_argv(src, args, k, small=small, production=production) for k in kinds}
    threads = str(max(1, (os.cpu_count() or 2) // (2 * len(kinds))))
    os.environ.setdefault("OMP_NUM_THREADS", threads)  # the oracles share the host's cores
    oracles = {k: start_oracle(argv[k][1], out / f"moe_{k}_ref.jsonl", out / f"moe_{k}_ref.txt")
               for k in kinds}
    rcs = {}
    for k in kinds:
        rcs[k] = launch(argv[k][0] + ["--summary-json", str(out / f"moe_{k}_summary.json")], 1,
                         out / f"moe_{k}_gpu.jsonl", out / f"moe_{k}_gpu.txt", args.timeout)
    rows = []
    for k in kinds:
        try:
            oracle_rc = oracles[k].wait(timeout=max(args.timeout, 1.0))
        except Exception:  # subprocess.TimeoutExpired: what it logged so far still counts
            oracles[k].kill()
            oracle_rc = 124
        rows.append(compare(k, read_log(out / f"moe_{k}_gpu.jsonl"),
                            read_log(out / f"moe_{k}_ref.jsonl"), rc=rcs[k], oracle_rc=oracle_rc,
                            warmup=args.warmup, tol=tol))
    result: dict[str, Any] = {"types": rows}
    rates = {r["type"]: r["median_tokens_per_s"] for r in rows}
    if "seq_aux_loss" in rates and "global_aux_loss" in rates:
        result["global_over_seq_tokens_per_s"] = (float(rates["global_aux_loss"])
                                                  / float(rates["seq_aux_loss"]))
    (out / "moe.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    for r in rows:
        verdict = "PASS" if r["ok"] else "FAIL"
        print(f"MoE {r['type']}: {verdict} (loss {r['max_rel_loss_diff']:.3g},"
              f" aux {r['max_rel_aux_diff']:.3g} over {r['steps_compared']} steps, tolerance "
              f"{tol}; routing choices differing {r['routing_choices_differing']}; "
              f"{r['median_tokens_per_s']:.0f} tokens/s)")
    return 0 if rows and all(r["ok"] for r in rows) else 1
