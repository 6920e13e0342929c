"""Create every CP process group a plan can use, once, in one order on every rank.

``torch.distributed.new_group`` is collective: every rank of the world must call it for every
group, in the same order, even for groups it is not in. So groups are never created lazily
during a step (ranks would reach different groups in different orders and hang). Instead
``GroupCatalog.create`` walks ``planner.groups.catalog(pool_size, cp_sizes)`` (sizes ascending,
then rank_start ascending: the planner's own list, one source of truth) and, for each block,
creates one group per (tp_rank, pp_rank) slice. Lookups afterwards never create anything.

What is created, in this order:
1. For each catalog block (rank_start, k) with k > 1, for pp_rank, for tp_rank: the CP group of
   that block in that slice. Size-1 blocks get no process group (a lone rank needs none; lookups
   return None, which is what TE's ``set_context_parallel_group`` takes for "no CP").
2. With tp > 1, for each catalog block, for pp_rank: the TP x CP group (the block's pool ranks
   at every tp_rank), including k == 1, where it equals the TP group, so lookups are uniform.
3. The pool group (all N pool ranks of a slice), for pp_rank, for tp_rank, unless the catalog
   already holds the block (0, N); the loss all-reduces its token count over it.

Example: dp=1, cp=2, tp=2 (world 4), cp_sizes (1, 2): CP groups [0, 2] and [1, 3] (block (0, 2)
at tp_rank 0 and 1), then TP x CP groups [0, 1] ((0, 1)), [2, 3] ((1, 1)) and [0, 1, 2, 3]
((0, 2)); the pool groups are the CP groups of block (0, 2).

Warm-up runs one all-reduce in every group this rank belongs to, in creation order; that order
is a total order shared by all ranks, so the first unfinished group always has all its members
waiting on it and the warm-up cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from planner.groups import catalog, check_cp_sizes, is_aligned
from runtime.dist.topology import Topology

Block = tuple[int, int]
"""(rank_start, cp_size): an aligned block of pool ranks."""


def set_group_timeout(group: dist.ProcessGroup | None, timeout: timedelta) -> None:
    """Bound every later collective of ``group`` (None: the default group) by ``timeout``.

    ``torch.distributed.set_timeout`` where torch has it (torchtitan calls it), else the
    private setter behind it (torch 2.13 has only that; it handles gloo and NCCL).
    """
    setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    setter(timeout, group)


class GroupCatalog:
    """This rank's view of the catalog's process groups; build with ``create`` or ``from_groups``.

    Lookups take pool coordinates (rank_start, cp_size) as they appear in the plan and answer for
    this rank's (tp_rank, pp_rank) slice.
    """

    def __init__(
        self,
        topology: Topology,
        cp_groups: Mapping[Block, dist.ProcessGroup | None],
        *,
        tp_cp_groups: Mapping[Block, dist.ProcessGroup | None] | None = None,
        pool_group: dist.ProcessGroup | None = None,
        creation_log: Sequence[tuple[int, ...]] = (),
    ) -> None:
        self.topology = topology
        self._cp = dict(cp_groups)
        self._tp_cp = dict(tp_cp_groups or {})
        self._pool = pool_group
        self.creation_log: list[tuple[int, ...]] = list(creation_log)
        """Global ranks of every group created, in creation order (identical on all ranks)."""

    def groups(self) -> list[dist.ProcessGroup]:
        """Every distinct process group this rank holds (CP, TP x CP and pool groups)."""
        found: dict[int, dist.ProcessGroup] = {}
        for g in [*self._cp.values(), *self._tp_cp.values(), self._pool]:
            if g is not None:
                found.setdefault(id(g), g)
        return list(found.values())

    @classmethod
    def create(
        cls,
        topology: Topology,
        cp_sizes: Sequence[int],
        *,
        backend: str | None = None,
        warmup: bool = True,
        timeout: timedelta | None = None,
    ) -> GroupCatalog:
        """Create every group of the catalog (a collective: call it on every rank, same args).

        Args:
            topology: this rank's topology; the default process group must span its world.
            cp_sizes: the group sizes the plan may use (the header's ``cp_sizes``).
            backend: backend for the new groups; None uses the default group's.
            warmup: run one all-reduce in each group this rank belongs to, so that lazy
                communicator setup happens here and not inside the first training step.
            timeout: timeout of every group's collectives (``--distributed-timeout-minutes``);
                None keeps torch's default for the backend (30 min for gloo).

        Raises:
            ValueError: a size is not valid for the pool, or the live world is not the topology's.
        """
        n = topology.pool_size
        sizes = check_cp_sizes(n, cp_sizes)
        if dist.get_world_size() != topology.world_size:
            raise ValueError(
                f"topology has world_size={topology.world_size}, the process group has "
                f"{dist.get_world_size()}"
            )
        blocks = catalog(n, sizes)
        log: list[tuple[int, ...]] = []
        mine: list[dist.ProcessGroup] = []
        me = topology.rank

        def new(ranks: list[int]) -> dist.ProcessGroup | None:
            group: dist.ProcessGroup = dist.new_group(ranks, backend=backend, timeout=timeout)
            log.append(tuple(ranks))
            if me in ranks:
                mine.append(group)
                return group
            return None

        def slice_ranks(start: int, k: int, tp_rank: int, pp_rank: int) -> list[int]:
            return [topology.global_rank(p, tp_rank, pp_rank) for p in range(start, start + k)]

        cp_groups: dict[Block, dist.ProcessGroup | None] = {}
        for start, k in blocks:
            for pp_rank in range(topology.pp):
                for tp_rank in range(topology.tp):
                    # Size 1: nothing to create, and every rank skips it alike.
                    group = None if k == 1 else new(slice_ranks(start, k, tp_rank, pp_rank))
                    if (tp_rank, pp_rank) == (topology.tp_rank, topology.pp_rank):
                        cp_groups[(start, k)] = group
        tp_cp_groups: dict[Block, dist.ProcessGroup | None] = {}
        if topology.tp > 1:
            for start, k in blocks:
                for pp_rank in range(topology.pp):
                    ranks = sorted(
                        r for t in range(topology.tp) for r in slice_ranks(start, k, t, pp_rank)
                    )
                    group = new(ranks)
                    if pp_rank == topology.pp_rank:
                        tp_cp_groups[(start, k)] = group
        if (0, n) in cp_groups:
            pool_group = cp_groups[(0, n)]
        else:
            pool_group = None
            for pp_rank in range(topology.pp):
                for tp_rank in range(topology.tp):
                    group = new(slice_ranks(0, n, tp_rank, pp_rank)) if n > 1 else None
                    if (tp_rank, pp_rank) == (topology.tp_rank, topology.pp_rank):
                        pool_group = group
        if warmup:
            for group in mine:
                _warm_up(group)
        return cls(
            topology,
            cp_groups,
            tp_cp_groups=tp_cp_groups,
            pool_group=pool_group,
            creation_log=log,
        )

    @classmethod
    def from_groups(
        cls,
        topology: Topology,
        mapping: Mapping[Block, dist.ProcessGroup | None],
        *,
        pool_group: dist.ProcessGroup | None = None,
        tp_cp_groups: Mapping[Block, dist.ProcessGroup | None] | None = None,
    ) -> GroupCatalog:
        """Wrap groups the caller already owns (for example sub-meshes of its DeviceMesh).

        Every group must hold exactly the global ranks this module would have put in it
        (``cp_global_ranks``, ``tp_cp_global_ranks``): the attention binds a group together with
        those ranks, so a mesh laid out in another rank order would pair the wrong peers.

        Args:
            topology: this rank's topology.
            mapping: (rank_start, cp_size) -> this rank's group for every block a plan may put
                this rank in; size-1 blocks may map to None. Blocks are in pool coordinates.
            pool_group: the group of all pool ranks of this rank's slice; defaults to
                ``mapping[(0, pool_size)]`` when present.
            tp_cp_groups: with tp > 1, block -> the block's TP x CP group (all its tp ranks).

        Raises:
            ValueError: a block is not an aligned block of the pool, or a group's ranks differ
                from the block's, naming both.
        """
        n = topology.pool_size
        for (start, k), group in mapping.items():
            if not is_aligned(start, k, n):
                raise ValueError(f"block ({start}, {k}) is not an aligned block of a pool of {n}")
            size = 1 if group is None else dist.get_world_size(group)
            if size != k:
                raise ValueError(f"group for block ({start}, {k}) has {size} ranks, expected {k}")
        if pool_group is None:
            pool_group = mapping.get((0, n))
        cat = cls(topology, mapping, tp_cp_groups=tp_cp_groups, pool_group=pool_group)
        for (start, k), group in mapping.items():
            if group is not None:
                _check_ranks(f"group for block ({start}, {k})", group,
                             cat.cp_global_ranks(start, k))
        for (start, k), group in (tp_cp_groups or {}).items():
            if group is not None:
                _check_ranks(f"TP x CP group for block ({start}, {k})", group,
                             cat.tp_cp_global_ranks(start, k))
        if pool_group is not None:
            _check_ranks("pool group", pool_group, cat.cp_global_ranks(0, n))
        return cat

    def _check_member(self, rank_start: int, cp_size: int) -> None:
        pool_rank = self.topology.pool_rank
        if not rank_start <= pool_rank < rank_start + cp_size:
            raise ValueError(
                f"pool rank {pool_rank} (global rank {self.topology.rank}) is not in the group "
                f"of ranks [{rank_start}, {rank_start + cp_size})"
            )

    def cp_group(self, rank_start: int, cp_size: int) -> dist.ProcessGroup | None:
        """This rank's process group for block (rank_start, cp_size); None when cp_size == 1.

        Raises:
            ValueError: this rank is not in the block, or the block is not in the catalog.
        """
        self._check_member(rank_start, cp_size)
        key = (rank_start, cp_size)
        if key not in self._cp:
            known = sorted({k for _, k in self._cp})
            raise ValueError(
                f"group ({rank_start}, {cp_size}) is not in the catalog (sizes {known}); the "
                "plan uses a size the runtime was not started with"
            )
        return self._cp[key]

    def cp_global_ranks(self, rank_start: int, cp_size: int) -> list[int]:
        """Global ranks of block (rank_start, cp_size) in this rank's tp/pp slice, in CP order."""
        if not is_aligned(rank_start, cp_size, self.topology.pool_size):
            raise ValueError(
                f"block ({rank_start}, {cp_size}) is not an aligned block of a pool of "
                f"{self.topology.pool_size}"
            )
        t = self.topology
        pool_ranks = range(rank_start, rank_start + cp_size)
        return [t.global_rank(p, t.tp_rank, t.pp_rank) for p in pool_ranks]

    def tp_cp_group(self, rank_start: int, cp_size: int) -> dist.ProcessGroup | None:
        """The TP x CP group of block (rank_start, cp_size); None when tp * cp_size == 1."""
        self._check_member(rank_start, cp_size)
        if self.topology.tp == 1:
            return self.cp_group(rank_start, cp_size)
        key = (rank_start, cp_size)
        if key not in self._tp_cp:
            raise ValueError(f"no TP x CP group for block ({rank_start}, {cp_size})")
        return self._tp_cp[key]

    def tp_cp_global_ranks(self, rank_start: int, cp_size: int) -> list[int]:
        """Global ranks of the TP x CP group of block (rank_start, cp_size), ascending."""
        t = self.topology
        return sorted(
            t.global_rank(p, tp_rank, t.pp_rank)
            for p in range(rank_start, rank_start + cp_size)
            for tp_rank in range(t.tp)
        )

    @property
    def pool_group(self) -> dist.ProcessGroup | None:
        """All pool ranks of this rank's tp/pp slice; None when the pool is one rank."""
        if self._pool is None and self.topology.pool_size > 1:
            raise ValueError("no pool group: pass pool_group= to from_groups")
        return self._pool

    def member_blocks(self) -> list[Block]:
        """The catalog blocks that contain this rank, in catalog order."""
        p = self.topology.pool_rank
        return [(s, k) for s, k in self._cp if s <= p < s + k]


def _check_ranks(what: str, group: dist.ProcessGroup, want: list[int]) -> None:
    got = dist.get_process_group_ranks(group)
    if got != want:
        raise ValueError(f"{what} holds global ranks {got}, expected {want}")


def _warm_up(group: dist.ProcessGroup) -> None:
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    dist.all_reduce(torch.ones(1, device=device), group=group)
