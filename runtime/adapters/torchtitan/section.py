"""The ``plan`` section of a torchtitan job config: the fields a plan replaces, and the flags
that would contradict it.

``torchrun -m torchtitan.train --module runtime.adapters.torchtitan.registry --config NAME
--plan.path PLAN --plan.dataset DATA`` parses torchtitan's own config (every tyro override as
usual) and then ``PlanTrainer.Config.__post_init__`` calls :func:`apply_plan`, which fills in
what the plan fixes and refuses a flag that says otherwise, naming both values:

- ``training.seq_len``: the longest padded segment the plan can hold (pool x capacity), so
  RoPE covers every position (the registry's ``-1`` = from the plan);
- ``training.local_batch_size`` 1 (one packed buffer per microbatch) and
  ``training.global_batch_size`` -1 (the plan's step decides its microbatch count);
- ``training.steps``: the plan's length when ``-1``; more steps than the plan holds are refused;
- ``parallelism``: data parallel over the plan's whole pool (replicate x shard = pool), no
  torchtitan context / tensor / pipeline / expert parallelism (the plan's CP groups replace
  its fixed "cp" mesh dimension);
- ``dataloader`` / ``tokenizer``: the plan's microbatches of a pre-tokenized dataset; for a plan
  of text, its records tokenized with the plan's tokenizer, read from ``--plan.tokenizer`` or
  torchtitan's own ``hf_assets_path`` when that holds the plan's ``tokenizer.json`` (another
  ``tokenizer.json`` there is refused);
- ``validator``: an eval plan (``--plan.eval_path``) through torchtitan's validation hook, every
  ``validator.freq`` steps and after the last, its first ``validator.steps`` steps (-1: all).

The refusals are ``ValueError``s naming the flag, its value and the plan's; raised while tyro
builds the config, they are shown as tyro's usage error (exit status 2), not a traceback, as
torchtitan's own config checks are. The function is idempotent (torchtitan rebuilds configs
with ``dataclasses.replace``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from planner.sources.textenc import tokenizer_file
from runtime.adapters.torchtitan.data import PlanDataLoader, PlanTokenizer
from runtime.adapters.torchtitan.validate import PlanValidator
from runtime.data.plan_reader import PlanReader

FROM_PLAN = -1
"""``training.seq_len`` / ``training.steps`` value meaning "the plan's"."""

_T = TypeVar("_T")


@dataclass(kw_only=True, slots=True)
class PlanSection:
    """``--plan.*``: the plan a torchtitan job replays (empty ``path``: no plan)."""

    path: str = ""
    """Plan file made by ``dcp-plan`` (replaces the data loader, the batch sizes, seq_len and
    the data-parallel degree)."""
    dataset: str = ""
    """The pre-tokenized dataset the plan was made for (replaces dataloader.dataset and the
    tokenizer)."""
    field: str | None = None
    """Record field or column of its tokens; None: the one the plan was made with."""
    eval_path: str = ""
    """Eval plan (``dcp-plan --eval``): replaces torchtitan's validation data; evaluated every
    ``validator.freq`` steps and after the last."""
    eval_dataset: str = ""
    """The eval plan's dataset; empty: ``dataset``."""
    tokenizer: str = ""
    """A text plan's ``tokenizer.json`` (or its folder) where it is not at the recorded path
    (same sha256); empty: torchtitan's ``hf_assets_path`` when it holds the plan's
    ``tokenizer.json``, else the recorded path."""


def max_seq_len(reader: PlanReader) -> int:
    """Longest padded segment the plan can hold: a group of the whole pool at capacity."""
    return reader.header.parallel.pool_size * reader.header.capacity_tokens_per_rank


def recast(cls: type[_T], config: Any) -> _T:
    """``config``'s field values in ``cls`` (a subclass of its config class)."""
    if isinstance(config, cls):
        return config
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return cls(**values)


def _refuse(flag: str, value: object, why: str) -> ValueError:
    return ValueError(f"--{flag} {value}: {why}")


def _check_parallelism(parallelism: Any, pool: int, path: str) -> None:
    for name in ("context_parallel_degree", "tensor_parallel_degree",
                 "pipeline_parallel_degree", "expert_parallel_degree"):
        value = getattr(parallelism, name, 1)
        if value != 1:
            what = ("the plan's CP groups replace torchtitan's fixed cp dimension"
                    if name == "context_parallel_degree"
                    else "the torchtitan adapter runs the plan's dp x cp pool only")
            raise _refuse(f"parallelism.{name}", value, f"{what}; {path} needs 1")
    replicate = parallelism.data_parallel_replicate_degree
    shard = parallelism.data_parallel_shard_degree
    if shard == -1:
        if pool % replicate:
            raise _refuse("parallelism.data_parallel_replicate_degree", replicate,
                          f"does not divide the plan's pool of {pool} ranks ({path})")
        return
    if replicate * shard != pool:
        raise ValueError(
            f"--parallelism.data_parallel_shard_degree {shard} x data_parallel_replicate_degree"
            f" {replicate} = {replicate * shard} ranks, but {path} is planned for a pool of "
            f"{pool} ranks: use -1 (every pool rank a data-parallel replica)")


def _check_training(training: Any, seq_len: int, num_steps: int, path: str) -> None:
    if training.local_batch_size != 1:
        raise _refuse("training.local_batch_size", training.local_batch_size,
                      f"under a plan a microbatch is one packed buffer (1); {path} sets its "
                      "tokens per rank")
    if training.global_batch_size != -1:
        raise _refuse("training.global_batch_size", training.global_batch_size,
                      f"under a plan each step's samples and microbatches come from {path} "
                      "(-1)")
    if training.seq_len == FROM_PLAN:
        training.seq_len = seq_len
    elif training.seq_len != seq_len:
        raise _refuse("training.seq_len", training.seq_len,
                      f"{path} packs segments up to {seq_len} tokens (pool x capacity), which "
                      f"RoPE must cover: leave it out (the plan's {seq_len})")
    if training.steps == FROM_PLAN:
        training.steps = num_steps
    elif not 0 < training.steps <= num_steps:
        raise _refuse("training.steps", training.steps,
                      f"{path} holds {num_steps} steps (leave it out for all of them)")


def _text_tokenizer(config: Any, section: PlanSection, recorded: dict[str, Any]) -> str | None:
    """Where a text plan's tokenizer is read from: ``--plan.tokenizer``, else torchtitan's
    ``hf_assets_path`` when it holds a ``tokenizer.json`` (it must be the plan's), else None."""
    if section.tokenizer:
        return section.tokenizer
    assets = str(getattr(config, "hf_assets_path", "") or "")
    if not assets or not (Path(assets).is_file() or (Path(assets) / "tokenizer.json").is_file()):
        return None
    f = tokenizer_file(assets)
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    if digest != recorded.get("sha256"):
        raise _refuse("hf_assets_path", assets,
                      f"holds another tokenizer.json (sha256 {digest[:12]}) than the one "
                      f"{section.path} was made with, {recorded.get('path')} (sha256 "
                      f"{str(recorded.get('sha256'))[:12]})")
    return str(f)


def _data(config: Any, section: PlanSection, recorded: dict[str, Any]) -> None:
    loader = recast(PlanDataLoader.Config, config.dataloader)
    for name, value in (("plan", section.path), ("dataset", section.dataset),
                        ("field", section.field)):
        current = getattr(loader, name)
        if value and current and current != value:
            raise _refuse(f"dataloader.{name}", current,
                          f"contradicts --plan.{'path' if name == 'plan' else name} {value}")
        setattr(loader, name, current or value)
    if not loader.dataset and not loader.datasets:
        raise ValueError(f"--plan.path {section.path}: --plan.dataset DATA is required (the "
                         "pre-tokenized dataset the plan was made for)")
    if recorded:
        loader.tokenizer_path = loader.tokenizer_path or _text_tokenizer(config, section,
                                                                         recorded)
    config.dataloader = loader
    config.tokenizer = recast(PlanTokenizer.Config, config.tokenizer)


def _validator(config: Any, section: PlanSection) -> None:
    validator = recast(PlanValidator.Config, config.validator)
    if not section.eval_path:
        if validator.enable and not validator.plan:
            raise _refuse("validator.enable", True,
                          "under a plan validation needs --plan.eval_path (an eval plan)")
        config.validator = validator
        return
    validator.enable = True
    validator.plan = section.eval_path
    validator.dataset = section.eval_dataset or section.dataset
    validator.interval = validator.freq
    validator.max_steps = max(validator.steps, 0)
    validator.last_step = config.training.steps
    config.validator = validator


def apply_plan(config: Any) -> None:
    """Fill ``config`` (a ``PlanTrainer.Config``) from ``config.plan``; ValueError on a flag
    that contradicts it (see the module docstring)."""
    section: PlanSection = config.plan
    try:
        with PlanReader(section.path) as reader:
            seq_len, num_steps = max_seq_len(reader), reader.num_steps
            pool = reader.header.parallel.pool_size
            recorded = dict(reader.header.dataset.tokenizer)
    except (OSError, ValueError) as e:
        raise ValueError(f"--plan.path {section.path}: {e}") from None
    _check_parallelism(config.parallelism, pool, section.path)
    _check_training(config.training, seq_len, num_steps, section.path)
    _data(config, section, recorded)
    _validator(config, section)
