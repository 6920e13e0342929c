"""Process groups for a plan inside Megatron-core: our ``GroupCatalog`` plus Megatron's collection.

``MegatronGroups`` is what the adapter needs and nothing else reads global state:

- ``catalog``: the plan's CP groups (``runtime.dist.groups.GroupCatalog``) and the pool group;
- ``pg_collection``: Megatron's ``ProcessGroupCollection`` the model is built with: ``tp``,
  ``pp``, ``embd`` (first and last stage, tied embeddings under PP), ``dp_cp`` = the pool group
  (gradients and token counts are summed over it), and ``cp`` = this rank alone: the model is
  built without CP and ``runtime.adapters.megatron.binding`` points it at each microbatch's group;
- ``self_group``: this rank alone, the ``cp_group`` of microbatches in which it is a group of one
  (Megatron's RoPE needs a group whose size and rank it can read, never None).

Two ways to get one:

- ``create_groups(topology, cp_sizes)``: collective, every rank in the same order (catalog first,
  then TP, PP and embedding groups by increasing pool rank, tp rank); what ``dcp-train
  --framework megatron`` does.
- ``groups_from_parallel_state(topology, cp_sizes)``: a caller that ran Megatron's
  ``parallel_state.initialize_model_parallel(..., context_parallel_size=cp,
  hybrid_context_parallel=True)`` keeps its groups: the catalog wraps Megatron's hybrid DP x CP
  groups (``GroupCatalog.from_groups`` checks every group's ranks against the plan's blocks) and
  the collection is Megatron's own. Nothing is created but this rank's singleton group.

Example: dp 1 x cp 2, tp 2 (world 4): TP groups [0, 1] and [2, 3], CP group of block (0, 2) at
tp rank 0 is [0, 2], pool group [0, 2] (tp rank 0) and [1, 3] (tp rank 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from planner.groups import catalog as catalog_blocks
from runtime.adapters.megatron import mcore
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology


@dataclass(frozen=True, slots=True)
class MegatronGroups:
    """This rank's groups for replaying a plan in Megatron-core (see the module docstring)."""

    topology: Topology
    catalog: GroupCatalog
    pg_collection: mcore.ProcessGroupCollection
    self_group: dist.ProcessGroup

    def cp_group(self, rank_start: int, cp_size: int) -> dist.ProcessGroup:
        """The microbatch's CP group for block (rank_start, cp_size); ``self_group`` at size 1."""
        group = self.catalog.cp_group(rank_start, cp_size)
        return self.self_group if group is None else group

    @property
    def pool_group(self) -> dist.ProcessGroup:
        """All pool ranks of this rank's tp/pp slice (``self_group`` for a pool of one)."""
        group = self.catalog.pool_group
        return self.self_group if group is None else group


def _self_group(timeout: timedelta | None) -> dist.ProcessGroup:
    # Local synchronisation: only this rank takes part, so ranks need not agree on an order.
    group: dist.ProcessGroup = dist.new_group([dist.get_rank()], use_local_synchronization=True,
                                              timeout=timeout)
    return group


def _collection(topology: Topology, catalog: GroupCatalog, self_group: dist.ProcessGroup,
                tp: dist.ProcessGroup, pp: dist.ProcessGroup,
                embd: dist.ProcessGroup | None) -> mcore.ProcessGroupCollection:
    pgc = mcore.ProcessGroupCollection()
    pool = catalog.pool_group if catalog.pool_group is not None else self_group
    pgc.tp = tp
    pgc.pp = pp
    pgc.cp = self_group
    pgc.tp_cp = tp
    pgc.embd = embd
    pgc.pos_embd = None  # RoPE: no position-embedding table to keep in sync
    pgc.dp = pool
    pgc.dp_cp = pool
    pgc.intra_dp_cp = pool
    del topology
    return pgc


def create_groups(topology: Topology, cp_sizes: Sequence[int], *,
                  timeout: timedelta | None = None) -> MegatronGroups:
    """Create every group a plan and Megatron's schedules need (collective, same args on every
    rank); the default process group must span the topology's world. ``timeout`` bounds every
    collective of every group created (``--distributed-timeout-minutes``; torch's ``new_group``
    does not inherit the default group's); None keeps torch's default (30 min for gloo)."""
    catalog = GroupCatalog.create(topology, cp_sizes, timeout=timeout)
    self_group = _self_group(timeout)
    t = topology
    me = t.rank
    tp_group = pp_group = self_group
    embd: dist.ProcessGroup | None = None
    if t.tp > 1:
        for pp_rank in range(t.pp):
            for pool_rank in range(t.pool_size):
                ranks = [t.global_rank(pool_rank, r, pp_rank) for r in range(t.tp)]
                g = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    tp_group = g
    if t.pp > 1:
        for pool_rank in range(t.pool_size):
            for tp_rank in range(t.tp):
                ranks = [t.global_rank(pool_rank, tp_rank, p) for p in range(t.pp)]
                g = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    pp_group = g
        for pool_rank in range(t.pool_size):
            for tp_rank in range(t.tp):
                # The first and the last stage hold the two copies of tied embeddings.
                ranks = [t.global_rank(pool_rank, tp_rank, 0),
                         t.global_rank(pool_rank, tp_rank, t.pp - 1)]
                g = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    embd = g
    pgc = _collection(topology, catalog, self_group, tp_group, pp_group, embd)
    return MegatronGroups(topology=topology, catalog=catalog, pg_collection=pgc,
                          self_group=self_group)


def groups_from_parallel_state(topology: Topology, cp_sizes: Sequence[int], *,
                               timeout: timedelta | None = None) -> MegatronGroups:
    """Wrap the groups of an initialised Megatron ``parallel_state`` (hybrid DP x CP enabled).

    Megatron's groups keep the timeout ``initialize_model_parallel(distributed_timeout_minutes=)``
    gave them; ``timeout`` is for the one group made here (this rank alone).

    Raises:
        ValueError: Megatron's groups do not hold the ranks the plan's blocks need (another rank
            order, or hybrid context parallelism not enabled).
    """
    ps = mcore.parallel_state
    if not ps.model_parallel_is_initialized():
        raise ValueError("Megatron's parallel_state is not initialised")
    n = topology.pool_size
    mapping: dict[tuple[int, int], dist.ProcessGroup | None] = {}
    for start, k in catalog_blocks(n, cp_sizes):
        if not start <= topology.pool_rank < start + k:
            continue
        if k == 1:
            mapping[(start, k)] = None
        elif k == n:
            mapping[(start, k)] = ps.get_data_parallel_group(with_context_parallel=True)
        else:
            try:
                mapping[(start, k)] = ps.get_hybrid_data_context_parallel_groups(group_size=k)
            except (AssertionError, KeyError) as e:
                raise ValueError(f"Megatron has no hybrid DP x CP group of size {k}: initialise "
                                 "parallel_state with hybrid_context_parallel=True") from e
    pool = ps.get_data_parallel_group(with_context_parallel=True) if n > 1 else None
    catalog = GroupCatalog.from_groups(topology, mapping, pool_group=pool)
    self_group = _self_group(timeout)
    pgc = mcore.ProcessGroupCollection.use_mpu_process_groups()
    pgc.cp = self_group
    return MegatronGroups(topology=topology, catalog=catalog, pg_collection=pgc,
                          self_group=self_group)
