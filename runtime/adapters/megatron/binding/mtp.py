"""Multi-token prediction (``--mtp-num-layers``) inside Megatron's GPTModel, under runtime CP.

Megatron's ``MultiTokenPredictionBlock`` (the model's last stage) keeps its layers, weights and
forward; three things around it are the adapter's:

- **the shifted inputs.** Each MTP layer shifts the token ids and positions it embeds by one
  (``roll_tensor``). Megatron's packed-sequence roll splits the *real* lengths evenly over the
  CP ranks of the build-time group, which fits neither zigzag padding nor a CP size that varies
  per microbatch. While a plan microbatch is bound (``bind``, from ``forward_step``) the roll is
  a gather through the data side's successor map (``runtime.data.mtp``) over the microbatch's
  CP group: exact, never across a sequence or into padding, one all-gather of ``[slots]``
  integers per roll when the group has several ranks. Outside a plan microbatch (the oracle,
  one whole segment) Megatron's own roll runs.
- **the loss.** Megatron computes the MTP loss inside ``GPTModel._postprocess`` with its
  vocab-parallel cross entropy (the global ``parallel_state``) and, from 0.19 on, scales each
  microbatch's term by its local token counts (which depends on how the plan split the step).
  Here the block's output is handed on as logits instead (``mtp_num_layers`` reads None from
  the block's return to the end of the model's forward, so ``_postprocess`` runs the output
  layer over all 1 + D hidden-state chunks): ``loss.loss_func`` adds
  ``mtp_loss_scaling_factor / D * sum_d sum_i mask_d(i) CE_d(i)`` to the LM loss sum, divided
  by the step's LM loss tokens with it (0.16.1's per-token definition, for every release);
- **the build.** 0.16.1's block takes its groups and its layers' offset from ``parallel_state``
  and 0.19.2's model asks ``parallel_state`` whether the block belongs on this stage; a plan's
  model has no ``parallel_state``, so ``building(pg_collection)`` answers from the chunk's own
  groups
  (the spec is given to the last stage's chunk only: ``block_spec``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.adapters.megatron.binding.refusal import Refusal, config_message
from runtime.adapters.megatron.compat import mcore

_BOUND: contextvars.ContextVar[MTPContext | None] = contextvars.ContextVar(
    "megatron_mtp_context", default=None)


@dataclass(frozen=True, slots=True)
class MTPContext:
    """One microbatch's shift map and CP group (the rolls of its forward)."""

    successor: Tensor
    """int64 [slots]: ``runtime.data.mtp.MTPInputs.successor``."""
    group: dist.ProcessGroup
    """The microbatch's CP group."""


@contextlib.contextmanager
def bind(context: MTPContext | None) -> Iterator[None]:
    """Megatron's MTP rolls inside the block use ``context`` (None: Megatron's own)."""
    token = _BOUND.set(context)
    try:
        yield
    finally:
        _BOUND.reset(token)


def shift(tensor: Tensor, context: MTPContext) -> Tensor:
    """``tensor`` [..., slots] shifted one position on within each sequence of the group (0 at
    a sequence's last real token and on padding)."""
    succ = context.successor
    if tensor.shape[-1] != succ.numel():
        raise AssertionError(f"MTP roll of {tuple(tensor.shape)} with a map of {succ.numel()} "
                             "slots")
    flat = tensor.contiguous()
    if context.group.size() > 1:
        parts = [torch.empty_like(flat) for _ in range(context.group.size())]
        dist.all_gather(parts, flat, group=context.group)
        flat = torch.cat(parts, dim=-1)
    out = flat[..., succ.clamp(min=0)]
    return out.masked_fill(succ < 0, 0)


def _roll(original: Any) -> Any:
    def roll_tensor(tensor: Any, shifts: int = -1, dims: int = -1, cp_group: Any = None,
                    packed_seq_params: Any = None) -> Any:
        ctx = _BOUND.get()
        if ctx is None or tensor is None:
            return original(tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                            packed_seq_params=packed_seq_params)
        if shifts != -1 or dims not in (-1, tensor.dim() - 1):
            raise AssertionError(f"MTP roll by {shifts} along {dims}: the adapter shifts by one "
                                 "along the sequence")
        out = shift(tensor, ctx)
        return out, out.sum()
    return roll_tensor


def _block_forward(original: Any) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        # From here to the end of the model's forward, _postprocess sees no MTP: it runs the
        # output layer over every chunk and returns logits (GPTModel.forward restores it).
        self.config.mtp_num_layers = None
        return out
    return forward


def _model_forward(original: Any) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = self.config.mtp_num_layers
        try:
            return original(self, *args, **kwargs)
        finally:
            self.config.mtp_num_layers = depth
    return forward


def install() -> None:
    """Wrap Megatron's MTP roll, block and model forward (idempotent)."""
    module: Any = mcore.multi_token_prediction
    if getattr(module, "_dcp_plan_mtp", False):
        return
    module.roll_tensor = _roll(module.roll_tensor)
    block: Any = module.MultiTokenPredictionBlock
    block.forward = _block_forward(block.forward)
    model: Any = mcore.GPTModel
    model.forward = _model_forward(model.forward)
    module._dcp_plan_mtp = True


def mtp_refusals(config: Any, *, tp: int, vpp: int) -> list[Refusal]:
    """Every multi-token prediction setting of ``config`` the adapter cannot run (none without
    MTP)."""
    if not config.mtp_num_layers:
        return []
    checks = {
        "tensor_model_parallel_size": (
            tp > 1, "the MTP logits are concatenated along the sequence, which sequence "
            "parallelism splits over the TP ranks: plan with --tp 1", None),
        "virtual_pipeline_model_parallel_size": (
            vpp > 1, "the MTP block is tested on the last of plain pipeline stages: plan "
            "without --vpp", None),
        "pipeline_model_parallel_layout": (
            getattr(config, "pipeline_model_parallel_layout", None) is not None,
            "the MTP block sits on the last stage", "None"),
        "mtp_use_repeated_layer": (
            bool(getattr(config, "mtp_use_repeated_layer", False)), "one layer per depth",
            "False"),
        "mtp_num_layers": (config.mtp_num_layers < 0, "a depth >= 1", None),
    }
    return [Refusal(name, why, want) for name, (refused, why, want) in checks.items() if refused]


def check_config(config: Any, *, tp: int, vpp: int) -> None:
    """Refuse a multi-token prediction config the adapter cannot run (the same ValueError on
    every rank, at start-up), saying what to use instead (``mtp_refusals``)."""
    bad = mtp_refusals(config, tp=tp, vpp=vpp)
    if bad:
        raise ValueError("multi-token prediction the adapter cannot run under dynamic CP: "
                         + config_message(config, bad))


def block_spec(layer_spec: Any, config: Any, *, use_te: bool) -> Any:
    """The MTP block spec of a last-stage chunk whose decoder layers are ``layer_spec`` (a block
    spec or a layer spec): ``mtp_num_layers`` copies of Megatron's MTP layer around it."""
    module: Any = mcore.multi_token_prediction
    layer = layer_spec.layer_specs[-1] if hasattr(layer_spec, "layer_specs") else layer_spec
    mtp_layer = module.get_mtp_layer_spec(layer, use_te)
    return module.MultiTokenPredictionBlockSubmodules(
        layer_specs=[mtp_layer] * int(config.mtp_num_layers))


@contextlib.contextmanager
def building(pg_collection: Any) -> Iterator[None]:
    """A chunk given an MTP spec builds its block from ``pg_collection`` (see the module
    docstring): 0.16.1's ``ProcessGroupCollection.use_mpu_process_groups`` and 0.19's
    ``mtp_on_this_rank`` answer from it inside the block."""
    pgc_cls: Any = mcore.ProcessGroupCollection
    gpt: Any = mcore.gpt_model_module
    block: Any = mcore.multi_token_prediction
    saved_mpu = pgc_cls.__dict__["use_mpu_process_groups"]
    saved_on = getattr(gpt, "mtp_on_this_rank", None)
    saved_offset = getattr(block, "get_transformer_layer_offset", None)
    pp = pg_collection.pp
    pp_rank = dist.get_rank(group=pp) if pp is not None else 0
    layers: Any = mcore.tp_layers
    saved_tp = layers.get_tensor_model_parallel_group_if_none
    pgc_cls.use_mpu_process_groups = classmethod(lambda cls, required_pgs=None: pg_collection)
    # 0.16.1's MTP layer builds its eh_proj without a TP group (parallel_state's, absent here).
    layers.get_tensor_model_parallel_group_if_none = (
        lambda tp_group, is_expert=False, check_initialized=True:
        pg_collection.tp if tp_group is None else tp_group)
    if saved_on is not None:
        gpt.mtp_on_this_rank = lambda *args, **kwargs: True  # the spec is given where it runs
    if saved_offset is not None:  # 0.16.1's MTP layer asks for its offset without a pp rank
        def offset(config: Any, vp_stage: int | None = None, rank: int | None = None) -> int:
            out: int = saved_offset(config, vp_stage, pp_rank if rank is None else rank)
            return out
        block.get_transformer_layer_offset = offset
    try:
        yield
    finally:
        pgc_cls.use_mpu_process_groups = saved_mpu
        layers.get_tensor_model_parallel_group_if_none = saved_tp
        if saved_on is not None:
            gpt.mtp_on_this_rank = saved_on
        if saved_offset is not None:
            block.get_transformer_layer_offset = saved_offset
