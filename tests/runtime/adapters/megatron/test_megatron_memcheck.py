"""``dcp-train --framework megatron`` checks the heaviest microbatch against the host before its
first step, as the native engine does (issue 33, item 5): on 2 real gloo ranks whose host budget
is lowered to nothing (each rank's share is then the weights it holds), every rank refuses with
the same message naming the step, the microbatch and both figures, and no step runs; with
``--no-memory-check`` the same run trains."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.train import TrainConfig
from runtime.train.megatron_options import MegatronOptions
from runtime.train.memcheck import memory_model, shard_state
from tests.dist import run_distributed
from tests.runtime.adapters.megatron.harness import MODEL, cfg, pool2
from tests.runtime.memcheck_expect import assert_refused_alike

pytestmark = pytest.mark.dist


def _rank(rank: int, world_size: int, store: str, config: TrainConfig) -> dict[str, Any]:
    del rank, world_size, store
    import runtime.calibrate.memory as host
    from runtime.adapters.megatron import MegatronTrainer

    host.host_available_bytes = lambda: 0  # this process's budget: the weights it holds
    out: dict[str, Any] = {}
    for check in (True, False):
        trainer = MegatronTrainer(replace(config, memory_check=check), MODEL)
        try:
            out[str(check)] = [log.step for log in trainer.run().logs]
        except ValueError as e:
            out[str(check)] = str(e)
        finally:
            trainer.close()
    return out


def test_every_rank_refuses_before_step_0_and_no_memory_check_trains(tmp_path: Path) -> None:
    plan, data = pool2(tmp_path, dp=1, cp=2)
    config = cfg(plan, data, steps=2,
                 megatron=MegatronOptions(use_distributed_optimizer=True))
    ranks = run_distributed(_rank, 2, config, timeout=300)
    # The dense estimate, Adam's moments split over the 2 ranks of the distributed optimizer.
    model = shard_state(memory_model(MODEL, "reference", torch.device("cpu")),
                        weights=1, optimizer=2)
    assert_refused_alike(plan, model, ranks)
