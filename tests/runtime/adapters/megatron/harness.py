"""Shared pieces of the Megatron adapter tests: a dataset, plans, rank functions, comparisons.

Every distributed run and every oracle run happens in fresh processes (``tests.dist``), so the
adapter's patches to Megatron's modules never touch the test process. Parameters come back
under their global names; TP shards are put back together here (an inverse written apart from
the adapter's slicing) before they are compared with the oracle's full tensors.

The set-up the test files share lives here too: ``pool4`` / ``pool2`` (a dataset and its plan,
with the CP group sizes it must use) and ``train_and_oracle`` (one launch per world).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.data.plan_reader import PlanReader
from runtime.train import TrainConfig, TrainResult
from runtime.train.model import GPTConfig
from tests.dist import run_distributed

# megatron-core quietly (mcore silences its import warnings), before any result unpickles:
# 0.19.2's ranks pickle tensors through megatron.core.safe_globals, whose first import in the
# test process would otherwise turn torch's deprecation warnings into errors. Without
# megatron-core the tests that need it skip or fail on their own.
with contextlib.suppress(ImportError):
    from runtime.adapters.megatron.compat import mcore  # noqa: F401

MODEL = GPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2)
STEPS = 3
TOL = 1e-5


def lengths(seed: int = 0, *, short: int = 36, medium: int = 8, long: int = 4,
            capacity: int = 32) -> np.ndarray:
    """A long-tail mix: most samples fit one rank of ``capacity``, some need 2 or 4 ranks."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(3, capacity - 3, size=short),
             rng.integers(capacity + 8, 2 * capacity - 4, size=medium),
             rng.integers(2 * capacity + 6, 4 * capacity - 8, size=long)]
    out = np.concatenate(parts)
    return out[rng.permutation(len(out))]


def write_dataset(path: Path, sample_lengths: np.ndarray, vocab: int, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab, size=int(n)).astype(np.int32) for n in sample_lengths]
    table = pa.table({"input_ids": pa.array(seqs, type=pa.list_(pa.int32()))})
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=16)
    return path


def plan(path: Path, data: Path, *, capacity: int, batch: int, **parallel: Any) -> Path:
    config = PlannerConfig(parallel=ParallelConfig(**parallel), capacity_tokens_per_rank=capacity,
                           global_batch_size=batch, seed=3)
    made = make_plan(read_lengths(data), config, load_cost_model("default"))
    return write_plan(path, made.header, made.record_batches())


def eval_set(tmp: Path, *, capacity: int = 32, batch: int = 8, long: int = 2,
             **parallel: Any) -> dict[str, str]:
    """A held-out dataset and its eval plan (``kind: eval``), as ``TrainConfig`` fields."""
    data = write_dataset(tmp / "eval.arrow", lengths(5, short=20, medium=5, long=long), 64, seed=9)
    config = PlannerConfig(parallel=ParallelConfig(**parallel), capacity_tokens_per_rank=capacity,
                           global_batch_size=batch, kind="eval")
    made = make_plan(read_lengths(data), config, load_cost_model("default"))
    path = write_plan(tmp / "eval-plan.arrow", made.header, made.record_batches())
    return {"eval_plan": str(path), "eval_dataset": str(data)}


def cfg(plan_path: Path, data: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(**{"plan": str(plan_path), "dataset": str(data), "steps": STEPS,
                          "seed": 7, "lr": 3e-3, "quiet": True, **kw})


def cp_sizes(path: Path, steps: int = STEPS) -> set[int]:
    """The CP group sizes that a plan's first ``steps`` steps use."""
    reader = PlanReader(path)
    return {int(k) for i in range(steps) for k in reader.step(i).group_cp_size}


def pool4(tmp: Path) -> tuple[Path, Path]:
    """(plan, dataset) under ``tmp``: dp 2 x cp 2, C = 32, samples up to 4C, so groups of 1, 2
    and 4 (checked)."""
    data = write_dataset(tmp / "data.arrow", lengths(), MODEL.vocab_size)
    p = plan(tmp / "plan.arrow", data, capacity=32, batch=12, dp=2, cp=2)
    assert cp_sizes(p) == {1, 2, 4}
    return p, data


def pool2(tmp: Path, **parallel: Any) -> tuple[Path, Path]:
    """(plan, dataset) under ``tmp``: a pool of 2 (``parallel``, e.g. ``dp=1, cp=2, pp=2``),
    C = 32, samples up to 2C, so groups of 1 and 2 (checked)."""
    data = write_dataset(tmp / "data.arrow", lengths(long=0), MODEL.vocab_size)
    p = plan(tmp / "plan.arrow", data, capacity=32, batch=12, **parallel)
    assert cp_sizes(p) == {1, 2}
    return p, data


def train_rank(rank: int, world_size: int, store: str, config: TrainConfig,
               model: GPTConfig) -> dict[str, Any]:
    """One rank of a Megatron run: its step logs and its parameters (global names)."""
    del store
    from runtime.adapters.megatron import MegatronTrainer

    torch.manual_seed(config.seed)
    trainer = MegatronTrainer(config, model)
    grads: dict[str, Any] = {}

    def keep_first_grads(step: int) -> None:
        if step == 0:
            grads.update(trainer.reduced_grads())

    try:
        result = trainer.run(after_step=keep_first_grads)
        t = trainer.topology
        state = trainer.state()
        return {"logs": result.logs, "evals": result.evals, "state": state,
                "grads": grads, "shapes": {n: tuple(v.shape) for n, v in state.items()},
                "tp": t.tp, "tp_rank": t.tp_rank, "pool_rank": t.pool_rank,
                "summary": trainer.summary_fields}
    finally:
        trainer.close()


def oracle_rank(rank: int, world_size: int, store: str, config: TrainConfig,
                model: GPTConfig) -> TrainResult:
    """The oracle, in its own process of a world of one."""
    del rank, world_size, store
    from runtime.adapters.megatron import train_reference

    return train_reference(replace(config, log_jsonl=""), model, keep_state=True)


def unshard(ranks: list[dict[str, Any]], key: str = "state") -> dict[str, torch.Tensor]:
    """Full parameters from the ranks of pool rank 0 (every TP rank, every stage); or, with
    ``key="grads"``, the full reduced gradients (``local_grads``: the pool ranks' shards)."""
    mine = [r for r in ranks if r["pool_rank"] == 0]
    tp = mine[0]["tp"]
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for r in mine:
        local = r["state"] if key == "state" else local_grads(ranks, r)
        for name, t in local.items():
            by_name.setdefault(name, {})[r["tp_rank"]] = t
    out = {}
    for name, parts in by_name.items():
        shards = [parts[i] for i in sorted(parts)]
        if tp == 1 or name.endswith(("norm.weight", "router.weight")):  # replicated over TP
            out[name] = shards[0]
        elif name.endswith("linear_fc1.weight"):  # [gate_r; up_r] per rank (dense and experts)
            gates = [s.chunk(2)[0] for s in shards]
            ups = [s.chunk(2)[1] for s in shards]
            out[name] = torch.cat(gates + ups)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):  # row parallel
            out[name] = torch.cat(shards, dim=1)
        else:  # column parallel and vocab parallel: dim 0
            out[name] = torch.cat(shards, dim=0)
    return out


def local_grads(ranks: list[dict[str, Any]], me: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``me``'s local (TP-split) reduced gradients, assembled from the elements every pool rank
    of its tp rank and stage holds (all of them under a full reduction, one shard each under
    the distributed optimizer). Every element must be held by some rank, and ranks that hold
    the same element must hold the same value."""
    peers = [r for r in ranks if r["tp_rank"] == me["tp_rank"]
             and r["shapes"].keys() == me["shapes"].keys()]
    out = {}
    for name, shape in me["shapes"].items():
        full = torch.full((int(np.prod(shape)),), float("nan"))
        for r in peers:
            if name not in r["grads"]:
                continue
            idx, values = r["grads"][name]
            seen = ~torch.isnan(full[idx])
            assert torch.equal(full[idx][seen], values[seen]), (name, "ranks disagree")
            full[idx] = values
        assert not torch.isnan(full).any(), (name, "elements no rank reduced")
        out[name] = full.reshape(shape)
    return out


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every parameter's reduced gradient equals the oracle's (relative 1e-5)."""
    assert got.keys() == want.keys()
    for name in want:
        diff = float((got[name] - want[name]).norm() / want[name].norm())
        assert diff <= TOL, (name, diff)


def oracle(config: TrainConfig, model: GPTConfig) -> TrainResult:
    """The oracle's run of ``config`` (its own process): logs, final weights, step-0 grads."""
    from tests.dist import run_distributed

    (ref,) = run_distributed(oracle_rank, 1, config, model, timeout=300)
    result: TrainResult = ref
    return result


def assert_same_losses(got: list[Any], want: list[Any], steps: int = STEPS) -> None:
    """Same steps, token counts, losses and (where reported) gradient norms (1e-5)."""
    assert [g.step for g in got] == [w.step for w in want] == list(range(steps))
    for g, w in zip(got, want, strict=True):
        assert g.loss_tokens == w.loss_tokens, g.step
        assert g.tokens == w.tokens, g.step
        assert abs(g.loss - w.loss) <= TOL * abs(w.loss), (g.step, g.loss, w.loss)
        if g.grad_norm is not None:
            assert abs(g.grad_norm - w.grad_norm) <= TOL * abs(w.grad_norm), (g.step, g, w)


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        diff = float((got[name] - want[name]).norm() / want[name].norm())
        assert diff <= TOL, (name, diff)


def train_rank_megatron_groups(rank: int, world_size: int, store: str, config: TrainConfig,
                               model: GPTConfig) -> dict[str, Any]:
    """A rank that keeps Megatron's own groups (parallel_state with hybrid DP x CP groups)."""
    del store
    from megatron.core import parallel_state

    from runtime.adapters.megatron import MegatronTrainer, groups_from_parallel_state
    from runtime.data.plan_reader import PlanReader
    from runtime.dist.topology import Topology

    header = PlanReader(config.plan).header
    parallel_state.initialize_model_parallel(context_parallel_size=header.parallel.cp,
                                             hybrid_context_parallel=True)
    try:
        topo = Topology.from_header(header.parallel, rank=rank, world_size=world_size)
        groups = groups_from_parallel_state(topo, header.cp_sizes)
        torch.manual_seed(config.seed)
        trainer = MegatronTrainer(config, model, groups=groups)
        try:
            return {"logs": trainer.run().logs, "state": trainer.state()}
        finally:
            trainer.close()
    finally:
        parallel_state.destroy_model_parallel()


def train_ranks(rank: int, world_size: int, store: str, configs: list[TrainConfig],
                model: GPTConfig) -> list[dict[str, Any]]:
    """``train_rank`` for several configs in one launch (one process start-up for all)."""
    return [train_rank(rank, world_size, store, c, model) for c in configs]


def oracle_ranks(rank: int, world_size: int, store: str, configs: list[TrainConfig],
                 model: GPTConfig) -> list[TrainResult]:
    """``oracle_rank`` for several configs in one process."""
    return [oracle_rank(rank, world_size, store, c, model) for c in configs]


def check_run(ranks: list[dict[str, Any]], ref: TrainResult) -> None:
    """A distributed run equals its oracle: losses, gradient norms, MoE terms and tokens per
    expert every step, reduced gradients at step 0, final parameters (fp32, relative 1e-5)."""
    assert_same_losses(ranks[0]["logs"], ref.logs)
    for g, w in zip(ranks[0]["logs"], ref.logs, strict=True):
        assert g.moe_tokens_per_expert == w.moe_tokens_per_expert, g.step
        assert (g.moe_aux_loss is None) == (w.moe_aux_loss is None), g.step
        if w.moe_aux_loss is not None:
            assert abs(g.moe_aux_loss - w.moe_aux_loss) <= TOL * abs(w.moe_aux_loss), (g, w)
        assert (g.mtp_loss is None) == (w.mtp_loss is None), g.step
        for a, b in zip(g.mtp_loss or [], w.mtp_loss or [], strict=True):
            assert abs(a - b) <= TOL * abs(b), (g.step, g.mtp_loss, w.mtp_loss)
    assert_same_grads(unshard(ranks, "grads"), ref.grads)
    assert_same_params(unshard(ranks), ref.state)


def train_and_oracle(configs: list[TrainConfig], world: int
                     ) -> tuple[list[list[dict[str, Any]]], list[TrainResult]]:
    """Every config trained on ``world`` gloo ranks in one launch, and by the oracle in one
    process: (per config, its ranks' results; per config, the oracle's result)."""
    per_rank = run_distributed(train_ranks, world, configs, MODEL, timeout=600)
    (refs,) = run_distributed(oracle_ranks, 1, configs, MODEL, timeout=600)
    return [[r[i] for r in per_rank] for i in range(len(configs))], refs
