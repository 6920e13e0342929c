"""What the Megatron oracle adds to the LM loss for a MoE model, every segment alone.

The oracle (``oracle.py``) runs each sample segment of a step as its own ``[1, L]`` batch through
the same ``GPTModel``, with Megatron's own load-balancing loss switched off
(``moe_aux_loss_coeff=0``): ``MoETerms`` computes it from its own reading of the definition in
``moe.py``, sharing no code with the distributed path. Each router's logits are captured during
the segment's forward; per MoE layer and token, scores are the softmax over the experts (fp32)
and the choices are the top-k of the scores. For a unit U of tokens (the step for
``global_aux_loss``, the segment for ``seq_aux_loss``, the tokens that the plan packs into one
CP group of one microbatch for ``aux_loss``)::

    term(U) = coeff * E / (k |U|) * sum_i C_i(U) * P_i(U)     (|U| / N * coeff * LB(U), times N)

with C the unit's top-k counts (constants: no gradient) and P its summed scores. The counts
need every segment of the unit before the first backward, so ``begin_step`` runs each segment
once without gradients (not for ``seq_aux_loss``, whose unit is the segment being run); then
each segment's term, ``sum_i C_i(U) * P_i(segment)`` weighted as
above, is added to its loss sum, and the step's division by its N loss tokens makes it the
term of the definition. The logged tokens per expert are the top-k of the logits (the choices
Megatron dispatches), summed over the step.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from runtime.adapters.megatron.compat import mcore
from runtime.data.plan_reader import PlanReader
from runtime.train.megatron_options import MegatronOptions
from runtime.train.oracle import Segment, SegmentLogits


class MoETerms:
    """The oracle's load-balancing term and tokens per expert (``runtime.train.oracle.
    SegmentTerms``) for ``model`` with ``options``' MoE flags."""

    def __init__(self, model: nn.Module, options: MegatronOptions, reader: PlanReader,
                 logits_of: SegmentLogits) -> None:
        self.reader, self.logits_of = reader, logits_of
        self.kind = options.load_balancing
        self.coeff = options.moe_aux_loss_coeff
        self.topk, self.experts = options.moe_router_topk, options.num_experts
        self.routers = {int(m.layer_number): m for m in model.modules()
                        if isinstance(m, mcore.moe_router.TopKRouter)}
        self.captured: dict[int, Tensor] = {}
        for layer, router in self.routers.items():
            router.routing = types.MethodType(self._capturing(layer, type(router).routing),
                                              router)
        self.layers = sorted(self.routers)

    def _capturing(self, layer: int, routing: Any) -> Any:
        def capture(router: Any, logits: Tensor, padding_mask: Tensor | None = None) -> Any:
            self.captured[layer] = logits.reshape(-1, self.experts)
            return routing(router, logits, padding_mask=padding_mask)
        return capture

    def _counts(self, logits: Tensor) -> Tensor:
        """[E] top-k choices of each token, summed (float64, no gradient)."""
        chosen = torch.topk(logits.detach().float(), self.topk, dim=-1).indices
        return torch.bincount(chosen.reshape(-1), minlength=self.experts).to(torch.float64)

    def _units(self, step: int, segments: list[Segment]) -> list[int]:
        """The unit of every segment (plan order, fillers skipped, as ``sequences_of_step``)."""
        plan = self.reader.step(step)
        real = plan.sample_index >= 0
        if self.kind == "global_aux_loss":
            units = np.zeros(int(real.sum()), dtype=np.int64)
        else:  # aux_loss: the segments one CP group of one microbatch packs together
            key = plan.microbatch.astype(np.int64) * (plan.pool_size + 1) + plan.rank_start
            units = np.unique(key[real], return_inverse=True)[1]
        assert len(units) == len(segments), (len(units), len(segments))
        return [int(u) for u in units]

    def begin_step(self, step: int, segments: list[Segment]) -> None:
        self.tokens_per_expert = torch.zeros(len(self.layers), self.experts, dtype=torch.float64)
        self.aux = 0.0
        self.weights: list[Tensor] = []
        if self.kind in (None, "seq_aux_loss"):  # seq_aux_loss: the segment's own counts
            return
        units = self._units(step, segments)
        counts = torch.zeros(max(units) + 1, len(self.layers), self.experts, dtype=torch.float64)
        sizes = torch.zeros(max(units) + 1, dtype=torch.float64)
        with torch.no_grad():
            for (seq, _, _), unit in zip(segments, units, strict=True):
                self.logits_of(seq)
                for j, layer in enumerate(self.layers):
                    counts[unit, j] += self._counts(self.captured[layer])
                sizes[unit] += len(seq)
        scale = self.coeff * self.experts / self.topk
        # Per segment: the weight of each (layer, expert) score sum in its unit's term.
        self.weights = [scale * counts[u] / sizes[u] for u in units]

    def extra(self, index: int) -> Tensor | None:
        for j, layer in enumerate(self.layers):
            self.tokens_per_expert[j] += self._counts(self.captured[layer])
        if self.kind is None:
            return None
        if self.kind == "seq_aux_loss":
            rows = self.captured[self.layers[0]].shape[0]
            counts = torch.stack([self._counts(self.captured[layer]) for layer in self.layers])
            weights = self.coeff * self.experts / self.topk * counts / rows
        else:
            weights = self.weights[index]
        term = sum((torch.softmax(self.captured[layer].float(), dim=-1).sum(0)
                    * weights[j].to(torch.float32)).sum()
                   for j, layer in enumerate(self.layers))
        assert isinstance(term, Tensor)
        self.aux += float(term.detach())
        return term

    def end_step(self, loss_tokens: float) -> dict[str, Any]:
        return {"moe_aux_loss": self.aux / max(loss_tokens, 1.0) if self.kind else None,
                "moe_tokens_per_expert": [[int(x) for x in row]
                                          for row in self.tokens_per_expert.tolist()]}


class MTPTerms:
    """The oracle's multi-token prediction term and per-depth losses (``runtime.train.oracle.
    SegmentTerms``): each segment alone, depth d trained on the segment's labels and loss mask
    moved d positions on (the last d positions get none), weighted ``mtp_loss_scaling_factor /
    D`` in the loss sum; ``mtp_logits`` holds the last segment's MTP logits ``[D * L, V]``
    (``oracle.segment_logits`` puts them there)."""

    def __init__(self, options: MegatronOptions, mtp_logits: dict[str, Tensor]) -> None:
        self.depth = options.mtp_num_layers
        self.scale = options.mtp_loss_scaling_factor / self.depth
        self.mtp_logits = mtp_logits
        self.segments: list[Segment] = []

    def begin_step(self, step: int, segments: list[Segment]) -> None:
        del step
        self.segments = segments
        self.sums = [0.0] * self.depth
        self.counts = [0.0] * self.depth

    def extra(self, index: int) -> Tensor | None:
        _, labels, mask = self.segments[index]
        n = len(labels)
        logits = self.mtp_logits["mtp"].reshape(self.depth, n, -1)
        term = torch.zeros((), dtype=torch.float32, device=labels.device)
        for d in range(1, self.depth + 1):
            moved = torch.zeros_like(labels)
            moved_mask = torch.zeros_like(mask, dtype=torch.float32)
            moved[:n - d] = labels[d:]
            moved_mask[:n - d] = mask[d:].float()
            losses = torch.nn.functional.cross_entropy(logits[d - 1].float(), moved,
                                                       reduction="none")
            total = (losses * moved_mask).sum()
            self.sums[d - 1] += float(total.detach())
            self.counts[d - 1] += float(moved_mask.sum())
            term = term + self.scale * total
        return term

    def end_step(self, loss_tokens: float) -> dict[str, Any]:
        del loss_tokens
        return {"mtp_loss": [s / max(c, 1.0) for s, c in zip(self.sums, self.counts,
                                                             strict=True)]}
