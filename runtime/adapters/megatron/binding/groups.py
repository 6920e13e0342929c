"""Process groups for a plan inside Megatron-core: our ``GroupCatalog`` plus Megatron's collection.

``MegatronGroups`` is what the adapter needs and nothing else reads global state:

- ``catalog``: the plan's CP groups (``runtime.dist.groups.GroupCatalog``) and the pool group;
- ``pg_collection``: Megatron's ``ProcessGroupCollection`` the model is built with: ``tp``,
  ``pp``, ``embd`` (first and last stage, tied embeddings under PP), ``dp_cp`` = the pool group
  (gradients and token counts are summed over it), and ``cp`` = this rank alone: the model is
  built without CP and ``binding.cp_group`` points it at each microbatch's group;
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
from runtime.adapters.megatron.compat import mcore
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

    def tp_cp_group(self, rank_start: int, cp_size: int) -> dist.ProcessGroup:
        """The TP x CP group of block (rank_start, cp_size): the CP group at tp 1, the TP group
        at cp_size 1; ``self_group`` when both are 1."""
        group = self.catalog.tp_cp_group(rank_start, cp_size)
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


def _collection(catalog: GroupCatalog, self_group: dist.ProcessGroup, *,
                tp: dist.ProcessGroup, pp: dist.ProcessGroup, mp: dist.ProcessGroup,
                tp_dp_cp: dist.ProcessGroup, embd: dist.ProcessGroup | None
                ) -> mcore.ProcessGroupCollection:
    """Every group Megatron's model, schedules, DDP and optimizers ask for.

    A plan's job has no static CP and no expert parallelism, so the expert groups are their
    dense twins (Megatron's defaults at ep 1: expert TP = TP, expert DP = the pool) and ``cp``
    is this rank alone; one distributed-optimizer instance spans the world (``intra_dist_opt``,
    the group the optimizers reduce gradient norms over) and ``inter_dist_opt`` is None.
    Names a release does not declare are dropped (``mcore.process_group_collection``).
    """
    pool = catalog.pool_group if catalog.pool_group is not None else self_group
    groups: dict[str, object] = {
        "tp": tp, "pp": pp, "mp": mp, "embd": embd,
        "pos_embd": None,  # RoPE: no position-embedding table to keep in sync
        "cp": self_group, "tp_cp": tp, "hcp": None,
        "ep": self_group, "expt_tp": tp, "tp_ep": tp, "tp_ep_pp": mp,
        "tp_dp_cp": tp_dp_cp, "dp": pool, "dp_cp": pool, "intra_dp_cp": pool,
        "expt_dp": pool, "intra_expt_dp": pool,
        "inter_dist_opt": None, "intra_dist_opt": dist.group.WORLD,
        # 0.19's weight-rematerialising TP ("gtp_remat", off here: groups of one rank, so its
        # extra reductions are no-ops) and FSDP's separate all-gather communicators (unused).
        "gtp_remat": self_group, "expt_gtp_remat": self_group, "dp_cp_gtp_remat": pool,
        "expt_dp_gtp_remat": pool, "tp_ep_pp_with_egtp_remat": mp, "dp_cp_ag": None,
        "expt_dp_ag": None,
    }
    return mcore.process_group_collection(groups)


def create_groups(topology: Topology, cp_sizes: Sequence[int], *,
                  timeout: timedelta | None = None) -> MegatronGroups:
    """Create every group a plan and Megatron's schedules, DDP and optimizers need (collective,
    same args on every rank); the default process group must span the topology's world.
    ``timeout`` bounds every collective of every group created (``--distributed-timeout-
    minutes``; torch's ``new_group`` does not inherit the default group's); None keeps torch's
    default (30 min for gloo)."""
    catalog = GroupCatalog.create(topology, cp_sizes, timeout=timeout)
    self_group = _self_group(timeout)
    t = topology
    pools, tps, pps = range(t.pool_size), range(t.tp), range(t.pp)

    def mine(rank_lists: list[list[int]]) -> dist.ProcessGroup:
        """Create one group per list (in order, on every rank); the one holding this rank."""
        out = self_group
        for ranks in rank_lists:
            g = dist.new_group(ranks, timeout=timeout)
            if t.rank in ranks:
                out = g
        return out

    g = t.global_rank
    tp_group = pp_group = self_group
    embd: dist.ProcessGroup | None = None
    if t.tp > 1:
        tp_group = mine([[g(n, r, p) for r in tps] for p in pps for n in pools])
    if t.pp > 1:
        pp_group = mine([[g(n, r, p) for p in pps] for n in pools for r in tps])
        # The first and the last stage hold the two copies of tied embeddings.
        embd = mine([[g(n, r, 0), g(n, r, t.pp - 1)] for n in pools for r in tps])
    # Model-parallel (tp x pp, one pool rank) and tp x pool (one stage) groups, made only where
    # they differ from a group above or from the world.
    mp_group = tp_group if t.pp == 1 else pp_group if t.tp == 1 else mine(
        [[g(n, r, p) for p in pps for r in tps] for n in pools])
    world: dist.ProcessGroup = dist.group.WORLD  # type: ignore[assignment]
    tp_dp_cp = world if t.pp == 1 else mine(
        [[g(n, r, p) for n in pools for r in tps] for p in pps])
    pgc = _collection(catalog, self_group, tp=tp_group, pp=pp_group, mp=mp_group,
                      tp_dp_cp=tp_dp_cp, embd=embd)
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
