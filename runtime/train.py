"""``dcp-train``: train a small GPT by replaying a plan, or run the single-process reference.

Launch: ``torchrun --nproc-per-node N -m runtime.train --plan P --dataset D`` (gloo on CPU, NCCL
on CUDA), or one plain process for a plan whose pool is 1 and for ``--reference``. The parallel
layout comes from the plan header; the live job is only checked against it.

One step (``Trainer.step``):

1. ``Replayer.microbatches(step)``: this rank's packed shard of every microbatch, with its CP
   group (every rank runs the same number of microbatches, in order).
2. Per microbatch: forward on the local shard with the attention bound to that microbatch's
   group, ``per_token_loss`` -> (sum of token losses, token count), ``backward`` of the *sum*.
   Ranks of one CP group hold different tokens of the same sequences; the attention's all-gather
   of K/V has a reduce-scatter backward that routes every K/V gradient back to its owner, so the
   group's ranks together accumulate the gradient of the group's summed loss.
3. All-reduce (sum) the token count and every gradient over the pool, divide the gradients by
   the global count, AdamW step. dp and cp are merged into one pool of replicated parameters, so
   this single all-reduce over the pool group is the whole data-parallel reduction: the sum over
   all ranks of d(loss sum)/d(params) is the gradient of the step's summed loss, and dividing by
   the global token count gives exactly the gradient of the per-token mean loss, whatever CP
   sizes the step used.

``--reference`` runs the oracle (``runtime.oracle``): one process, no CP, no packing, every
sample segment of a step as its own sequence, same initial weights. In fp32 the replayed run
matches it to float rounding, losses, gradients and weights (tests/runtime/test_train_dist.py).
Attention backends (reference, torch, te) live in ``runtime.backends``; the model in
``runtime.model``; checkpoints in ``runtime.checkpoint``.

``--steps K`` is the absolute step to stop before (the run executes steps [start, K), start = 0
or the resumed step), so a resumed run with the same ``--steps`` ends where the uninterrupted
one does. One JSON line per step (rank 0): step, loss, tokens (real tokens of the step), loss
tokens, microbatches, seconds, tokens_per_s.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.distributed as dist

from runtime import checkpoint
from runtime.backends import ATTENTIONS, make_backend
from runtime.batch import to_device
from runtime.groups import GroupCatalog
from runtime.loss import per_token_loss
from runtime.model import (
    GPT,
    GPTConfig,
    add_model_arguments,
    check_token_ids,
    model_config_from_args,
)
from runtime.plan_reader import PlanReader
from runtime.replay import Microbatch, Replayer
from runtime.tokens import TokenSource, open_token_source
from runtime.topology import Topology

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything a training run needs besides the model shape."""

    plan: str
    """Path of the plan file."""
    dataset: str
    """Path of the dataset the plan was made for."""
    steps: int = 0
    """Absolute step to stop before; 0 means every step of the plan."""
    device: str = "cpu"
    """cpu or cuda."""
    seed: int = 0
    """Seed of the initial weights and of torch's RNG."""
    attention: str = "reference"
    """CP attention: reference (all-gather, any device), te (Transformer Engine, CUDA), torch
    (all-gather + torch's fused varlen kernel on CUDA; an SDPA stand-in on CPU)."""
    dtype: str = "fp32"
    """fp32, or bf16 (autocast; fp32 master weights and optimizer)."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    log_jsonl: str = ""
    """File that rank 0 appends one JSON line per step to; empty: stdout only."""
    save: str = ""
    """Checkpoint directory written at the end (and every save_every steps)."""
    save_every: int = 0
    """Steps between checkpoints; 0: only at the end."""
    resume: str = ""
    """Checkpoint directory to continue from."""
    quiet: bool = False
    """Do not print the per-step lines."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got "
                             f"{self.attention!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.steps < 0 or self.save_every < 0:
            raise ValueError("steps and save_every must be >= 0")
        # The torch path also runs on CPU, with an SDPA stand-in for the CUDA kernel (tests).
        if self.attention == "te" and self.device != "cuda":
            raise ValueError("--attention te needs --device cuda")


@dataclass(frozen=True, slots=True)
class StepLog:
    """One step's record (one JSON line)."""

    step: int
    loss: float
    tokens: int
    loss_tokens: int
    microbatches: int
    seconds: float

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "loss": self.loss, "tokens": self.tokens,
                           "loss_tokens": self.loss_tokens, "microbatches": self.microbatches,
                           "seconds": round(self.seconds, 6),
                           "tokens_per_s": round(self.tokens / max(self.seconds, 1e-9), 1)})


@dataclass(slots=True)
class TrainResult:
    """What a run returns to a caller (tests): its step logs and, on request, the final weights
    and the last step's gradients (reduced over the pool and divided by the token count)."""

    logs: list[StepLog] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def build_model(model_config: GPTConfig, seed: int, device: torch.device) -> GPT:
    """The model with weights from ``seed``, fp32 master weights on ``device``."""
    return GPT(model_config, seed=seed).to(device)


def build_optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.Optimizer:
    # foreach=False: the same per-tensor arithmetic on every rank and in the reference.
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             foreach=False)


def autocast_context(cfg: TrainConfig, device: torch.device) -> AbstractContextManager[Any]:
    if cfg.dtype == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[cfg.dtype])


def checkpoint_meta(model_config: GPTConfig, reader: PlanReader) -> dict[str, Any]:
    # The plan's header digest: a resume must replay the same batches, and another plan of the
    # same dataset and step count would pass every other check.
    plan = hashlib.sha256(reader.header.to_json().encode()).hexdigest()[:16]
    return {"model": checkpoint.config_meta(model_config),
            "dataset": reader.header.dataset.fingerprint, "num_steps": reader.num_steps,
            "plan": plan}


class StepLogger:
    """Rank 0's per-step output: a JSON line to stdout and, if asked, to a file."""

    def __init__(self, cfg: TrainConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.quiet = cfg.quiet
        self.file: IO[str] | None = None
        if enabled and cfg.log_jsonl:
            Path(cfg.log_jsonl).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(cfg.log_jsonl, "a")  # noqa: SIM115 - closed in close()

    def write(self, log: StepLog) -> None:
        if not self.enabled:
            return
        line = log.to_json()
        if not self.quiet:
            print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def step_range(cfg: TrainConfig, start: int, num_steps: int) -> range:
    stop = min(cfg.steps, num_steps) if cfg.steps else num_steps
    return range(start, stop)


def copy_final_state(result: TrainResult, model: GPT) -> None:
    """Copy the weights and the last step's gradients (AdamW leaves ``.grad`` as it was)."""
    result.state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    result.grads = {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()
                    if p.grad is not None}


# --------------------------------------------------------------------------------------------
# The replayed (distributed) run.


class Trainer:
    """Replays a plan on this rank; the process group must be initialised by the caller.

    ``catalog`` takes process groups the caller already owns (``GroupCatalog.from_groups``, for
    example from a DeviceMesh); by default every group of the plan is created here.
    """

    def __init__(self, cfg: TrainConfig, model_config: GPTConfig, *,
                 reader: PlanReader | None = None, source: TokenSource | None = None,
                 catalog: GroupCatalog | None = None) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg)
        # What the trainer opens it closes (close()); what the caller passes stays the caller's.
        self._owned: list[Any] = []
        if reader is None:
            reader = PlanReader(cfg.plan)
            self._owned.append(reader)
        if source is None:
            source = open_token_source(cfg.dataset)
            self._owned.append(source)
        self.reader = reader
        self.source = source
        self.reader.check_dataset(self.source.lengths())
        header = self.reader.header
        self.topology = Topology.from_header(header.parallel, rank=dist.get_rank(),
                                             world_size=dist.get_world_size())
        self.reader.check_job(self.topology)
        if header.parallel.tp > 1 or header.parallel.pp > 1:
            raise ValueError(f"{cfg.plan}: plan uses tp={header.parallel.tp}, "
                             f"pp={header.parallel.pp}; dcp-train's model has no tensor or "
                             "pipeline parallelism (tp = pp = 1 only)")
        if catalog is None:
            # Collective: every rank creates every group of the catalog, in catalog order.
            catalog = GroupCatalog.create(self.topology, header.cp_sizes)
        elif catalog.topology != self.topology:
            raise ValueError(f"catalog built for {catalog.topology}, the plan needs "
                             f"{self.topology}")
        self.catalog = catalog
        self.pool_group = self.catalog.pool_group
        self.replayer = Replayer(self.reader, self.source, self.topology, self.catalog,
                                 check_dataset=False)  # checked above
        self.model_config = model_config
        self.model = build_model(model_config, cfg.seed, self.device)
        self.optimizer = build_optimizer(self.model, cfg)
        self.backend = make_backend(cfg.attention, header.layout, model_config)
        self.rank = dist.get_rank()
        self.start = 0
        if cfg.resume:
            resumed = checkpoint.load(cfg.resume, model=self.model, optimizer=self.optimizer,
                                      rank=self.rank,
                                      expect_meta=checkpoint_meta(model_config, self.reader))
            self.start = resumed.next_step

    def _where(self, step: int, micro: Microbatch) -> str:
        samples = sorted(set(micro.rows.sample_index.tolist()) - {-1})
        return (f"{self.cfg.dataset}: step {step} microbatch {micro.rows.microbatch} "
                f"(samples {samples})")

    def step(self, step: int) -> StepLog:
        """Run one optimizer step (collective over the pool); return its log record."""
        t0 = time.perf_counter()
        model, device = self.model, self.device
        self.optimizer.zero_grad(set_to_none=False)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        microbatches = self.replayer.microbatches(step)
        for micro in microbatches:
            if micro.inputs.tokens is not None:  # CPU tensor: a cheap check, no device sync
                check_token_ids(micro.inputs.tokens, self.model_config.vocab_size,
                                functools.partial(self._where, step, micro))
            mb = to_device(micro.inputs, device)
            assert mb.tokens is not None
            assert mb.labels is not None
            assert mb.loss_mask is not None
            # The backward runs inside the binding too: the CP group stays bound until the
            # microbatch's gradients exist, whatever the attention saves for its backward.
            with self.backend.bind(mb, micro.cp_group, micro.cp_global_ranks,
                                   host=micro.inputs) as attention:
                with autocast_context(self.cfg, device):
                    logits = model(mb.tokens, mb.position_ids, attention)
                local_sum, local_count = per_token_loss(logits, mb.labels, mb.loss_mask)
                # Backward of the *sum*: the division by the global count happens once, after
                # the all-reduce, so the runtime CP size and the microbatch split cancel exactly.
                local_sum.backward()  # type: ignore[no-untyped-call]
            loss_sum += local_sum.detach().double()
            count += local_count.double()
        totals = torch.stack([loss_sum, count])
        if self.pool_group is not None:  # None: a pool of one rank, nothing to reduce
            dist.all_reduce(totals, group=self.pool_group)
        global_sum, global_count = totals.tolist()
        self._reduce_gradients(max(global_count, 1.0))
        self.optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tokens = int(np.asarray(self.reader.step(step).num_tokens, dtype=np.int64).sum())
        return StepLog(step=step, loss=global_sum / max(global_count, 1.0), tokens=tokens,
                       loss_tokens=int(global_count), microbatches=len(microbatches),
                       seconds=time.perf_counter() - t0)

    def _reduce_gradients(self, global_count: float) -> None:
        """Sum every gradient over the pool (one async all-reduce each), then divide by count."""
        handles = []
        grads = []
        for p in self.model.parameters():
            if p.grad is None:  # unused parameter on every rank: still reduce a zero
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
            if self.pool_group is not None:
                handles.append(dist.all_reduce(p.grad, group=self.pool_group, async_op=True))
        for h in handles:
            h.wait()
        torch._foreach_div_(grads, global_count)

    def close(self) -> None:
        """Close the plan and dataset this trainer opened itself."""
        for obj in self._owned:
            close = getattr(obj, "close", None)
            if close is not None:
                close()
        self._owned.clear()

    def run(self, *, keep_state: bool = False) -> TrainResult:
        """Steps [start, stop); checkpoints as configured; rank 0 logs."""
        cfg = self.cfg
        logger = StepLogger(cfg, enabled=self.rank == 0)
        result = TrainResult()
        meta = checkpoint_meta(self.model_config, self.reader)
        try:
            steps = step_range(cfg, self.start, self.reader.num_steps)
            for step in steps:
                log = self.step(step)
                result.logs.append(log)
                logger.write(log)
                last = step == steps[-1]
                if cfg.save and (last or (cfg.save_every and (step + 1) % cfg.save_every == 0)):
                    checkpoint.save(cfg.save, model=self.model, optimizer=self.optimizer,
                                    next_step=step + 1, meta=meta, rank=self.rank,
                                    group=self.pool_group)
        finally:
            logger.close()
        if keep_state:
            copy_final_state(result, self.model)
        return result


# --------------------------------------------------------------------------------------------
# Entry point.


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _init_process_group(device: str) -> bool:
    """Join the torchrun world (env://), or make a world of one; True if this call created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return True


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, GPTConfig, bool]:
    """Parse ``dcp-train``'s flags into (TrainConfig, GPTConfig, reference)."""
    p = argparse.ArgumentParser(prog="dcp-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="plan file (.arrow) made by dcp-plan")
    p.add_argument("--dataset", required=True, help="the dataset the plan was made for")
    p.add_argument("--steps", type=int, default=0,
                   help="absolute step to stop before (0: all steps of the plan)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    p.add_argument("--log-jsonl", default="", help="rank 0 appends one JSON line per step here")
    p.add_argument("--reference", action="store_true",
                   help="single-process oracle: every sequence alone, no CP, no packing")
    p.add_argument("--attention", choices=ATTENTIONS, default="reference",
                   help="CP attention: reference (all-gather, CPU/GPU), te, torch (CUDA)")
    p.add_argument("--save", default="", help="checkpoint directory written at the end")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument("--resume", default="", help="checkpoint directory to continue from")
    p.add_argument("--quiet", action="store_true", help="do not print per-step lines")
    add_model_arguments(p)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="fp32, or bf16 autocast with fp32 master weights")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a = p.parse_args(argv)
    try:
        model_config = model_config_from_args(a)
        cfg = TrainConfig(plan=a.plan, dataset=a.dataset, steps=a.steps, device=a.device,
                          seed=a.seed, attention=a.attention, dtype=a.dtype, lr=a.lr,
                          weight_decay=a.weight_decay, log_jsonl=a.log_jsonl, save=a.save,
                          save_every=a.save_every, resume=a.resume, quiet=a.quiet)
    except ValueError as e:
        p.error(str(e))
    return cfg, model_config, a.reference


def main(argv: Sequence[str] | None = None) -> int:
    """``dcp-train``; returns the process exit status."""
    cfg, model_config, reference = parse_args(argv)
    torch.manual_seed(cfg.seed)
    try:
        if reference:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise ValueError("--reference runs in one process; launch it without torchrun")
            from runtime.oracle import train_reference

            train_reference(cfg, model_config)
            return 0
        created = _init_process_group(cfg.device)
        try:
            trainer = Trainer(cfg, model_config)
            try:
                trainer.run()
            finally:
                trainer.close()
        finally:
            if created:
                dist.destroy_process_group()
    except ValueError as e:
        print(f"dcp-train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
