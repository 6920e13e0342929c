"""torchtitan's own static context parallelism on a plan's global batches: the baseline.

What a torchtitan user runs today for long documents: one fixed ``cp`` mesh dimension
(``context_parallel_degree``), FlexAttention with the packed-document mask built from positions,
torchtitan's load balancer and input sharding (``prepare_context_parallel_input``), stock
``Trainer`` otherwise. To compare on the *same global batches* as a plan, each plan step's
samples (in plan order) are packed first-fit into fixed buffers of ``seq_len`` tokens (one
buffer per microbatch, every rank of a CP group holds the same buffer and torchtitan shards it;
data-parallel ranks take buffers round-robin), positions restart per document and labels are
``IGNORE_INDEX`` at document ends and on padding. The step's buffer count becomes its gradient
accumulation count. Same llama3, same seeded weights (``copy_seeded_weights``) and optimizer as
``dcp-train --framework torchtitan``, so the loss curves are comparable (they differ by the
attention kernel, bf16 rounding and summation order).

Run it like dcp-train (``torchrun --nproc-per-node 2 -m bench.torchtitan_static_cp --plan P
--dataset D --cp 2 ...``); ``bench/torchtitan_gpu.py run --gpus 2`` does, and prints it as the
``titan-cp`` row. ``--inner sdpa`` (causal only, no document mask: plumbing checks on CPU, where
FlexAttention has no backward) or ``flex`` (the real baseline, GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from runtime.adapters.torchtitan.config import trainer_config
from runtime.adapters.torchtitan.titan import (
    IGNORE_INDEX,
    BaseDataLoader,
    FlexAttention,
    ScaledDotProductAttention,
    Trainer,
    gloo_sum_reduction,
    quiet_cpu_dtensor_warnings,
)
from runtime.adapters.torchtitan.trainer import PlanMetrics, copy_seeded_weights
from runtime.data.plan_reader import PlanReader
from runtime.data.tokens import open_token_source
from runtime.train.cli import parse_args
from runtime.train.procgroup import init_process_group
from runtime.train.runlog import StepLog, StepLogger


class PackedLoader(BaseDataLoader):
    """A plan's steps as fixed-length packed buffers (see the module docstring)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        plan: str = ""
        stop: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int,
                 **kwargs: Any) -> None:
        del kwargs
        self.reader = PlanReader(config.plan)
        self.source = open_token_source(config.dataset)
        self.lengths = self.source.lengths()
        self.seq_len, self.stop = seq_len, config.stop
        self.dp, self.dp_rank = dp_world_size, dp_rank
        self.next_step = 0

    def buffers(self, step: int) -> list[list[tuple[int, int, int]]]:
        """The step's segments (sample, offset, tokens) packed first-fit in plan order."""
        plan = self.reader.step(step)
        bins: list[list[tuple[int, int, int]]] = []
        room: list[int] = []
        for s, off, n in zip(plan.sample_index.tolist(), plan.token_offset.tolist(),
                             plan.num_tokens.tolist(), strict=True):
            if s < 0:
                continue
            if n > self.seq_len:
                raise ValueError(f"segment of {n} tokens > seq_len {self.seq_len}")
            i = next((j for j, r in enumerate(room) if r >= n), len(bins))
            if i == len(bins):
                bins.append([])
                room.append(self.seq_len)
            bins[i].append((s, off, n))
            room[i] -= n
        # Every data-parallel rank runs the same number of microbatches: pad with empty buffers.
        while len(bins) % self.dp:
            bins.append([])
        return bins

    def num_microbatches(self, step: int) -> int:
        return len(self.buffers(step)) // self.dp

    def _tensors(self, segments: list[tuple[int, int, int]]) -> tuple[dict[str, Any], torch.Tensor]:
        tokens = np.zeros(self.seq_len, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        positions = np.arange(self.seq_len, dtype=np.int64)  # padding: one more "document"
        at = 0
        for s, off, n in segments:
            extra = 1 if off + n < int(self.lengths[s]) else 0
            read = self.source.read(s, off, n + extra).astype(np.int64)
            tokens[at:at + n] = read[:n]
            labels[at:at + n + extra - 1] = read[1:]
            positions[at:at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(self.seq_len - at)
        return ({"input": torch.from_numpy(tokens)[None],
                 "positions": torch.from_numpy(positions)[None]},
                torch.from_numpy(labels)[None])

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        while self.next_step < self.stop:
            step = self.next_step
            mine = self.buffers(step)[self.dp_rank::self.dp]
            for i, segments in enumerate(mine):
                if i == len(mine) - 1:
                    self.next_step = step + 1
                yield self._tensors(segments)

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_step = int(state_dict.get("next_step", 0))


class StaticCPTrainer(Trainer):
    """torchtitan's stock trainer; only the step's buffer count and the JSON lines are ours."""

    def train_step(self, data_iterator: Iterator[tuple[dict[str, Any], torch.Tensor]]) -> None:
        step = self.step - 1
        self.gradient_accumulation_steps = self.dataloader.num_microbatches(step)
        t0 = time.perf_counter()
        super().train_step(data_iterator)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        plan = self.dataloader.reader.step(step)
        real = plan.sample_index >= 0
        tokens = int(np.asarray(plan.num_tokens)[real].sum())
        self.logs.append(StepLog(step=step, loss=self.metrics_processor.last_loss, tokens=tokens,
                                 loss_tokens=0, microbatches=self.gradient_accumulation_steps,
                                 seconds=time.perf_counter() - t0))
        self.step_logger.write(self.logs[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--cp", type=int, default=2, help="torchtitan's context_parallel_degree")
    p.add_argument("--inner", choices=("flex", "sdpa"), default="flex", help="inner attention")
    own, rest = p.parse_known_args(argv)
    cfg, model_config, _, _ = parse_args(rest)
    created = init_process_group(cfg.device)
    try:
        config = trainer_config(cfg, model_config)
        inner = FlexAttention.Config() if own.inner == "flex" else (
            ScaledDotProductAttention.Config())
        for layer in config.model_spec.model.layers:
            layer.attention.inner_attention = inner
        with PlanReader(cfg.plan) as reader:
            # One buffer holds the largest padded segment of the plan (pool x capacity).
            seq_len = reader.header.parallel.pool_size * reader.header.capacity_tokens_per_rank
            stop = min(cfg.steps, reader.num_steps) if cfg.steps else reader.num_steps
        config = dataclasses.replace(
            config, dataloader=PackedLoader.Config(plan=cfg.plan, dataset=cfg.dataset, stop=stop),
            parallelism=dataclasses.replace(
                config.parallelism, context_parallel_degree=own.cp,
                context_parallel_load_balancer="ptrr" if own.inner == "flex" else "headtail"),
            training=dataclasses.replace(config.training, seq_len=seq_len))
        base = Trainer.Config(**{f.name: getattr(config, f.name)
                                 for f in dataclasses.fields(Trainer.Config)})
        base.metrics = PlanMetrics.Config(log_freq=1)
        with quiet_cpu_dtensor_warnings():
            trainer = StaticCPTrainer(base)
        if dist.get_backend() == "gloo":
            gloo_sum_reduction(trainer.model_parts[0])
        copy_seeded_weights(trainer.model_parts[0], trainer.model_config, cfg.seed)
        trainer.logs = []
        trainer.step_logger = StepLogger(cfg, enabled=dist.get_rank() == 0)
        try:
            trainer.train()
        finally:
            trainer.step_logger.close()
            trainer.close()
    finally:
        if created:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
