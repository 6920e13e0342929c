"""Mixture-of-experts under runtime CP: each microbatch's groups in the router, padding that
routes nowhere, and load-balancing losses defined independently of how a step is packed.

Megatron's ``TopKRouter`` computes routing and its load-balancing loss per forward, over the
groups it was built with (``cp_group``, ``tp_cp_group``, ``tp_dp_cp_group``). A plan's model is
built without CP, and its microbatches carry groups of different sizes, so per microbatch
(``PlanJob.forward_step`` around the forward):

- the router's ``cp_group`` is the microbatch's CP group and ``tp_cp_group`` its TP x CP group
  (``GroupCatalog.tp_cp_group``; the CP group at tp 1), bound with the attention's
  (``binding.bind_cp_group``), never the build-time ones; ``bind`` gives the replaced
  load-balancing methods the same groups, the microbatch's rows and the step's statistics
  (``tp_dp_cp_group``, the stage's pool x TP group, is the build-time one and right);
- padding has no effect and counts in no statistic: its routing probabilities are zeroed after
  Megatron's routing (Megatron masks only its aux-loss inputs), so its expert outputs are
  weighted 0. It keeps its k dispatch slots: both releases' dropless alltoall dispatcher sizes
  its buffers as tokens x k (``num_out_tokens``), so a token routed to fewer experts breaks it;
  the cost is the padding's share of expert compute. The mask Megatron receives is converted
  at the adapter's boundary to the convention the
  installed release's code uses (``megatron_padding_mask``: 0.16.1 and 0.19.2 treat True as
  padding in router.py / moe_utils.py although some docstrings say the opposite; a probe of
  ``compute_routing_scores_for_aux_loss`` decides, so a release that flips it stays right).
  The batches' own ``padding_mask`` is True for a real token (``batch.py``).

**The load-balancing losses** (replacing ``TopKRouter._apply_aux_loss``, ``_apply_seq_aux_loss``
and ``_apply_global_aux_loss`` while a plan microbatch is bound; Megatron's routing, scores and
autograd attachment ``MoEAuxLossAutoScaler`` are its own). For a set U of real tokens at one
MoE layer, with per-token softmax scores p(x) over the E experts and top-k choices c(x)::

    LB(U) = E / (k |U|^2) * sum_i C_i(U) P_i(U),   C_i = sum_{x in U} c_i(x), P_i = sum p_i(x)

and the step's load-balancing term is ``coeff * sum_layers sum_units (|U| / N) LB(U)``, where N
is the step's loss-token count (the per-token loss's denominator, so the term is weighted as
the LM loss is). The unit is what each type balances over:

- ``aux_loss``: the microbatch's CP group, i.e. the packed buffer one group of k ranks (and its
  TP ranks) trains together. This depends on the packing by definition: the same step packed
  otherwise balances other token sets;
- ``seq_aux_loss``: each THD sequence (one plan row, a ``cu_seqlens`` entry), its counts
  reduced over its group's TP x CP ranks. Packing-independent: a sequence's unit is itself;
- ``global_aux_loss``: the whole step (every token of the global batch). Packing-independent.
  Megatron keeps a running average of the global counts over the step's microbatches
  (``_apply_global_aux_loss``), which depends on how the step is split and on the order; the
  exact statistic needs every microbatch's routing before any backward, so ``PlanJob`` runs a
  forward-only pass over the step first (``StepRouting.global_counts``): one extra forward per
  step, the price of exactness. The training forward checks that it routed the same way.

Every rank attaches ``coeff * E / (k |U|) * sum_i C_i(U) P_i(local)`` for each unit it holds
tokens of (C reduced over the unit's ranks, P over its own tokens), and ``finalize_model_grads``
divides by N, so the sum over ranks is the term above whatever the CP sizes; Megatron's own
multiplier (the local token count, times ``tp_cp`` size from 0.17 on) assumed evenly split
shards and differs between releases. ``StepRouting`` also counts each layer's tokens per expert
(real tokens, dispatch map) for the step log.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.adapters.megatron.compat import mcore

_BOUND: contextvars.ContextVar[RouterContext | None] = contextvars.ContextVar(
    "megatron_router_context", default=None)


@dataclass(slots=True)
class StepRouting:
    """One step's routing statistics on this rank (all layers of its stage)."""

    num_layers: int
    num_experts: int
    step_tokens: int
    """Real tokens of the whole step (all ranks): ``global_aux_loss``'s |U|."""
    device: torch.device
    tokens_per_expert: Tensor = field(init=False)
    """[num_layers, E] float64: this rank's real tokens per expert (dispatch map), training."""
    aux: Tensor = field(init=False)
    """This rank's attached load-balancing terms (before the division by N), summed."""
    global_counts: Tensor | None = None
    """[num_layers, E]: the step's top-k counts over every rank (``global_aux_loss``)."""
    counted: Tensor = field(init=False)
    """[num_layers, E]: top-k counts of the statistics pass (local) or of the training pass's
    aux inputs, for the check that both passes routed alike."""

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.num_experts)
        self.tokens_per_expert = torch.zeros(shape, dtype=torch.float64, device=self.device)
        self.aux = torch.zeros((), dtype=torch.float64, device=self.device)
        self.counted = torch.zeros(shape, dtype=torch.float64, device=self.device)


@dataclass(frozen=True, slots=True)
class RouterContext:
    """What the routers of one microbatch's forward need (bound by ``bind``)."""

    tp_cp_group: dist.ProcessGroup
    """The microbatch's TP x CP group (the one ``binding.bind_cp_group`` gives the routers)."""
    seq_index: Tensor
    """int64 [tokens the router sees]: each token's row (sequence) in the group."""
    seq_tokens: Tensor
    """float [rows]: real tokens of each row of the group (all its ranks)."""
    group_tokens: int
    """Real tokens of the group (all its ranks)."""
    step: StepRouting
    counting: bool = False
    """The statistics pass of ``global_aux_loss`` (forward only): count, attach nothing."""


@contextlib.contextmanager
def bind(context: RouterContext) -> Iterator[None]:
    """The routers inside the block use ``context`` (and its groups)."""
    token = _BOUND.set(context)
    try:
        yield
    finally:
        _BOUND.reset(token)


# ---- the padding mask at the adapter's boundary ------------------------------------------------

@functools.cache
def mask_marks_padding() -> bool:
    """Whether the installed Megatron's MoE code treats a True ``padding_mask`` entry as padding
    (probed once on a two-token example; an answer that is neither is an error)."""
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0]])
    _, scores = mcore.moe_utils.compute_routing_scores_for_aux_loss(
        logits, 1, "softmax", fused=False, padding_mask=torch.tensor([True, False]))
    kept = (scores.sum(-1) > 0).tolist()
    if kept == [False, True]:
        return True
    if kept == [True, False]:
        return False
    raise ImportError(f"megatron-core {mcore.VERSION}: its MoE padding mask has no convention "
                      f"the adapter knows (probe kept rows {kept})")


def megatron_padding_mask(real: Tensor) -> Tensor:
    """Megatron's ``padding_mask`` for a mask that is True on real tokens."""
    return ~real if mask_marks_padding() else real


def real_tokens(padding_mask: Tensor) -> Tensor:
    """True on real tokens, from the ``padding_mask`` Megatron passed on (flattened)."""
    mask = padding_mask.reshape(-1).bool()
    return ~mask if mask_marks_padding() else mask


# ---- Megatron's router, per microbatch ---------------------------------------------------------

def _layer(router: Any, step: StepRouting) -> int:
    index = int(router.layer_number) - 1
    assert 0 <= index < step.num_layers, (router.layer_number, step.num_layers)
    return index


def _routing(original: Any) -> Any:
    def routing(self: Any, logits: Tensor, padding_mask: Tensor | None = None) -> Any:
        ctx = _BOUND.get()
        if ctx is None:
            return original(self, logits, padding_mask=padding_mask)
        if padding_mask is None:
            raise AssertionError("the adapter passes every MoE layer a padding mask")
        probs, routing_map = original(self, logits, padding_mask=padding_mask)
        keep = real_tokens(padding_mask)[:, None]
        # Padding keeps its k dispatch slots (both releases' dropless dispatcher sizes its
        # buffers as tokens x k) with weight 0: it adds nothing to any output or gradient.
        probs = probs * keep.to(probs.dtype)
        layer = _layer(self, ctx.step)
        if ctx.counting:
            flat = logits.reshape(-1, self.config.num_moe_experts)
            aux_map, _ = mcore.moe_utils.compute_routing_scores_for_aux_loss(
                flat, self.topk, self.score_function, fused=self.config.moe_router_fusion,
                padding_mask=padding_mask.reshape(-1))
            ctx.step.counted[layer] += aux_map.sum(0).to(torch.float64)
        elif self.training and torch.is_grad_enabled():
            ctx.step.tokens_per_expert[layer] += (routing_map & keep).sum(0).to(torch.float64)
        return probs, routing_map
    return routing


def _attach(router: Any, ctx: RouterContext, probs: Tensor, term: Tensor) -> Tensor:
    ctx.step.aux += term.detach().to(torch.float64)
    out: Tensor = mcore.moe_router.MoEAuxLossAutoScaler.apply(probs, term)
    return out


def _reduced(counts: Tensor, group: dist.ProcessGroup) -> Tensor:
    if group.size() > 1:
        dist.all_reduce(counts, group=group)
    return counts


LoadBalancingTerm = Callable[[Any, RouterContext, Tensor, Tensor, float], Tensor]
"""A load-balancing term: (router, bound context, scores, routing map, coefficient) -> the
microbatch's term (its share of the step's, before it is attached to the probabilities)."""


def _load_balancing(kind: str, term: LoadBalancingTerm) -> Callable[[Any], Any]:
    """Megatron's ``_apply_<kind>`` replaced by ``term`` while a plan microbatch is bound:
    Megatron's own method outside one, the probabilities unchanged at coefficient 0."""
    def wrap(original: Any) -> Any:
        def apply(self: Any, probs: Tensor, scores: Tensor, routing_map: Tensor, *args: Any,
                  **kwargs: Any) -> Tensor:
            ctx = _BOUND.get()
            if ctx is None:
                out: Tensor = original(self, probs, scores, routing_map, *args, **kwargs)
                return out
            coeff = self.get_aux_loss_coeff(kind)
            if coeff == 0:
                return probs
            return _attach(self, ctx, probs, term(self, ctx, scores, routing_map, coeff))
        return apply
    return wrap


def _aux_loss_term(router: Any, ctx: RouterContext, scores: Tensor, routing_map: Tensor,
                   coeff: float) -> Tensor:
    # One unit: the group's packed buffer, counts over its TP x CP ranks.
    counts = _reduced(routing_map.sum(0).to(scores.dtype), ctx.tp_cp_group)
    weight = coeff * router.config.num_moe_experts / (router.topk * max(ctx.group_tokens, 1))
    term: Tensor = weight * (scores.sum(0) * counts).sum()
    return term


def _seq_aux_loss_term(router: Any, ctx: RouterContext, scores: Tensor, routing_map: Tensor,
                       coeff: float) -> Tensor:
    # One unit per THD sequence: its counts over the group's TP x CP ranks. Padding slots
    # carry zero scores and no choice (masked by Megatron), whatever row they sit in.
    ids = ctx.seq_index
    if ids.numel() != scores.shape[0]:
        raise AssertionError(f"router sees {scores.shape[0]} tokens, the batch {ids.numel()}")
    rows = ctx.seq_tokens.numel()
    experts = router.config.num_moe_experts
    counts = torch.zeros(rows, experts, dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, ids, routing_map.to(scores.dtype))
    counts = _reduced(counts, ctx.tp_cp_group)
    sums = torch.zeros(rows, experts, dtype=scores.dtype, device=scores.device).index_add(
        0, ids, scores)
    weight = coeff * experts / (router.topk * ctx.seq_tokens.to(scores.dtype).clamp(min=1))
    term: Tensor = (weight[:, None] * counts * sums).sum()
    return term


def _global_aux_loss_term(router: Any, ctx: RouterContext, scores: Tensor, routing_map: Tensor,
                          coeff: float) -> Tensor:
    # One unit: the step; its counts come from the statistics pass (routers.RouterSteps).
    step = ctx.step
    if step.global_counts is None:
        raise ValueError("global_aux_loss needs the step's routing statistics first: pass "
                         "the model to PlanJob.data_iterator(step, model)")
    layer = _layer(router, step)
    step.counted[layer] += routing_map.sum(0).to(torch.float64)
    counts = step.global_counts[layer].to(scores.dtype)
    weight = coeff * router.config.num_moe_experts / (router.topk * max(step.step_tokens, 1))
    term: Tensor = weight * (scores.sum(0) * counts).sum()
    return term


def install() -> None:
    """Wrap ``TopKRouter``'s routing and load-balancing methods (idempotent): each falls back to
    Megatron's own outside a plan microbatch (no ``bind``)."""
    cls: Any = mcore.moe_router.TopKRouter
    if getattr(cls, "_dcp_plan_routing", False):
        return
    cls.routing = _routing(cls.routing)
    for kind, term in (("aux_loss", _aux_loss_term), ("seq_aux_loss", _seq_aux_loss_term),
                       ("global_aux_loss", _global_aux_loss_term)):
        name = f"_apply_{kind}"
        setattr(cls, name, _load_balancing(kind, term)(getattr(cls, name)))
    cls._dcp_plan_routing = True
