"""runtime.data.replay on real gloo worlds: each rank gets exactly its plan rows, with working
groups.

Every rank opens the plan and the dataset itself (JSONL ranks race to build the same index cache),
creates the catalog's groups, replays every step and all-gathers its shards inside each CP group.
The parent checks, per rank and microbatch, the rows against the plan, the local shard and the
gathered buffer against a token-by-token reference, the group membership by an all-reduce, and
that the union over ranks of the rows is exactly each step's rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
import torch.distributed as dist

from planner.sources.megatron import write_megatron_dataset
from runtime.data.plan_reader import PlanReader
from runtime.data.replay import Replayer
from runtime.data.shard import shard_indices_np
from runtime.data.tokens import open_token_source
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology
from tests.dist import run_distributed
from tests.runtime import planfactory

pytestmark = pytest.mark.dist


def _replay_rank(rank: int, world_size: int, store_path: str, plan: str, data: str,
                 dims: tuple[int, int, int, int]) -> list[dict[str, Any]]:
    dp, cp, tp, pp = dims
    topo = Topology(world_size=world_size, rank=rank, dp=dp, cp=cp, tp=tp, pp=pp)
    reader = PlanReader(plan)
    catalog = GroupCatalog.create(topo, reader.header.cp_sizes)
    replayer = Replayer(reader, open_token_source(data), topo, catalog)
    out = []
    for step, mbs in replayer.steps():
        for mb in mbs:
            x, rows = mb.inputs, mb.rows
            local = x.tokens if x.tokens is not None else x.labels
            gathered = None
            member_sum = rank
            if local is not None and mb.cp_group is not None:
                parts = [torch.empty_like(local) for _ in range(x.cp_size)]
                dist.all_gather(parts, local, group=mb.cp_group)
                gathered = [p.numpy() for p in parts]
                t = torch.tensor([rank])
                dist.all_reduce(t, group=mb.cp_group)
                member_sum = int(t)
            out.append(dict(
                step=step, microbatch=x.microbatch, rank_start=x.rank_start, cp_size=x.cp_size,
                cp_rank=x.cp_rank, cp_global_ranks=mb.cp_global_ranks, member_sum=member_sum,
                samples=rows.sample_index.tolist(), offsets=rows.token_offset.tolist(),
                num_tokens=rows.num_tokens.tolist(), cu_padded=x.cu_seqlens_padded.tolist(),
                tokens=None if x.tokens is None else x.tokens.numpy(),
                labels=None if x.labels is None else x.labels.numpy(),
                loss_mask=None if x.loss_mask is None else x.loss_mask.numpy(),
                gathered=gathered))
    return out


def _write_dataset(tmp_path: Path, fmt: str, seqs: list[np.ndarray]) -> str:
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in seqs))
    elif fmt == "arrow":
        path = tmp_path / "d.arrow"
        t = pa.table({"input_ids": pa.array([s.tolist() for s in seqs])})
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, t.schema) as w:
            w.write_table(t, max_chunksize=16)
    else:
        write_megatron_dataset(tmp_path / "d", seqs, dtype=np.int32)
        path = tmp_path / "d.bin"
    return str(path)


@pytest.mark.parametrize(("dims", "layout", "fmt"), [
    ((1, 2, 1, 1), "zigzag", "jsonl"),
    ((1, 2, 1, 2), "zigzag", "arrow"),       # 4 ranks: two pipeline stages
    # 6 and 8 processes take 15-30 s on 2 cores (torch import per rank).
    pytest.param((3, 2, 1, 1), "contiguous", "megatron", marks=pytest.mark.slow),  # pool 6
    pytest.param((2, 2, 2, 1), "zigzag", "jsonl", marks=pytest.mark.slow),  # tp 2, pool 4
], ids=["w2", "w4-pp2", "w6", "w8-tp2"])
def test_every_rank_gets_its_rows(tmp_path: Path, dims: tuple[int, int, int, int], layout: str,
                                  fmt: str) -> None:
    dp, cp, tp, pp = dims
    world = dp * cp * tp * pp
    rng = np.random.default_rng(world)
    lengths = rng.integers(1, 40, size=60)
    seqs = [rng.integers(1, 30_000, size=n) for n in lengths]
    data = _write_dataset(tmp_path, fmt, seqs)
    plan = planfactory.random_plan(tmp_path / "p.arrow", lengths, dp=dp, cp=cp, tp=tp, pp=pp,
                                   layout=layout, num_steps=2, microbatches=2, seed=world)
    results = run_distributed(_replay_rank, world, str(plan), data, dims, timeout=180)

    reader = PlanReader(plan)
    union: dict[int, set[tuple[int, int, int, int]]] = {i: set() for i in range(reader.num_steps)}
    for rank, got in enumerate(results):
        topo = Topology(world_size=world, rank=rank, dp=dp, cp=cp, tp=tp, pp=pp)
        first, last = topo.pp_rank == 0, topo.pp_rank == pp - 1
        want = [(i, m) for i in range(reader.num_steps)
                for m in range(reader.step(i).num_microbatches)]
        assert [(r["step"], r["microbatch"]) for r in got] == want
        for r in got:
            g = reader.step(r["step"]).group_for(r["microbatch"], topo.pool_rank)
            assert (r["rank_start"], r["cp_size"], r["cp_rank"]) == (g.rank_start, g.cp_size,
                                                                     g.cp_rank)
            assert r["samples"] == g.sample_index.tolist()
            assert r["offsets"] == g.token_offset.tolist()
            assert r["num_tokens"] == g.num_tokens.tolist()
            assert rank in r["cp_global_ranks"]
            assert len(r["cp_global_ranks"]) == g.cp_size
            if g.cp_size > 1:
                assert r["member_sum"] == sum(r["cp_global_ranks"])
            ref = planfactory.reference_group(g, seqs)
            idx = shard_indices_np(layout, r["cu_padded"], g.cp_size, g.cp_rank)
            assert (r["tokens"] is not None) == first
            assert (r["labels"] is not None) == last
            name = "tokens" if first else "labels" if last else None
            if first:
                assert r["tokens"].tolist() == np.array(ref["tokens"])[idx].tolist()
            if last:
                assert r["labels"].tolist() == np.array(ref["labels"])[idx].tolist()
                assert r["loss_mask"].tolist() == np.array(ref["loss_mask"])[idx].tolist()
            if name is not None and g.cp_size > 1:
                full = np.zeros(len(ref[name]), np.int64)
                for cp_rank, part in enumerate(r["gathered"]):
                    full[shard_indices_np(layout, r["cu_padded"], g.cp_size, cp_rank)] = part
                assert full.tolist() == ref[name]
            union[r["step"]] |= {(r["microbatch"], r["rank_start"], s, o)
                                 for s, o in zip(r["samples"], r["offsets"], strict=True)}
    for i in range(reader.num_steps):
        step = reader.step(i)
        rows = set(zip(step.microbatch.tolist(), step.rank_start.tolist(),
                       step.sample_index.tolist(), step.token_offset.tolist(), strict=True))
        assert union[i] == rows
        placed = {(s, o) for _, _, s, o in rows if s >= 0}
        assert len(placed) == int((step.sample_index >= 0).sum())  # no segment twice
