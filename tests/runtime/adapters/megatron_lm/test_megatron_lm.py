"""Megatron-LM's own ``pretrain()`` (megatron-core 0.19.2's wheel) with a plan, on 4 gloo ranks,
against the launcher's one-process oracle (fp32, relative 1e-5 on every step's loss and
gradient norm). Skipped without a supported ``megatron.training`` (``check_megatron_019.sh``
runs them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runtime.data.plan_reader import PlanReader
from tests.runtime.adapters.megatron_lm.launch import (
    assert_same_steps,
    close,
    launch,
    lines,
    make_data,
    need_megatron_training,
    ok,
    reference,
)

pytestmark = [pytest.mark.slow, pytest.mark.dist]

COSINE = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--min-lr", "1e-4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    need_megatron_training()
    return make_data(tmp_path_factory.mktemp("megatron_lm"))


def _cp_sizes_used(plan: Path, steps: int) -> set[int]:
    with PlanReader(plan) as reader:
        return {int(k) for s in range(steps) for k in np.unique(reader.step(s).cp_size)}


def _squares(plan: Path, step: int) -> float:
    with PlanReader(plan) as reader:
        n = np.asarray(reader.step(step).num_tokens, dtype=np.float64)
        return float((n * n).sum())


def _tensorboard(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(directory.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_pool_of_4_with_cp_1_2_4_cosine_full_recompute_eval(data: dict[str, Path],
                                                              tmp_path: Path) -> None:
    """CP groups of 1, 2 and 4 ranks per microbatch; warmup and cosine decay; full uniform
    recomputation; Megatron-LM's evaluate() on the eval plan; TensorBoard; the FLOPs figure
    counts each pack once."""
    assert _cp_sizes_used(data["pool4"], 3) == {1, 2, 4}
    own = ["--eval-plan", str(data["eval_plan"]), "--eval-dataset", str(data["eval_data"])]
    extra = [*COSINE, "--eval-iters", "2", "--eval-interval", "2", "--recompute-granularity",
             "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--tensorboard-dir", str(tmp_path / "tb"), "--log-throughput"]
    flops = tmp_path / "flops.jsonl"
    import os

    os.environ["DCP_PROBE_OUT"] = str(flops)
    try:
        run = launch(4, data["pool4"], data["data"], tmp_path / "run.jsonl", own=own,
                     extra=extra, probe="flops")
    finally:
        del os.environ["DCP_PROBE_OUT"]
    ok(run)
    ref = reference(data["pool4"], data["data"], tmp_path / "ref.jsonl", own=own, extra=extra)
    ok(ref)
    got_steps, got_evals = lines(tmp_path / "run.jsonl")
    want_steps, want_evals = lines(tmp_path / "ref.jsonl")
    assert_same_steps(got_steps, want_steps)
    # Both carry the plan's simulated time of each step beside the measured one.
    from planner import read_plan

    simulated = read_plan(data["pool4"]).summary().column("simulated_s").to_pylist()
    for g, w in zip(got_steps, want_steps, strict=True):
        assert close(g["predicted_s"], simulated[g["step"]], 1e-8), g
        assert g["predicted_s"] == w["predicted_s"]
    # Evaluations after iterations 2 (the interval) and 3 (the end), Megatron-LM's points.
    assert [e["after_step"] for e in got_evals] == [e["after_step"] for e in want_evals] == [1, 2]
    for g, w in zip(got_evals, want_evals, strict=True):
        assert g["eval_tokens"] == w["eval_tokens"]
        assert close(g["eval_loss"], w["eval_loss"]), (g, w)
    board = _tensorboard(tmp_path / "tb", "lm loss")
    assert [s for s, _ in board] == [1, 2, 3]
    for (_, value), line in zip(board, got_steps, strict=True):
        assert close(value, line["loss"], 1e-6), (value, line)  # TensorBoard keeps fp32
    # Megatron-LM computes each iteration's figure twice (its running total, the log line).
    counted = [json.loads(x) for x in flops.read_text().splitlines()]
    per_iteration = [c for i, c in enumerate(counted) if i == 0 or c != counted[i - 1]]
    assert [c["tokens"] for c in per_iteration] == [s["tokens"] for s in got_steps]
    assert [c["squares"] for c in per_iteration] == [_squares(data["pool4"], s)
                                                     for s in range(3)]
    assert "throughput per GPU" in run.stdout + run.stderr


def test_pp2_distributed_optimizer_selective_recompute_save_and_load(
        data: dict[str, Path], tmp_path: Path) -> None:
    """1F1B over pp 2 x pool 2 with the distributed optimizer and overlapped gradient reduce
    and parameter gather; a save at iteration 2 and a --load from it equals the uninterrupted
    run bit for bit; another plan at --load is refused naming both."""
    extra = [*COSINE, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
             "--overlap-grad-reduce", "--overlap-param-gather", "--recompute-granularity",
             "selective"]
    ckpt = tmp_path / "ckpt"
    whole = launch(4, data["pp2"], data["data"], tmp_path / "whole.jsonl",
                   extra=[*extra, "--save", str(ckpt), "--save-interval", "2"])
    ok(whole)
    assert (ckpt / "iter_0000002" / "dcp_plan.json").is_file()
    resumed = launch(4, data["pp2"], data["data"], tmp_path / "resumed.jsonl",
                     extra=[*extra, "--load", str(ckpt), "--ckpt-step", "2"])
    ok(resumed)
    ref = reference(data["pp2"], data["data"], tmp_path / "ref.jsonl", extra=extra)
    ok(ref)
    got, _ = lines(tmp_path / "whole.jsonl")
    assert_same_steps(got, lines(tmp_path / "ref.jsonl")[0])
    after, _ = lines(tmp_path / "resumed.jsonl")
    assert [a["step"] for a in after] == [2]
    assert (after[0]["loss"], after[0]["grad_norm"]) == (got[2]["loss"], got[2]["grad_norm"])
    other = launch(4, data["vpp2"], data["data"], tmp_path / "other.jsonl",
                   extra=[*extra, "--load", str(ckpt), "--ckpt-step", "2",
                          "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "4"])
    assert other.returncode != 0  # each rank exits with status 2 (torchrun then returns 1)
    assert "exitcode  : 2" in other.stderr, other.stderr[-3000:]
    assert "was saved with plan" in other.stderr
    assert str(data["pp2"]) in other.stderr
    assert str(data["vpp2"]) in other.stderr
    assert "]: Traceback" not in other.stderr  # no rank raised (torchrun's own report aside)


def test_vpp2_interleaved(data: dict[str, Path], tmp_path: Path) -> None:
    """The interleaved schedule: pp 2 x 2 virtual stages per rank (4 layers)."""
    extra = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
             "2", "--num-layers", "4"]
    ok(launch(4, data["vpp2"], data["data"], tmp_path / "run.jsonl", extra=extra))
    ok(reference(data["vpp2"], data["data"], tmp_path / "ref.jsonl", extra=extra))
    assert_same_steps(lines(tmp_path / "run.jsonl")[0], lines(tmp_path / "ref.jsonl")[0])


@pytest.mark.parametrize("mutation", ["no-rope-rebinding", "no-recompute-rebinding"])
def test_mutations_are_caught(data: dict[str, Path], tmp_path: Path, mutation: str) -> None:
    """Without the binding (RoPE's group), or without it in the recomputed forward, the run
    fails or leaves the oracle."""
    extra = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
    run = launch(4, data["pool4"], data["data"], tmp_path / "run.jsonl", extra=extra,
                 probe=mutation)
    if run.returncode != 0:
        return
    ok(reference(data["pool4"], data["data"], tmp_path / "ref.jsonl", extra=extra))
    with pytest.raises(AssertionError):
        assert_same_steps(lines(tmp_path / "run.jsonl")[0], lines(tmp_path / "ref.jsonl")[0])


