"""What every engine's memory refusal says, built from the same estimate the ranks make, and the
check that the ranks said it alike (the adapters' memory tests share it)."""

from __future__ import annotations

from pathlib import Path

from planner.memory import MemoryModel
from runtime.data.plan_reader import PlanReader
from runtime.train.memcheck import heaviest


def assert_refused_alike(plan: Path, model: MemoryModel, ranks: list[dict[str, object]],
                         steps: range = range(2)) -> None:
    """Both ranks' refusal (under key ``"True"``: the memory check on, 0 bytes available
    shared by 2 ranks) is the one ``model`` predicts for the heaviest microbatch of ``steps``,
    and ``--no-memory-check`` (key ``"False"``) ran both steps."""
    found = heaviest(PlanReader(plan), model, steps)
    assert found is not None
    budget = model.resident_bytes  # 0 available, shared by 2 ranks, plus the weights held
    want = (f"{plan}: step {found.step} microbatch {found.microbatch} (CP group of "
            f"{found.cp_size} at rank {found.rank_start}, longest sequence {found.longest:,} "
            f"padded tokens of sample {found.sample}) needs about "
            f"{found.peak_bytes / 2**30:.2f} GiB per rank, more than "
            f"this host's available memory shared by its 2 rank(s) (0.00 GiB available) "
            f"({budget / 2**30:.2f} GiB)")
    said = ranks[0]["True"]
    assert isinstance(said, str)
    assert said == ranks[1]["True"]
    assert said.startswith(want), said
    assert said.endswith("or pass --no-memory-check")
    assert ranks[0]["False"] == [0, 1]  # --no-memory-check: both steps ran
