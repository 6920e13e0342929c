"""``dcp-train --framework torchtitan`` and torchtitan's own entry point (the registry's configs)
check the heaviest microbatch against the host before the first step, as the native engine does
(issue 33, item 5): on 2 real gloo ranks whose host budget is lowered to nothing (each rank's
share is then the FSDP shard of the weights it holds), every rank refuses with the same message
naming the step, the microbatch and both figures, and no step runs; with ``--no-memory-check``
the same run trains."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.train.config import TrainConfig
from runtime.train.memcheck import memory_model, shard_state
from runtime.train.model import GPTConfig
from tests.dist import run_distributed
from tests.runtime.memcheck_expect import assert_refused_alike
from tests.runtime.train.test_train_dist import _write_dataset

pytest.importorskip("torchtitan")

pytestmark = pytest.mark.dist

MODEL = GPTConfig(vocab_size=64, num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2)


def _refused_then_trained(build: Callable[[bool], Any]) -> dict[str, Any]:
    """On a rank whose host has no memory: ``build(check)`` with the check on (its refusal)
    and off (the steps it trained), keyed ``"True"`` / ``"False"``."""
    import runtime.calibrate.memory as host

    host.host_available_bytes = lambda: 0  # this process's budget: the weights it holds
    out: dict[str, Any] = {}
    for check in (True, False):
        try:
            trainer = build(check)
        except ValueError as e:
            out[str(check)] = str(e)
            continue
        try:
            trainer.train()
            out[str(check)] = [log.step for log in trainer.logs]
        finally:
            trainer.close()
    return out


def _rank(rank: int, world_size: int, store: str, config: TrainConfig) -> dict[str, Any]:
    del rank, world_size, store
    from runtime.adapters.torchtitan import build_trainer

    return _refused_then_trained(
        lambda check: build_trainer(replace(config, memory_check=check), MODEL))


def _plan(tmp_path: Path) -> tuple[Path, Path]:
    """(plan, dataset): 16 short documents over a pool dp 1 x cp 2."""
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (16,), generator=rng).numpy()
    data = _write_dataset(tmp_path / "data.arrow", lengths)
    made = make_plan(read_lengths(data),
                     PlannerConfig(parallel=ParallelConfig(dp=1, cp=2),
                                   capacity_tokens_per_rank=32, global_batch_size=8, seed=3),
                     load_cost_model("default"))
    return write_plan(tmp_path / "plan.arrow", made.header, made.record_batches()), data


def test_every_rank_refuses_before_step_0_and_no_memory_check_trains(tmp_path: Path) -> None:
    plan, data = _plan(tmp_path)
    config = TrainConfig(plan=str(plan), dataset=str(data), steps=2, seed=7, quiet=True)
    ranks = run_distributed(_rank, 2, config, timeout=300)
    # The llama3's SwiGLU width (8/3 x 64, a multiple of 16); FSDP shards all over 2 ranks.
    model = shard_state(memory_model(replace(MODEL, ffn_hidden_size=176), "reference",
                                     torch.device("cpu")), weights=2, optimizer=2)
    assert_refused_alike(plan, model, ranks)


def _registry_rank(rank: int, world_size: int, store: str, args: list[str]) -> dict[str, Any]:
    del rank, world_size, store
    from torchtitan.config import ConfigManager

    return _refused_then_trained(lambda check: ConfigManager().parse_args(
        [*args, *([] if check else ["--no-memory-check"])]).build())


def test_the_registry_route_refuses_alike_before_step_0(tmp_path: Path) -> None:
    """``torchrun -m torchtitan.train --module runtime.adapters.torchtitan.registry``: the
    trainer that torchtitan's ``main`` builds (``config.build()``) refuses as ``dcp-train`` does,
    for torchtitan's own llama3_debugmodel shape."""
    from torchtitan.config import ConfigManager

    from runtime.adapters.torchtitan.model import memory_shape

    plan, data = _plan(tmp_path)
    args = ["--module", "runtime.adapters.torchtitan.registry", "--config", "llama3_debugmodel",
            "--plan.path", str(plan), "--plan.dataset", str(data), "--training.steps", "2",
            "--seed", "7", "--quiet", "--dump_folder", str(tmp_path / "out")]
    ranks = run_distributed(_registry_rank, 2, args, timeout=300)
    shape = memory_shape(ConfigManager().parse_args(args).model_spec.model)
    assert (shape.ffn_hidden_size, shape.num_layers) == (768, 6)  # torchtitan's debug model
    model = shard_state(memory_model(shape, "reference", torch.device("cpu")), weights=2,
                        optimizer=2)
    assert_refused_alike(plan, model, ranks)
