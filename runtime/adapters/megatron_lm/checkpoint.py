"""The plan record beside Megatron-LM's own checkpoints (``--save`` / ``--load``).

Megatron-LM restores ``iteration`` and the consumed-sample counts and nothing about the data
(its ``maybe_save_dataloader_state`` writes an iterator's state that nothing reads back). Under
the launcher iteration i runs plan step i, so the position is exact as long as the plan is the
same one: every save writes ``dcp_plan.json`` into the iteration's directory
(``iter_0000002/dcp_plan.json``: the plan's header digest, its dataset fingerprint, its step
count and path), and ``--load`` reads the record of the iteration it is about to load and
refuses another plan, naming both. A checkpoint without a record (saved without the launcher) is
refused too, unless ``--finetune`` (weights only, iteration 0, so plan step 0).
"""

from __future__ import annotations

import json
import os
from typing import Any

from planner.fileguard import write_atomic
from runtime.data.plan_reader import PlanReader
from runtime.train.build import plan_meta

RECORD = "dcp_plan.json"
TRACKER = "latest_checkpointed_iteration.txt"


def record(reader: PlanReader) -> dict[str, Any]:
    """What a checkpoint records of its plan (``runtime.train.build.plan_meta``)."""
    return {**plan_meta(reader), "path": str(reader.path)}


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's directory of one saved iteration (``checkpointing.get_checkpoint_name``
    without the per-rank part)."""
    return os.path.join(root, f"iter_{iteration:07d}")


def write_record(root: str, iteration: int, reader: PlanReader) -> str:
    """Write the plan record of the checkpoint just saved (rank 0, after Megatron-LM's save)."""
    path = os.path.join(iteration_dir(root, iteration), RECORD)
    write_atomic(path, json.dumps(record(reader), sort_keys=True, indent=1) + "\n",
                 kind="plan-record")
    return path


def tracked_iteration(root: str, ckpt_step: int | None = None) -> int | None:
    """The iteration ``--load root`` will restore (``--ckpt-step`` wins), None when there is
    no checkpoint there (Megatron-LM then starts from scratch)."""
    if ckpt_step is not None:
        return ckpt_step
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as f:
        text = f.read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{tracker}: not an iteration number: {text[:40]!r}") from None


def check_load(root: str, reader: PlanReader, *, ckpt_step: int | None = None,
               finetune: bool = False) -> int | None:
    """Refuse a ``--load`` of a checkpoint made with another plan (module docstring); returns
    the iteration it resumes at (None: nothing to load)."""
    iteration = tracked_iteration(root, ckpt_step)
    if iteration is None or finetune:
        return iteration
    path = os.path.join(iteration_dir(root, iteration), RECORD)
    if not os.path.isfile(path):
        raise ValueError(f"--load {root}: iteration {iteration} has no plan record ({path}); "
                         "it was not saved through the plan launcher, so the plan step it "
                         "stopped at is unknown (start from its weights with --finetune)")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.loads(f.read())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable plan record: {e}") from None
    mine = record(reader)
    for key in ("plan", "dataset", "num_steps"):
        if saved.get(key) != mine[key]:
            raise ValueError(f"--load {root}: iteration {iteration} was saved with plan "
                             f"{saved.get('path')} ({key} {saved.get(key)}); this run's plan "
                             f"is {mine['path']} ({key} {mine[key]})")
    return iteration
