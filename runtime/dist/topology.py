"""Where a rank sits in the job: a value object built from explicit ints.

Rank order is Megatron's default (``order="tp-cp-ep-dp-pp"``, expert parallelism aside): tensor
parallelism varies fastest, then context parallelism, then data parallelism, then pipeline stages::

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
    pool_rank   = cp_rank + cp * dp_rank          (the dynamic-CP pool, shared DOMAIN.md)

Why this order:
- TP exchanges activations in every layer, so its ranks must be neighbours: consecutive global
  ranks land on one node's GPUs, one NVLink domain.
- It is Megatron's order, so a user can mix this runtime with Megatron's parallel state (or a
  DeviceMesh built the same way) and every rank agrees on who its TP/CP/DP peers are.
- CP next to TP keeps small CP groups (sizes 2, 4) inside a node as well.
- A consequence used by the group catalog: for a fixed (tp_rank, pp_rank) the pool ranks
  0 .. N-1 map to global ranks that increase with stride tp, so an aligned pool block is an
  aligned, evenly strided block of global ranks.

Example: dp=2, cp=2, tp=2, pp=1 (world 8): global rank 5 has tp_rank 1, cp_rank 0, dp_rank 1,
pool_rank 2; pool block [2, 4) at tp_rank 1 is global ranks [5, 7].

Only ``Topology.from_env()`` reads the environment (``RANK``, ``WORLD_SIZE``); everything else
takes ranks as arguments, so tests build any topology in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from planner.planfile.schema import TRAIN_COMMAND, ParallelInfo


class SameOnEveryRank(ValueError):
    """A refusal every rank reaches alike (the launch does not fit the plan): the entry point
    prints it on rank 0 only, not once per rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """One rank's coordinates in a dp x cp x tp x pp job."""

    world_size: int
    """Number of ranks of the job; must equal dp * cp * tp * pp."""
    rank: int
    """This process's global rank, 0 .. world_size-1."""
    dp: int
    """Data-parallel size."""
    cp: int
    """Static context-parallel size; the dynamic pool is dp * cp ranks."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "cp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        product = self.dp * self.cp * self.tp * self.pp
        if self.world_size != product:
            raise ValueError(
                f"world_size={self.world_size} does not equal dp*cp*tp*pp = "
                f"{self.dp}*{self.cp}*{self.tp}*{self.pp} = {product}"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"rank must be an integer, got {self.rank!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")

    @property
    def pool_size(self) -> int:
        """N = dp * cp, the ranks dynamic CP redistributes."""
        return self.dp * self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        """The static CP coordinate (not the rank inside a dynamic group)."""
        return (self.rank // self.tp) % self.cp

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def pool_rank(self) -> int:
        """This rank's index in the dynamic pool: cp_rank + cp * dp_rank."""
        return self.cp_rank + self.cp * self.dp_rank

    def global_rank(self, pool_rank: int, tp_rank: int, pp_rank: int) -> int:
        """The global rank at pool position ``pool_rank`` of the (tp_rank, pp_rank) slice."""
        if not 0 <= pool_rank < self.pool_size:
            raise ValueError(f"pool rank {pool_rank} is outside 0..{self.pool_size - 1}")
        if not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp rank {tp_rank} is outside 0..{self.tp - 1}")
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp rank {pp_rank} is outside 0..{self.pp - 1}")
        # pool_rank = cp_rank + cp * dp_rank, so cp and dp collapse into one stride-tp index.
        return tp_rank + self.tp * (pool_rank + self.pool_size * pp_rank)

    @classmethod
    def from_header(cls, parallel: ParallelInfo, rank: int, world_size: int) -> Topology:
        """The topology a plan was built for, checked against the live world.

        Raises:
            ValueError: the plan's dp*cp*tp*pp differs from ``world_size``.
        """
        expected = parallel.dp * parallel.cp * parallel.tp * parallel.pp
        if expected != world_size:
            raise SameOnEveryRank(
                f"plan built for world_size={expected} (dp={parallel.dp}, cp={parallel.cp}, "
                f"tp={parallel.tp}, pp={parallel.pp}), got {world_size}: launch "
                f"{parallel.launch_hint(TRAIN_COMMAND)}"
            )
        return cls(
            world_size=world_size,
            rank=rank,
            dp=parallel.dp,
            cp=parallel.cp,
            tp=parallel.tp,
            pp=parallel.pp,
        )

    @classmethod
    def from_env(cls, *, dp: int, cp: int, tp: int = 1, pp: int = 1) -> Topology:
        """Read ``RANK`` and ``WORLD_SIZE`` (as set by torchrun); the sizes come from the caller.

        This is the only place in the runtime that reads the environment; call it at the entry
        point and pass the result down.
        """
        values = {}
        for key in ("RANK", "WORLD_SIZE"):
            text = os.environ.get(key)
            if text is None:
                raise ValueError(f"environment variable {key} is not set (launch with torchrun)")
            try:
                values[key] = int(text)
            except ValueError:
                raise ValueError(f"environment variable {key}={text!r} is not an integer") from None
        return cls(
            world_size=values["WORLD_SIZE"], rank=values["RANK"], dp=dp, cp=cp, tp=tp, pp=pp
        )
