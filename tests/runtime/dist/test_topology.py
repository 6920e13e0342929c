"""Topology: Megatron rank order, round trips, validation, header and environment construction."""

from __future__ import annotations

import itertools

import pytest

from planner.planfile.schema import ParallelInfo
from runtime.dist.topology import Topology

SHAPES = [
    (dp, cp, tp, pp)
    for dp, cp, tp, pp in itertools.product([1, 2, 3], [1, 2, 4], [1, 2], [1, 2, 3])
]


def _topo(rank: int, dp: int, cp: int, tp: int, pp: int) -> Topology:
    return Topology(world_size=dp * cp * tp * pp, rank=rank, dp=dp, cp=cp, tp=tp, pp=pp)


@pytest.mark.parametrize(("dp", "cp", "tp", "pp"), SHAPES)
def test_coordinates_round_trip_and_are_a_bijection(dp: int, cp: int, tp: int, pp: int) -> None:
    world = dp * cp * tp * pp
    seen = set()
    for rank in range(world):
        t = _topo(rank, dp, cp, tp, pp)
        coords = (t.tp_rank, t.cp_rank, t.dp_rank, t.pp_rank)
        assert 0 <= t.tp_rank < tp
        assert 0 <= t.cp_rank < cp
        assert 0 <= t.dp_rank < dp
        assert 0 <= t.pp_rank < pp
        # Megatron's default order: tp fastest, then cp, then dp, then pp.
        assert rank == t.tp_rank + tp * (t.cp_rank + cp * (t.dp_rank + dp * t.pp_rank))
        assert t.pool_rank == t.cp_rank + cp * t.dp_rank
        assert t.global_rank(t.pool_rank, t.tp_rank, t.pp_rank) == rank
        seen.add(coords)
    assert len(seen) == world


@pytest.mark.parametrize(("dp", "cp", "tp", "pp"), SHAPES)
def test_pool_blocks_are_strided_global_ranks(dp: int, cp: int, tp: int, pp: int) -> None:
    t = _topo(0, dp, cp, tp, pp)
    for tp_rank, pp_rank in itertools.product(range(tp), range(pp)):
        ranks = [t.global_rank(p, tp_rank, pp_rank) for p in range(t.pool_size)]
        assert ranks == list(range(ranks[0], ranks[0] + tp * t.pool_size, tp))
        assert ranks[0] == tp_rank + tp * t.pool_size * pp_rank


def test_worked_example_of_the_docstring() -> None:
    t = _topo(5, dp=2, cp=2, tp=2, pp=1)
    assert (t.tp_rank, t.cp_rank, t.dp_rank, t.pool_rank) == (1, 0, 1, 2)
    assert [t.global_rank(p, 1, 0) for p in (2, 3)] == [5, 7]


def test_small_case_listed_by_hand() -> None:
    # dp=2, cp=2, tp=1, pp=2: ranks 0-3 are stage 0, 4-7 stage 1; cp varies fastest in the pool.
    got = [(t.cp_rank, t.dp_rank, t.pp_rank, t.pool_rank)
           for t in (_topo(r, 2, 2, 1, 2) for r in range(8))]
    assert got == [(0, 0, 0, 0), (1, 0, 0, 1), (0, 1, 0, 2), (1, 1, 0, 3),
                   (0, 0, 1, 0), (1, 0, 1, 1), (0, 1, 1, 2), (1, 1, 1, 3)]


def test_world_size_mismatch_names_both() -> None:
    with pytest.raises(ValueError, match=r"world_size=8 .*dp\*cp\*tp\*pp = 2\*2\*1\*1 = 4"):
        Topology(world_size=8, rank=0, dp=2, cp=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 4, "rank": 4, "dp": 2, "cp": 2}, "rank 4 is outside 0..3"),
        ({"world_size": 4, "rank": -1, "dp": 2, "cp": 2}, "rank -1"),
        ({"world_size": 0, "rank": 0, "dp": 0, "cp": 2}, "must be a positive integer"),
        ({"world_size": 2, "rank": 0, "dp": 2, "cp": 1, "tp": 0}, "tp must be"),
        ({"world_size": 2, "rank": 0, "dp": 2.0, "cp": 1}, "dp must be"),
        ({"world_size": 2, "rank": True, "dp": 2, "cp": 1}, "rank must be an integer"),
    ],
)
def test_invalid_values_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology(**kwargs)  # type: ignore[arg-type]


def test_global_rank_checks_its_arguments() -> None:
    t = _topo(0, 2, 2, 2, 1)
    for args, message in [((4, 0, 0), "pool rank 4"), ((0, 2, 0), "tp rank 2"),
                          ((0, 0, 1), "pp rank 1")]:
        with pytest.raises(ValueError, match=message):
            t.global_rank(*args)


def _parallel(dp: int, cp: int, tp: int, pp: int) -> ParallelInfo:
    return ParallelInfo(dp=dp, cp=cp, tp=tp, pp=pp, vpp=1, sequence_parallel=False,
                        pool_size=dp * cp, microbatch_group_size=pp)


def test_from_header() -> None:
    t = Topology.from_header(_parallel(2, 4, 2, 1), rank=9, world_size=16)
    assert (t.dp, t.cp, t.tp, t.pp, t.rank, t.pool_size) == (2, 4, 2, 1, 9, 8)
    with pytest.raises(ValueError, match=r"plan built for world_size=16 .* got 8"):
        Topology.from_header(_parallel(2, 4, 2, 1), rank=0, world_size=8)


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    t = Topology.from_env(dp=2, cp=2, tp=2)
    assert (t.rank, t.world_size, t.tp_rank, t.cp_rank, t.dp_rank) == (3, 8, 1, 1, 0)
    monkeypatch.setenv("WORLD_SIZE", "eight")
    with pytest.raises(ValueError, match="WORLD_SIZE='eight' is not an integer"):
        Topology.from_env(dp=2, cp=2, tp=2)
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="RANK is not set"):
        Topology.from_env(dp=2, cp=2, tp=2)


def test_is_frozen() -> None:
    t = _topo(0, 1, 2, 1, 1)
    with pytest.raises(AttributeError):
        t.rank = 1  # type: ignore[misc]
