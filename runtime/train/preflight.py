"""What every engine checks before its first step (native, its oracle, Megatron, torchtitan):
the run's outputs are safe to write, its plan is a training plan, a resumed run has steps left
(and says where it continues from: ``announce_resume``).

``check_outputs`` runs in ``dcp-train`` before the process group exists (every rank alike); the
``--save`` entries are ``checkpoint.check_save_target``'s, once the first step is known.
"""

from __future__ import annotations

import os
import sys

from planner.fileguard import check_directory, check_output
from runtime.train.config import TrainConfig


def run_inputs(cfg: TrainConfig) -> list[str]:
    """Every file a run reads: its plans and their datasets' files (directories and globs
    expanded, both files of a Megatron pair); an output may be none of them."""
    from planner.cli.guard import input_files
    from planner.sources.dataset import expand_paths
    from planner.sources.lengths import DATASET_SUFFIXES

    files = [cfg.plan] + ([cfg.eval_plan] if cfg.eval_plan else [])
    for items in (cfg.dataset_paths, (cfg.eval_dataset,) if cfg.eval_dataset else ()):
        try:
            expanded = [f for f, _ in expand_paths(list(items), DATASET_SUFFIXES)]
        except ValueError:
            expanded = list(items)  # the run reports a missing dataset itself
        files += input_files(expanded, "")
    return files


def check_outputs(cfg: TrainConfig) -> None:
    """``--summary-json`` and ``--log-jsonl``, checked before any work (every engine): not an
    input, not each other, not a special file, and an existing file only of their own kind (a
    log appends only to an empty file or a log of this tool: ``planner.fileguard``). ``--save``
    must be a directory that can be written here; its entries are checked by
    ``checkpoint.check_save_target`` once the process group exists and the first step is
    known."""
    inputs = run_inputs(cfg)
    if cfg.save:
        check_directory(cfg.save, inputs=inputs, flag="--save")
    if cfg.log_jsonl:
        check_output(cfg.log_jsonl, kind="log", inputs=inputs, flag="--log-jsonl")
    if cfg.summary_json:
        check_output(cfg.summary_json, kind="summary", inputs=inputs,
                     others={"--log-jsonl": cfg.log_jsonl}, flag="--summary-json")


def require_training_plan(kind: str, path: str) -> None:
    """Refuse an evaluation plan (header ``kind``) as the plan to train: it is one pass in file
    order, planned with the forward-only cost."""
    if kind != "train":
        raise ValueError(f"{path}: is an evaluation plan (dcp-plan --eval, kind {kind!r}), not "
                         "a training plan; train with a plan made without --eval and give this "
                         "one as --eval-plan")


def announce_resume(checkpoint: str | os.PathLike[str], step: int) -> None:
    """The one line a resumed run prints (rank 0, stderr): which checkpoint, which step next.

    Every engine words it alike: ``dcp-train: resuming from ckpt/step-00000002 at step 2``.
    """
    print(f"dcp-train: resuming from {os.fspath(checkpoint)} at step {step}", file=sys.stderr,
          flush=True)


def check_resume_step(cfg: TrainConfig, start: int, num_steps: int, *,
                      notice: bool = True) -> bool:
    """Whether a run resumed at step ``start`` has steps left; a checkpoint past the run's end
    is an error, one at its end a notice (nothing to do, exit 0).

    Raises:
        ValueError: ``start`` lies past ``--steps`` or past the plan's last step.
    """
    stop = min(cfg.steps, num_steps) if cfg.steps else num_steps
    what = f"--steps {cfg.steps}" if cfg.steps and cfg.steps <= num_steps else \
        f"the plan's {num_steps} steps"
    if start > stop:
        raise ValueError(f"--resume {cfg.resume}: the checkpoint continues at step {start}, past "
                         f"the end of this run ({what} end before step {stop}); raise --steps "
                         "or resume from an earlier checkpoint")
    if start == stop:
        if notice:
            print(f"dcp-train: notice: --resume {cfg.resume} continues at step {start}, where "
                  f"this run ends ({what}): nothing left to train", file=sys.stderr, flush=True)
        return False
    return True
