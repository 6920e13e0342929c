"""The Megatron and torchtitan adapters apply the native trainer's protections.

Before: ``dcp-train --framework megatron|torchtitan`` created every process group with torch's
default timeout (30 min for gloo) whatever ``--distributed-timeout-minutes`` said, stopped on the
first line a ``--skip-bad-records`` plan had skipped, and trained on through a NaN loss. Now
every group they create (Megatron's TP/PP/embedding/self groups and the plan's CP groups;
torchtitan's device-mesh groups, its default group and the plan's CP groups) carries the flag's
timeout, they read the dataset through ``runtime.data.plan_source.open_plan_source`` (bad
records as planned, against each one's single-process oracle), and they stop naming the step
with a non-finite loss or gradient (``--skip-nonfinite-steps`` skips the update), all ranks
alike. Real gloo processes, the real packages.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.cli import main as plan_main
from runtime.train.config import TrainConfig
from runtime.train.model import GPTConfig
from tests.dist import run_distributed
from tests.reliability.helpers import write_token_jsonl

pytestmark = pytest.mark.dist

TIMEOUT_MIN = 1.5
MEGATRON = GPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2)
TITAN = GPTConfig(vocab_size=64, num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2)
TOL = 1e-5


def timeout_of(group: dist.ProcessGroup | None) -> timedelta:
    """The timeout a gloo group's collectives wait (None: the default group)."""
    group = group if group is not None else dist.group.WORLD
    return group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def bad_records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A JSONL dataset with two broken lines and a pool-2 plan (CP 1 and 2) that skips them."""
    d = tmp_path_factory.mktemp("adapters")
    data = write_token_jsonl(d / "bad.jsonl", num_samples=40, bad_lines=(3, 17))
    plan = d / "skip.arrow"
    assert plan_main([str(data), "-o", str(plan), "--dp", "1", "--cp", "2",
                      "--max-tokens-per-rank", "64", "--global-batch-size", "12",
                      "--long-sequences", "split", "--skip-bad-records", "--quiet"]) == 0
    return {"data": str(data), "plan": str(plan)}


def _cfg(run: dict[str, str], **kw: Any) -> TrainConfig:
    return TrainConfig(plan=run["plan"], dataset=run["data"], steps=3, seed=7, lr=3e-3,
                       quiet=True, distributed_timeout_minutes=TIMEOUT_MIN, **kw)


def _nonfinite(train: Any, cfg: TrainConfig) -> dict[str, Any]:
    """lr 1e30: step 1's loss is not finite. Stop (naming the step), then skip."""
    out: dict[str, Any] = {}
    try:
        train(replace(cfg, lr=1e30))
        out["stop"] = ""
    except ValueError as e:
        out["stop"] = str(e)
    out["skip"] = [log.skipped for log in train(replace(cfg, lr=1e30,
                                                        skip_nonfinite_steps=True))]
    return out


# ------------------------------------------------------------------------------ Megatron

def _megatron_groups(rank: int, world: int, store: str, tp: int, pp: int) -> list[float]:
    from runtime.adapters.megatron.binding.groups import create_groups
    from runtime.dist.topology import Topology

    topo = Topology(world_size=world, rank=rank, dp=1, cp=world // (tp * pp), tp=tp, pp=pp)
    g = create_groups(topo, (1, 2), timeout=timedelta(minutes=TIMEOUT_MIN))
    pgc = g.pg_collection
    groups = [*g.catalog.groups(), g.self_group, pgc.tp, pgc.pp, pgc.dp_cp]
    if pgc.embd is not None:
        groups.append(pgc.embd)
    return [timeout_of(x).total_seconds() for x in groups]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_megatron_groups_take_the_timeout(tp: int, pp: int) -> None:
    """Every group ``create_groups`` makes: the plan's CP and TP x CP groups, TP, PP, the
    tied-embedding group and this rank's own group (4 ranks: tp 2 x pool 2, pp 2 x pool 2)."""
    for got in run_distributed(_megatron_groups, 4, tp, pp):
        assert len(got) >= 4
        assert set(got) == {TIMEOUT_MIN * 60}, got


def _megatron_rank(rank: int, world: int, store: str, cfg: TrainConfig) -> dict[str, Any]:
    from runtime.adapters.megatron import MegatronTrainer

    def train(c: TrainConfig) -> list[Any]:
        trainer = MegatronTrainer(c, MEGATRON)
        try:
            groups = [*trainer.groups.catalog.groups(), trainer.groups.self_group]
            assert {timeout_of(x) for x in groups} == {timedelta(minutes=TIMEOUT_MIN)}
            return trainer.run().logs
        finally:
            trainer.close()

    return {"logs": train(cfg), **_nonfinite(train, cfg)}


def _megatron_oracle(rank: int, world: int, store: str, cfg: TrainConfig) -> list[Any]:
    from runtime.adapters.megatron import train_reference

    return train_reference(cfg, MEGATRON).logs


@pytest.mark.slow
def test_megatron_skips_bad_records_and_guards_nonfinite(bad_records: dict[str, str]) -> None:
    cfg = _cfg(bad_records)
    ranks = run_distributed(_megatron_rank, 2, cfg, timeout=400)
    oracle = run_distributed(_megatron_oracle, 1, cfg, timeout=300)[0]
    _check(ranks, oracle)


# ---------------------------------------------------------------------------- torchtitan

def _titan_rank(rank: int, world: int, store: str, cfg: TrainConfig) -> dict[str, Any]:
    from runtime.adapters.torchtitan import build_trainer
    from runtime.adapters.torchtitan.titan import mesh_groups

    want = timedelta(minutes=TIMEOUT_MIN)

    def train(c: TrainConfig) -> list[Any]:
        trainer = build_trainer(c, TITAN)
        try:
            # Before the first step: the mesh groups, the default group, the plan's groups.
            groups = [*mesh_groups(trainer.parallel_dims), None,
                      *trainer.dataloader.catalog.groups()]
            assert {timeout_of(x) for x in groups} == {want}
            trainer.train()
            # After it torchtitan sets comm.train_timeout_seconds (here the same) once more.
            assert {timeout_of(x) for x in groups} == {want}
            return list(trainer.logs)
        finally:
            trainer.close()

    return {"logs": train(cfg), **_nonfinite(train, cfg)}


def _titan_oracle(rank: int, world: int, store: str, cfg: TrainConfig) -> list[Any]:
    from runtime.adapters.torchtitan.oracle import train_reference

    return train_reference(cfg, TITAN).logs


@pytest.mark.slow
def test_torchtitan_skips_bad_records_and_guards_nonfinite(bad_records: dict[str, str]) -> None:
    pytest.importorskip("torchtitan")
    cfg = _cfg(bad_records)
    ranks = run_distributed(_titan_rank, 2, cfg, timeout=500)
    oracle = run_distributed(_titan_oracle, 1, cfg, backend=None, timeout=300)[0]
    _check(ranks, oracle)


def _check(ranks: list[dict[str, Any]], oracle: list[Any]) -> None:
    """The skipped records are skipped alike (losses equal the oracle's); the non-finite step
    stops every rank with the same message, or is skipped on every rank."""
    for r in ranks:
        got = r["logs"]
        assert [g.step for g in got] == [w.step for w in oracle] == [0, 1, 2]
        for g, w in zip(got, oracle, strict=True):
            assert g.loss_tokens == w.loss_tokens
            assert abs(g.loss - w.loss) <= TOL * abs(w.loss), (g.step, g.loss, w.loss)
        assert r["stop"].startswith("step 1: the "), r["stop"]
        assert "not finite" in r["stop"]
        assert "--skip-nonfinite-steps" in r["stop"]
        assert r["skip"] == [False, True, True]
    assert len({r["stop"] for r in ranks}) == 1
