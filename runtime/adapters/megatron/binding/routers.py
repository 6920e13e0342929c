"""A MoE model's per-step routing bookkeeping, and what it refuses.

``RouterSteps`` is the part of a plan's job that only a MoE model has (``moe.py`` is the
mechanism inside Megatron's router):

- ``begin(step_tokens)`` (from ``PlanJob.data_iterator``): a fresh ``StepRouting`` for the step;
  with ``global_aux_loss`` (``needs_counts``) the caller then runs the step's forward-only
  statistics pass through Megatron's schedule inside ``counting()`` (``forward_step(...,
  counting=True)``: routing only, no loss), whose per-layer top-k counts are summed over every
  rank (one all-reduce of [layers, E]) when it closes;
- ``bind(batch)`` (from ``forward.forward_step``): the microbatch's rows and TP x CP group for
  the replaced load-balancing methods, for the forward;
- ``report(loss_tokens)`` (from ``PlanJob.step_loss``): one all-reduce of the step's tokens per
  expert and attached terms, the load-balancing term divided by the step's loss tokens, and
  the check that the training forward routed as the statistics pass did.

``check_config`` refuses, before the model exists (so on every rank), every MoE feature the
adapter does not run under dynamic CP, saying what to use; ``moe_refusals`` is the list it
raises from, which the Megatron-LM launcher words in its own flags' names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from runtime.adapters.megatron.binding import moe
from runtime.adapters.megatron.binding.batch import Batch
from runtime.adapters.megatron.binding.groups import MegatronGroups
from runtime.adapters.megatron.binding.refusal import Refusal, config_message
from runtime.train.megatron_options import LOAD_BALANCING_TYPES


def load_balancing_types(config: Any) -> list[str]:
    """The configured load-balancing types (Megatron takes a name or a list of names)."""
    kind = config.moe_router_load_balancing_type
    return list(kind) if isinstance(kind, (list, tuple)) else [kind]


def moe_refusals(config: Any, *, tp: int, sequence_parallel: bool) -> list[Refusal]:
    """Every MoE feature of ``config`` the adapter cannot run under dynamic CP (none for a dense
    model). ``config``: a ``TransformerConfig`` or anything with its field names (the
    Megatron-LM launcher passes a view of its arguments)."""
    if not config.num_moe_experts:
        return []
    kinds = load_balancing_types(config)
    checks = {
        "expert_model_parallel_size": (
            (config.expert_model_parallel_size or 1) > 1,
            "expert parallelism is not supported yet (every rank holds all experts)", "1"),
        "expert_tensor_parallel_size": (
            config.expert_tensor_parallel_size not in (None, tp),
            f"experts are split over the plan's tp ({tp})", "None"),
        "moe_expert_capacity_factor": (
            config.moe_expert_capacity_factor is not None,
            "routing is dropless: with a capacity, whether a token reaches its experts depends "
            "on the other tokens of its microbatch, so on the packing", "None"),
        "moe_pad_expert_input_to_capacity": (
            bool(config.moe_pad_expert_input_to_capacity), "routing is dropless", "False"),
        "moe_z_loss_coeff": (
            bool(config.moe_z_loss_coeff), "the router z-loss is not handled under dynamic CP "
            "yet (balance with the aux-loss coefficient)", "None"),
        "moe_router_enable_expert_bias": (
            bool(config.moe_router_enable_expert_bias), "the expert-bias update is not handled "
            "under dynamic CP yet (global_aux_loss balances over the whole step)", "False"),
        "moe_token_dispatcher_type": (
            config.moe_token_dispatcher_type != "alltoall",
            "the adapter runs Megatron's alltoall dispatcher", "'alltoall'"),
        "moe_input_jitter_eps": (
            bool(config.moe_input_jitter_eps), "random jitter per token makes the run depend "
            "on the packing", "None"),
        "moe_router_force_load_balancing": (
            bool(getattr(config, "moe_router_force_load_balancing", False)),
            "random routing (a benchmark mode)", "False"),
        "moe_router_load_balancing_type": (
            any(t not in LOAD_BALANCING_TYPES for t in kinds),
            f"use one of {', '.join(LOAD_BALANCING_TYPES)} (sinkhorn and others are not "
            "handled under dynamic CP)", None),
        "mtp_num_layers": (
            bool(config.mtp_num_layers), "MoE layers with multi-token prediction are not "
            "supported yet: a dense model with MTP, or MoE without it", None),
        "sequence_parallel": (
            tp > 1 and not sequence_parallel, "MoE with tp > 1 needs sequence parallelism "
            "(Megatron refuses it in training): plan with dcp-plan --sequence-parallel", None),
    }
    return [Refusal(name, why, want) for name, (refused, why, want) in checks.items() if refused]


def check_config(config: Any, *, tp: int, sequence_parallel: bool) -> None:
    """Refuse a MoE ``TransformerConfig`` the adapter cannot run under dynamic CP (the same
    ValueError on every rank, at start-up), saying what to use instead (``moe_refusals``)."""
    bad = moe_refusals(config, tp=tp, sequence_parallel=sequence_parallel)
    if bad:
        raise ValueError("MoE model the adapter cannot run under dynamic CP: "
                         + config_message(config, bad))


class RouterSteps:
    """The routing statistics of each step of a MoE model (see the module docstring).

    Args:
        config: the model's ``TransformerConfig``.
        groups: the job's groups (the TP x CP group of each microbatch's CP group).
        device: where the statistics live (the model's device).
        sequence_parallel: whether the model runs sequence parallelism (the router then sees
            this TP rank's slice of the microbatch).
    """

    def __init__(self, config: Any, *, groups: MegatronGroups, device: torch.device,
                 sequence_parallel: bool) -> None:
        self.config, self.groups, self.device = config, groups, device
        topology = groups.topology
        self.tp, self.tp_rank = topology.tp, topology.tp_rank
        self.sequence_parallel = sequence_parallel
        kinds = load_balancing_types(config)
        coeffs = config.moe_aux_loss_coeff
        coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
        self.active = [k for k, c in zip(kinds, coeffs, strict=True) if k != "none" and c > 0]
        self.routing: moe.StepRouting | None = None

    def _new(self, step_tokens: int) -> moe.StepRouting:
        return moe.StepRouting(num_layers=self.config.num_layers,
                               num_experts=self.config.num_moe_experts,
                               step_tokens=step_tokens, device=self.device)

    @property
    def needs_counts(self) -> bool:
        """Whether a step needs its statistics pass first (``global_aux_loss``)."""
        return "global_aux_loss" in self.active

    def begin(self, step_tokens: int) -> None:
        """Open a step's statistics (``step_tokens``: its real tokens over every rank)."""
        self.routing = self._new(step_tokens)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Around the step's statistics pass (forward only, ``counting=True``): on exit the
        counts it made are summed over every rank and kept as the step's (collective)."""
        routing = self.routing
        if routing is None:
            raise AssertionError("counting() before begin()")
        with torch.no_grad():
            yield
        counts = routing.counted.clone()
        dist.all_reduce(counts)  # each layer's tokens are counted on its stage only, once each
        routing.global_counts = counts
        routing.counted.zero_()

    @contextlib.contextmanager
    def bind(self, batch: Batch, *, counting: bool = False) -> Iterator[None]:
        """The microbatch's rows, TP x CP group and the step's statistics for the replaced
        load-balancing methods inside the block (the routers' own groups are bound by
        ``binding.bind_cp_group``)."""
        seg = batch["segments"]
        seq_index = seg.seq_index
        if self.sequence_parallel and self.tp > 1:  # the router's SP slice
            seq_index = seq_index.chunk(self.tp)[self.tp_rank]
        if self.routing is None:  # another iterator's batches (an evaluation before a step)
            self.routing = self._new(0)
        context = moe.RouterContext(
            tp_cp_group=self.tp_cp_group(batch), seq_index=seq_index,
            seq_tokens=seg.seq_tokens, group_tokens=seg.group_tokens, step=self.routing,
            counting=counting)
        with moe.bind(context):
            yield

    def tp_cp_group(self, batch: Batch) -> dist.ProcessGroup:
        """The TP x CP group of ``batch``'s CP group (the CP group at tp 1)."""
        seg = batch["segments"]
        return self.groups.tp_cp_group(seg.rank_start, seg.cp_size)

    def report(self, loss_tokens: float) -> tuple[float | None, list[list[int]] | None]:
        """The step's load-balancing term and tokens per expert over every rank (collective;
        once per training step: a later call, an evaluation's, reports nothing)."""
        routing, self.routing = self.routing, None
        if routing is None:
            return None, None
        vec = torch.cat([routing.tokens_per_expert.reshape(-1), routing.aux.reshape(1),
                         routing.counted.reshape(-1)])
        dist.all_reduce(vec)  # every layer's tokens are on one stage, each on one rank
        size = routing.tokens_per_expert.numel()
        tokens_per_expert = vec[:size].reshape(routing.tokens_per_expert.shape)
        if routing.global_counts is not None:
            counted = vec[size + 1:].reshape(routing.counted.shape)
            if not torch.equal(counted, routing.global_counts):
                raise ValueError("global_aux_loss: the training forward routed otherwise than "
                                 "the statistics pass (non-deterministic kernels?): "
                                 f"{int((counted - routing.global_counts).abs().sum())} "
                                 "choices differ")
        aux = float(vec[size]) / max(loss_tokens, 1.0) if self.active else None
        return aux, [[int(x) for x in row] for row in tokens_per_expert.tolist()]
