"""GroupCatalog on real gloo worlds (2, 4, 6, 8 processes) and on a 64-rank fake world.

Each distributed run builds several catalogs for different topologies of the same world (group
creation is collective over the world, whatever the topology), so one process start covers many
layouts. Every rank returns its creation log and what its groups did; the parent checks that the
logs agree across ranks and equal the hand-written expectation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from planner.groups import catalog, valid_cp_sizes
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology
from tests.dist import run_distributed

Shape = tuple[int, int, int, int]  # dp, cp, tp, pp


def _reduce_rank(group: dist.ProcessGroup) -> int:
    t = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _exercise(rank: int, world: int, shape: Shape, cp_sizes: tuple[int, ...]) -> dict[str, Any]:
    dp, cp, tp, pp = shape
    topo = Topology(world_size=world, rank=rank, dp=dp, cp=cp, tp=tp, pp=pp)
    cat = GroupCatalog.create(topo, cp_sizes)
    sums, members, tp_cp, errors = {}, {}, {}, []
    for start, k in catalog(topo.pool_size, cp_sizes):
        block = (start, k)
        if not start <= topo.pool_rank < start + k:
            try:
                cat.cp_group(start, k)
            except ValueError as e:
                errors.append(str(e))
            continue
        group = cat.cp_group(start, k)
        ranks = cat.cp_global_ranks(start, k)
        if k == 1:
            assert group is None
            members[block] = ranks
        else:
            assert group is not None
            members[block] = dist.get_process_group_ranks(group)
            assert members[block] == ranks
            sums[block] = _reduce_rank(group)
        if tp > 1:
            g = cat.tp_cp_group(start, k)
            assert g is not None
            assert dist.get_process_group_ranks(g) == cat.tp_cp_global_ranks(start, k)
            tp_cp[block] = (_reduce_rank(g), cat.tp_cp_global_ranks(start, k))
    pool = cat.pool_group
    pool_sum = None if pool is None else _reduce_rank(pool)
    return {"log": cat.creation_log, "sums": sums, "members": members, "tp_cp": tp_cp,
            "pool_sum": pool_sum, "errors": errors, "blocks": cat.member_blocks(),
            "pool_rank": topo.pool_rank}


def _catalogs_child(rank: int, world: int, store: str,
                    cases: list[tuple[Shape, tuple[int, ...]]]) -> list[dict[str, Any]]:
    del store
    return [_exercise(rank, world, shape, sizes) for shape, sizes in cases]


def _expected_members(shape: Shape, rank: int, start: int, k: int) -> list[int]:
    # Written from the rank-order formula directly, not via Topology.global_rank.
    dp, cp, tp, pp = shape
    tp_rank = rank % tp
    pp_rank = rank // (tp * cp * dp)
    return [tp_rank + tp * (p + dp * cp * pp_rank) for p in range(start, start + k)]


def _check(world: int, cases: list[tuple[Shape, tuple[int, ...]]],
           results: list[list[dict[str, Any]]], expected_logs: list[list[tuple[int, ...]]]) -> None:
    for c, (shape, sizes) in enumerate(cases):
        per_rank = [results[r][c] for r in range(world)]
        logs = [r["log"] for r in per_rank]
        assert all(log == logs[0] for log in logs), f"creation order differs for {shape}"
        assert logs[0] == expected_logs[c], shape
        dp, cp, tp, pp = shape
        n = dp * cp
        for rank, res in enumerate(per_rank):
            mine = [(s, k) for s, k in catalog(n, sizes) if s <= res["pool_rank"] < s + k]
            assert res["blocks"] == mine
            assert len(mine) == len(set(sizes))  # exactly one block per size
            for start, k in mine:
                want = _expected_members(shape, rank, start, k)
                assert res["members"][(start, k)] == want
                assert rank in want
                if k > 1:
                    assert res["sums"][(start, k)] == sum(want)
                if tp > 1:
                    got_sum, ranks = res["tp_cp"][(start, k)]
                    tp_peers = sorted(r - rank % tp + t for r in want for t in range(tp))
                    assert ranks == tp_peers
                    assert got_sum == sum(tp_peers)
            pool = _expected_members(shape, rank, 0, n)
            assert res["pool_sum"] == (sum(pool) if n > 1 else None)
            assert len(res["errors"]) == len(catalog(n, sizes)) - len(mine)
            assert all("is not in the group" in e for e in res["errors"])


@pytest.mark.dist
def test_world_8_catalogs() -> None:
    cases: list[tuple[Shape, tuple[int, ...]]] = [
        ((4, 2, 1, 1), (1, 2, 4, 8)),
        ((2, 2, 2, 1), (1, 2, 4)),  # tp=2: TP x CP groups; pool group made separately
        ((1, 2, 2, 2), (2,)),  # pp=2: one catalog per stage
    ]
    expected = [
        [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7), tuple(range(8))],
        # CP groups of size 2 and 4 at tp_rank 0 then 1 ...
        [(0, 2), (1, 3), (4, 6), (5, 7), (0, 2, 4, 6), (1, 3, 5, 7),
         # ... TP x CP groups per block (sizes 1, 2, 4) ...
         (0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7), tuple(range(8))],
        # (no separate pool group: the catalog holds the block (0, N))
        # pp=2, tp=2, pool 2, sizes (2,): block (0, 2) at (pp 0, tp 0), (pp 0, tp 1), (pp 1, ...)
        [(0, 2), (1, 3), (4, 6), (5, 7), (0, 1, 2, 3), (4, 5, 6, 7)],
    ]
    results = run_distributed(_catalogs_child, 8, cases)
    _check(8, cases, results, expected)


@pytest.mark.dist
def test_world_6_and_subset_of_sizes() -> None:
    cases: list[tuple[Shape, tuple[int, ...]]] = [
        ((3, 2, 1, 1), (1, 2, 6)),
        ((6, 1, 1, 1), (1, 2)),  # the plan omits N: a separate pool group is created last
    ]
    expected = [
        [(0, 1), (2, 3), (4, 5), tuple(range(6))],
        [(0, 1), (2, 3), (4, 5), tuple(range(6))],
    ]
    results = run_distributed(_catalogs_child, 6, cases)
    _check(6, cases, results, expected)


@pytest.mark.dist
def test_world_4_tp2_pool2_and_world_2() -> None:
    cases: list[tuple[Shape, tuple[int, ...]]] = [
        ((1, 2, 2, 1), (1, 2)),  # the module docstring's example
        ((2, 2, 1, 1), (1, 2, 4)),
        ((1, 1, 4, 1), (1,)),  # pool of one rank: no CP group, no pool group, TP x CP = TP
    ]
    expected: list[list[tuple[int, ...]]] = [
        [(0, 2), (1, 3), (0, 1), (2, 3), (0, 1, 2, 3)],
        [(0, 1), (2, 3), (0, 1, 2, 3)],
        [(0, 1, 2, 3)],
    ]
    results = run_distributed(_catalogs_child, 4, cases)
    _check(4, cases, results, expected)
    cases2: list[tuple[Shape, tuple[int, ...]]] = [((2, 1, 1, 1), (1, 2)), ((1, 2, 1, 1), (2,))]
    results2 = run_distributed(_catalogs_child, 2, cases2)
    _check(2, cases2, results2, [[(0, 1)], [(0, 1)]])


def _fake_world(rank: int, world: int) -> None:
    # torch registers the "fake" backend only once this private test module is imported.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    dist.init_process_group("fake", rank=rank, world_size=world, store=dist.HashStore())  # type: ignore[attr-defined]


@pytest.mark.parametrize("rank", [0, 37, 63])
def test_fake_world_64_pool_order_and_membership(rank: int) -> None:
    sizes = valid_cp_sizes(64)
    _fake_world(rank, 64)
    try:
        topo = Topology(world_size=64, rank=rank, dp=8, cp=8)
        cat = GroupCatalog.create(topo, sizes)
        blocks = [(s, k) for s, k in catalog(64, sizes) if k > 1]
        assert len(cat.creation_log) == len(blocks) == 32 + 16 + 8 + 4 + 2 + 1
        assert cat.creation_log == [tuple(range(s, s + k)) for s, k in blocks]
        for s, k in cat.member_blocks():
            assert s <= rank < s + k
            assert s % k == 0
            g = cat.cp_group(s, k)
            if k > 1:
                assert g is not None
                assert dist.get_process_group_ranks(g) == list(range(s, s + k))
                assert dist.get_rank(g) == rank - s
        assert cat.pool_group is cat.cp_group(0, 64)
        with pytest.raises(ValueError, match="not in the catalog"):
            GroupCatalog(topo, {}).cp_group(rank, 1)
    finally:
        dist.destroy_process_group()


def test_fake_world_128_with_tp_and_pp() -> None:
    # pool 16 (dp 4 x cp 4), tp 4, pp 2: 128 ranks.
    sizes = (1, 2, 16)
    _fake_world(77, 128)
    try:
        topo = Topology(world_size=128, rank=77, dp=4, cp=4, tp=4, pp=2)
        cat = GroupCatalog.create(topo, sizes)
        blocks = catalog(16, sizes)
        cp_groups = [b for b in blocks if b[1] > 1]
        assert len(cat.creation_log) == len(cp_groups) * 8 + len(blocks) * 2
        assert len(set(cat.creation_log)) == len(cat.creation_log)
        # rank 77 = tp 1 + 4 * (pool 3 + 16 * pp 1)
        assert (topo.tp_rank, topo.pool_rank, topo.pp_rank) == (1, 3, 1)
        assert cat.cp_global_ranks(2, 2) == [73, 77]
        assert cat.tp_cp_global_ranks(2, 2) == list(range(72, 80))
        g = cat.tp_cp_group(2, 2)
        assert g is not None
        assert dist.get_process_group_ranks(g) == list(range(72, 80))
        assert dist.get_process_group_ranks(cat.pool_group) == list(range(65, 128, 4))
    finally:
        dist.destroy_process_group()


def test_from_groups_wraps_caller_groups() -> None:
    _fake_world(5, 8)
    try:
        topo = Topology(world_size=8, rank=5, dp=4, cp=2)
        g2 = dist.new_group([4, 5])
        g8 = dist.new_group(list(range(8)))
        cat = GroupCatalog.from_groups(topo, {(5, 1): None, (4, 2): g2, (0, 8): g8})
        assert cat.cp_group(4, 2) is g2
        assert cat.cp_group(5, 1) is None
        assert cat.pool_group is g8
        assert cat.cp_global_ranks(4, 2) == [4, 5]
        assert cat.creation_log == []
        with pytest.raises(ValueError, match="has 2 ranks, expected 4"):
            GroupCatalog.from_groups(topo, {(4, 4): g2})
        with pytest.raises(ValueError, match="not an aligned block"):
            GroupCatalog.from_groups(topo, {(3, 2): g2})
        with pytest.raises(ValueError, match="no pool group"):
            _ = GroupCatalog.from_groups(topo, {(4, 2): g2}).pool_group
    finally:
        dist.destroy_process_group()


def test_create_rejects_invalid_sizes_and_world() -> None:
    _fake_world(0, 8)
    try:
        with pytest.raises(ValueError, match="cp size 3 is not valid"):
            GroupCatalog.create(Topology(world_size=8, rank=0, dp=4, cp=2), (1, 3))
        with pytest.raises(ValueError, match="topology has world_size=4"):
            GroupCatalog.create(Topology(world_size=4, rank=0, dp=2, cp=2), (1, 2))
    finally:
        dist.destroy_process_group()


def test_from_groups_rejects_groups_of_other_ranks() -> None:
    # dp 2 x cp 2 x tp 2: rank 5 is tp_rank 1, pool rank 2; its block (2, 2) is global [5, 7].
    # A mesh laid out with tp slowest would hand it [4, 5]: right size, wrong peers.
    _fake_world(5, 8)
    try:
        topo = Topology(world_size=8, rank=5, dp=2, cp=2, tp=2)
        wrong = dist.new_group([4, 5])
        right = dist.new_group([5, 7])
        with pytest.raises(ValueError, match=r"\[4, 5\].*\[5, 7\]"):
            GroupCatalog.from_groups(topo, {(2, 2): wrong})
        assert GroupCatalog.from_groups(topo, {(2, 2): right}).cp_group(2, 2) is right
        with pytest.raises(ValueError, match=r"pool group.*\[4, 5\].*\[1, 3, 5, 7\]"):
            GroupCatalog.from_groups(topo, {(2, 2): right}, pool_group=wrong)
    finally:
        dist.destroy_process_group()


def test_from_groups_takes_tp_cp_groups() -> None:
    # A caller with TP (DeviceMesh) must be able to hand over its TP x CP groups too.
    _fake_world(5, 8)
    try:
        topo = Topology(world_size=8, rank=5, dp=2, cp=2, tp=2)
        cp = dist.new_group([5, 7])
        tp_cp = dist.new_group([4, 5, 6, 7])
        cat = GroupCatalog.from_groups(topo, {(2, 2): cp}, tp_cp_groups={(2, 2): tp_cp})
        assert cat.tp_cp_group(2, 2) is tp_cp
        with pytest.raises(ValueError, match=r"TP x CP group.*\[4, 5\].*\[4, 5, 6, 7\]"):
            GroupCatalog.from_groups(topo, {(2, 2): cp},
                                     tp_cp_groups={(2, 2): dist.new_group([4, 5])})
    finally:
        dist.destroy_process_group()
