"""Megatron-core runs of a plan on real gloo ranks equal the one-process Megatron oracle.

Each run uses the real megatron-core package through ``dcp-train --framework megatron``'s
``MegatronTrainer``: Megatron's ``DistributedDataParallel`` (fp32 ``main_grad`` buffers,
buckets, overlapped reductions), its optimizers (``FP32Optimizer`` or the
``DistributedOptimizer``) and schedules. The oracle (``train_reference``) runs the same Megatron
model with every sample segment alone, no CP, plain autograd and plain AdamW. fp32, relative
1e-5: per-step losses and gradient norms over 3 steps, every parameter's reduced gradient
(``main_grad``, assembled from the ranks' shards) at step 0, and the final parameters. The
gradient check is what catches a constant scale error (``test_a_gradient_scale_error_is_
caught``): Adam's update hides it from the parameters and the loss does not see it at all.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.data.plan_reader import PlanReader
from runtime.train import TrainConfig
from runtime.train.megatron_options import MegatronOptions
from runtime.train.model import GPTConfig
from tests.dist import run_distributed
from tests.runtime.adapters.megatron.harness import (
    MODEL,
    STEPS,
    assert_same_grads,
    assert_same_losses,
    assert_same_params,
    cfg,
    cp_sizes,
    eval_set,
    lengths,
    oracle,
    plan,
    pool2,
    pool4,
    train_rank,
    train_rank_megatron_groups,
    unshard,
    write_dataset,
)

pytestmark = pytest.mark.dist

OVERLAPPED = MegatronOptions(use_distributed_optimizer=True, overlap_grad_reduce=True,
                             overlap_param_gather=True, ddp_bucket_size=3000, clip_grad=0.5)
"""Megatron's production settings, with buckets small enough that the model has several."""


def _check(config: TrainConfig, world: int, model: GPTConfig = MODEL) -> list[dict[str, Any]]:
    ranks = run_distributed(train_rank, world, config, model, timeout=300)
    ref = oracle(config, model)
    assert_same_losses(ranks[0]["logs"], ref.logs)
    assert_same_grads(unshard(ranks, "grads"), ref.grads)
    assert_same_params(unshard(ranks), ref.state)
    if config.eval_plan:  # evaluations through the forward-only schedule, on every rank
        want_at = [k - 1 for k in range(1, STEPS + 1)
                   if k == STEPS or (config.eval_interval and k % config.eval_interval == 0)]
        assert [e.after_step for e in ref.evals] == want_at
        for r in ranks:
            assert [e.after_step for e in r["evals"]] == want_at
            for g, w in zip(r["evals"], ref.evals, strict=True):
                assert g.eval_tokens == w.eval_tokens > 0
                assert g.eval_microbatches > 0
                assert abs(g.eval_loss - w.eval_loss) <= 1e-5 * abs(w.eval_loss), (g, w)
    return ranks


def _cli_oracle(rank: int, world_size: int, store: str, argv: list[str]) -> int:
    del rank, world_size, store
    from runtime.train.cli import main

    return main(argv)


def test_dp2_cp2_with_cp_1_2_4(tmp_path: Path) -> None:
    p, data = pool4(tmp_path)
    log = tmp_path / "megatron.jsonl"
    ev = eval_set(tmp_path, dp=2, cp=2)
    assert cp_sizes(Path(ev["eval_plan"]), 1) == {1, 2, 4}
    ranks = _check(cfg(p, data, log_jsonl=str(log), eval_interval=2, **ev), 4)
    assert ranks[0]["summary"]["grad_sync"] == "megatron-ddp"
    assert ranks[0]["summary"]["optimizer"] == "megatron"
    # The CLI's oracle writes the same JSON lines as the distributed run (and the native run).
    ref_log = tmp_path / "oracle.jsonl"
    argv = ["--plan", str(p), "--dataset", str(data), "--steps", str(STEPS), "--seed", "7",
            "--lr", "3e-3", "--quiet", "--framework", "megatron", "--reference",
            "--log-jsonl", str(ref_log), "--vocab-size", "64", "--hidden-size", "32",
            "--heads", "4", "--query-groups", "2", "--layers", "2"]
    assert run_distributed(_cli_oracle, 1, argv, backend=None, timeout=300) == [0]
    got = [json.loads(x) for x in log.read_text().splitlines() if '"step"' in x]
    want = [json.loads(x) for x in ref_log.read_text().splitlines()]
    assert [g.keys() for g in got] == [w.keys() for w in want]
    assert {"step", "loss", "tokens", "loss_tokens", "microbatches", "seconds",
            "predicted_s", "tokens_per_s", "grad_norm"} == set(got[0])
    for g, w in zip(got, want, strict=True):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"])
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-5 * abs(w["grad_norm"])
        assert g["microbatches"] >= 1


def test_dp2_cp2_distributed_optimizer_overlapped(tmp_path: Path) -> None:
    # Reduce-scattered buckets during the last backward, parameters all-gathered during the
    # next forward, the global norm clipped, weight decay by Megatron's groups (not on norms).
    p, data = pool4(tmp_path)
    ranks = _check(cfg(p, data, weight_decay=0.1, megatron=OVERLAPPED), 4)
    assert ranks[0]["summary"]["optimizer"] == "megatron-distributed"
    assert any(log.grad_norm > 0.5 for log in ranks[0]["logs"])  # clipping took effect


def test_pool6_dp3_cp2_distributed_optimizer(tmp_path: Path) -> None:
    # A pool that is not a power of two: groups of 1, 2 and all 6 ranks, every bucket
    # reduce-scattered over 6.
    data = write_dataset(tmp_path / "data.arrow", lengths(short=40, medium=10, long=6),
                         MODEL.vocab_size)
    p = plan(tmp_path / "plan.arrow", data, capacity=32, batch=18, dp=3, cp=2)
    assert cp_sizes(p) >= {1, 2, 6}
    _check(cfg(p, data, megatron=OVERLAPPED), 6)


def test_pp2_pool2_through_1f1b_distributed_optimizer(tmp_path: Path) -> None:
    p, data = pool2(tmp_path, dp=1, cp=2, pp=2)
    ev = eval_set(tmp_path, dp=1, cp=2, pp=2, long=0)
    _check(cfg(p, data, megatron=MegatronOptions(use_distributed_optimizer=True,
                                                 overlap_grad_reduce=True), **ev), 4)


def test_tp2_sequence_parallel_pool2(tmp_path: Path) -> None:
    p, data = pool2(tmp_path, dp=1, cp=2, tp=2, sequence_parallel=True)
    _check(cfg(p, data, megatron=MegatronOptions(overlap_grad_reduce=True)), 4)


def test_pool_grad_sync_baseline(tmp_path: Path) -> None:
    # --grad-sync pool (PoolGradSync + AdamW), the baseline the GPU benchmark compares.
    p, data = pool2(tmp_path, dp=1, cp=2)
    ranks = _check(cfg(p, data, megatron=MegatronOptions(grad_sync="pool")), 2)
    assert ranks[0]["summary"]["grad_sync"] == "pool"


@pytest.mark.slow
def test_vpp2_pp2_interleaved(tmp_path: Path) -> None:
    model = replace(MODEL, num_layers=4)
    p, data = pool2(tmp_path, dp=1, cp=2, pp=2, vpp=2)
    reader = PlanReader(p)
    counts = [reader.step(i).num_microbatches for i in range(STEPS)]
    assert all(m % 2 == 0 for m in counts), counts  # microbatch_group_size = pp
    _check(cfg(p, data, megatron=MegatronOptions(overlap_grad_reduce=True)), 4, model)


def test_megatron_parallel_state_groups_equal_created_groups(tmp_path: Path) -> None:
    # A caller that initialised Megatron's parallel_state (hybrid DP x CP groups) keeps its
    # groups: the catalog wraps them and the run equals the one with groups created here.
    p, data = pool4(tmp_path)
    config = cfg(p, data)
    mine = run_distributed(train_rank_megatron_groups, 4, config, MODEL, timeout=300)
    theirs = run_distributed(train_rank, 4, config, MODEL, timeout=300)
    assert [g.loss for g in mine[0]["logs"]] == [g.loss for g in theirs[0]["logs"]]
    for name, t in theirs[0]["state"].items():
        assert torch.equal(mine[0]["state"][name], t), name


def _scaled_loss_rank(rank: int, world_size: int, store: str, config: TrainConfig,
                      model: GPTConfig) -> dict[str, Any]:
    """A copy of the run whose backward starts from 1.01 x the loss (the logged loss is not
    scaled): a gradient-scale bug such as a wrong token count."""
    import runtime.adapters.megatron.binding.forward as job

    original = job.loss_func

    def scaled(*args: Any) -> Any:
        loss_sum, num_tokens, report = original(*args)
        return loss_sum * 1.01, num_tokens, report

    job.loss_func = scaled
    return train_rank(rank, world_size, store, config, model)


def test_a_gradient_scale_error_is_caught(tmp_path: Path) -> None:
    p, data = pool2(tmp_path, dp=1, cp=2)
    config = cfg(p, data)
    ranks = run_distributed(_scaled_loss_rank, 2, config, MODEL, timeout=300)
    ref = oracle(config, MODEL)
    got, want = ranks[0]["logs"][0], ref.logs[0]
    assert abs(got.loss - want.loss) <= 1e-5 * want.loss  # the loss cannot see it
    with pytest.raises(AssertionError):  # each parameter's gradient does
        assert_same_grads(unshard(ranks, "grads"), ref.grads)
    with pytest.raises(AssertionError):  # and so does the norm Megatron's optimizer reports
        assert_same_losses(ranks[0]["logs"], ref.logs)
