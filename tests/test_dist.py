"""The distributed test harness itself: results by rank, root-cause failures, timeouts."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist import ChildFailed, run_distributed


def _sum_ranks(rank: int, world_size: int, store_path: str, scale: int) -> tuple[int, int, str]:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return rank, int(t.item()), dist.get_backend()


def _fails_on_rank_1(rank: int, world_size: int, store_path: str) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()  # the others wait here and die when rank 1's connection closes


def _hangs(rank: int, world_size: int, store_path: str) -> None:
    if rank == 0:
        time.sleep(60)
    dist.barrier()


@pytest.mark.dist
def test_results_come_back_by_rank() -> None:
    got = run_distributed(_sum_ranks, 3, 10)
    assert got == [(0, 30, "gloo"), (1, 30, "gloo"), (2, 30, "gloo")]


@pytest.mark.dist
def test_failure_reports_the_root_cause_first() -> None:
    with pytest.raises(ChildFailed, match=r"(?s)^rank 1 failed first:.*rank 1 broke on purpose"):
        run_distributed(_fails_on_rank_1, 3, timeout=60)


@pytest.mark.dist
def test_timeout_kills_the_world() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish in 2 s; ranks still running: \[0"):
        run_distributed(_hangs, 2, timeout=2)
    assert time.monotonic() - start < 30


def test_fork_is_refused() -> None:
    with pytest.raises(ValueError, match="start_method"):
        run_distributed(_sum_ranks, 2, 1, start_method="fork")
