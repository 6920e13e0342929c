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

from runtime.data.plan_reader import PlanReader
from runtime.train import TrainConfig
from runtime.train.megatron_options import MegatronOptions
from runtime.train.memcheck import heaviest, memory_model, shard_state
from tests.dist import run_distributed
from tests.runtime.adapters.megatron.harness import MODEL, cfg, pool2

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
    found = heaviest(PlanReader(plan), model, range(2))
    assert found is not None
    budget = model.resident_bytes  # 0 available, shared by 2 ranks, plus the weights held
    want = (f"{plan}: step {found.step} microbatch {found.microbatch} (CP group of "
            f"{found.cp_size} at rank {found.rank_start}, longest sequence {found.longest:,} "
            f"padded tokens of sample {found.sample}) needs about "
            f"{found.peak_bytes / 2**30:.2f} GiB per rank, more than "
            f"this host's available memory shared by its 2 rank(s) (0.00 GiB available) "
            f"({budget / 2**30:.2f} GiB)")
    assert ranks[0]["True"] == ranks[1]["True"]
    assert ranks[0]["True"].startswith(want), ranks[0]["True"]
    assert ranks[0]["True"].endswith("or pass --no-memory-check")
    assert ranks[0]["False"] == [0, 1]  # --no-memory-check: both steps ran
