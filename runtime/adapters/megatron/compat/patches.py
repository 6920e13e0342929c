"""Workarounds for Megatron-core (0.16.1-0.19.x) on any device, and ``apply_patches`` (the
device's and the common ones): one function per workaround.

- **CPU** (``cpu_patches``, only when training on the CPU): Megatron-core's CUDA assumptions
  sent to the host; nothing numeric changes.
- **Any device** (here): upstream behaviour that is wrong for this use on every backend: the
  padding-mask scatter that ignores the caller's TP group, pipeline messages that gloo cannot
  tell apart with two pipeline stages, checkpoint replica ids read from the global
  ``parallel_state``, torch AdamW's step lost by the distributed optimizer's load (no Apex or
  TE), TE's CP stream, and three known upstream warnings. (Objects in checkpoint shards load
  as data through ``runtime.train.dcpsafe``.)

Each function says which upstream file it works around and why; all are idempotent.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from runtime.adapters.megatron.compat import mcore
from runtime.adapters.megatron.compat.cpu_patches import (
    apply_cpu_patches,
    ensure_memory_buffer,
    once,
    view,
)


def distributed_optimizer_restores_torch_adam_steps() -> None:
    # optimizer/distrib_optimizer.py (load_state_dict), without Apex or TE (torch's AdamW, the
    # CPU): it puts the checkpoint's step into one tensor shared by every parameter's state,
    # then load_parameter_state_from_dp_reshardable copies the live optimizer's per-parameter
    # step over it (0 in a fresh run), so a resumed run restarts Adam's bias correction; and
    # AdamW would advance the shared tensor once per parameter. After the load, each state
    # gets its own step tensor holding the checkpoint's step (its param group's).
    cls: Any = mcore.distrib_optimizer.DistributedOptimizer
    original = cls.load_state_dict

    def load_state_dict(self: Any, state_dict: Any) -> None:
        original(self, state_dict)
        inner = self.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            return
        saved = state_dict["optimizer"]["param_groups"]
        for group, saved_group in zip(inner.param_groups, saved, strict=True):
            if "step" not in saved_group:
                continue
            for p in group["params"]:
                state = inner.state.get(p)
                if state is not None and "step" in state:
                    state["step"] = torch.tensor(float(saved_group["step"]), dtype=torch.float32)

    cls.load_state_dict = load_state_dict


def optimizer_state_loads_without_grad() -> None:
    # optimizer/distrib_optimizer.py (_set_main_param_and_optimizer_states), the dp-reshardable
    # load Megatron-LM's checkpoints use: in fp32 the distributed optimizer's main parameter is a
    # view of the model's (a leaf that requires grad), and the in-place copy of the saved value
    # raises "a view of a leaf Variable that requires grad is being used in an in-place
    # operation". The copy is a load, not a computation: it runs without autograd.
    cls: Any = mcore.distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: Any) -> None:
        with torch.no_grad():
            original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = set_states


_SP_GROUP: contextvars.ContextVar[dist.ProcessGroup | None] = contextvars.ContextVar(
    "megatron_sp_group", default=None)


class _TensorParallelWithGroup(types.ModuleType):
    """``megatron.core.tensor_parallel`` whose sequence-parallel scatter defaults its group to
    the one bound by ``sequence_parallel_group``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(mcore.tensor_parallel, name)

    @staticmethod
    def scatter_to_sequence_parallel_region(input_: torch.Tensor,
                                            group: dist.ProcessGroup | None = None
                                            ) -> torch.Tensor:
        group = group if group is not None else _SP_GROUP.get()
        out: torch.Tensor = mcore.tensor_parallel.scatter_to_sequence_parallel_region(
            input_, group=group)
        return out


def padding_mask_scatter_uses_model_group() -> None:
    # models/gpt/gpt_model.py (_preprocess): under sequence parallelism the padding mask is
    # scattered with tensor_parallel.scatter_to_sequence_parallel_region(mask) and no group, so a
    # model built from a pg_collection (no global parallel state) fails with "group should not
    # be None". The forward step binds the model's TP group around each forward.
    mod = mcore.gpt_model_module
    if not isinstance(mod.tensor_parallel, _TensorParallelWithGroup):
        mod.tensor_parallel = _TensorParallelWithGroup("tensor_parallel")


@contextlib.contextmanager
def sequence_parallel_group(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Bind the TP group that ``padding_mask_scatter_uses_model_group`` hands upstream."""
    token = _SP_GROUP.set(group)
    try:
        yield
    finally:
        _SP_GROUP.reset(token)


class _Peer(int):
    """A peer's global rank that remembers whether it is the next or the previous stage."""

    direction: str = ""


def _peer(rank: int, direction: str) -> _Peer:
    p = _Peer(rank)
    p.direction = direction
    return p


class _DistWithTags(types.ModuleType):
    """``torch.distributed`` whose ``P2POp`` tags a message by its direction along the pipe."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def P2POp(op: Callable[..., Any], tensor: torch.Tensor, peer: int | None = None,  # noqa: N802
              group: dist.ProcessGroup | None = None, tag: int = 0) -> dist.P2POp:
        direction = getattr(peer, "direction", "")
        if direction:
            # Tag 1 for messages that travel forward (sent to next, received from previous),
            # tag 2 for those that travel backward, so a receive can only match its own kind.
            forward = (op is dist.isend) == (direction == "next")
            tag = 1 if forward else 2
        return dist.P2POp(op, tensor, None if peer is None else int(peer), group, tag)


class TaggedP2PCommunicator(mcore.P2PCommunicator):  # type: ignore[misc]
    """Megatron's ``P2PCommunicator`` whose messages carry their direction as a tag.

    Works around pipeline_parallel/p2p_communication.py with two stages: the previous and the
    next stage are the same rank, and the interleaved schedule posts a send to it in both
    directions in one batch (activations forward, gradients backward) with the same tag. gloo
    matches messages by (peer, tag), so an activation shape could land in the gradient's
    receive (seen with vpp 2 x pp 2 and variable sequence lengths). NCCL ignores tags.
    """

    def __init__(self, pp_group: dist.ProcessGroup, config: Any) -> None:
        super().__init__(pp_group, config)
        self.next_rank: int = _peer(int(self.next_rank), "next")
        self.prev_rank: int = _peer(int(self.prev_rank), "prev")


def pipeline_messages_tagged() -> None:
    # pipeline_parallel/p2p_communication.py builds its P2POps through the module's own
    # torch.distributed; TaggedP2PCommunicator's peers say which way each message goes.
    torch_view = view(mcore.p2p_communication)
    if not isinstance(torch_view.__dict__.get("distributed"), _DistWithTags):
        setattr(torch_view, "distributed", _DistWithTags("torch.distributed"))  # noqa: B010


def quiet_upstream_warnings() -> None:
    # Megatron's DDP and distributed optimizer call torch.distributed.all_gather_into_tensor and
    # reduce_scatter_tensor, which torch 2.13 deprecates (a FutureWarning per call), and
    # optimizer/optimizer.py reads .grad of non-leaf main-param views (a UserWarning each
    # step); none concerns this project's use. Only these messages are silenced.
    for message in (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                    r"`torch\.distributed\.reduce_scatter_tensor` is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a "
                            r"leaf Tensor", category=UserWarning,
                            module=r"megatron\.core\.optimizer")


_STATE_GROUPS: contextvars.ContextVar[tuple[dist.ProcessGroup, dist.ProcessGroup] | None] = (
    contextvars.ContextVar("megatron_state_groups", default=None))


class _ParallelStateWithGroups(types.ModuleType):
    """``megatron.core.parallel_state`` whose TP and DP ranks (and groups) are those bound by
    ``checkpoint_groups`` while it is bound, and Megatron's global state otherwise."""

    def __getattr__(self, name: str) -> Any:
        return getattr(mcore.parallel_state, name)

    @staticmethod
    def _bound(index: int) -> dist.ProcessGroup | None:
        groups = _STATE_GROUPS.get()
        return None if groups is None else groups[index]

    def get_tensor_model_parallel_rank(self) -> int:
        group = self._bound(0)
        if group is None:
            return int(mcore.parallel_state.get_tensor_model_parallel_rank())
        return dist.get_rank(group)

    def get_data_parallel_rank(self, with_context_parallel: bool = False,
                               partial_data_parallel: bool = False) -> int:
        group = self._bound(1)
        if group is None:
            return int(mcore.parallel_state.get_data_parallel_rank(
                with_context_parallel=with_context_parallel,
                partial_data_parallel=partial_data_parallel))
        return dist.get_rank(group)  # the pool: no static CP, one optimizer instance

    def get_data_parallel_group(self, with_context_parallel: bool = False,
                                partial_data_parallel: bool = False) -> Any:
        group = self._bound(1)
        if group is None:
            return mcore.parallel_state.get_data_parallel_group(
                with_context_parallel=with_context_parallel,
                partial_data_parallel=partial_data_parallel)
        return group


def sharded_state_uses_model_groups() -> None:
    # models/common/language_module/language_module.py (the last stage's tied output weight)
    # and transformer/utils.py (make_sharded_object_for_checkpoint: TE's extra state) take the
    # replica ids of checkpoint shards from the global parallel_state, not from the model's
    # pg_collection or the metadata's dp_cp_group, so a model built from a pg_collection fails
    # ("data parallel group ... is not initialized"). The checkpoint binds the job's TP and
    # pool groups around every sharded_state_dict call (checkpoint_groups).
    for module in (mcore.language_module, mcore.transformer_utils):
        if not isinstance(module.parallel_state, _ParallelStateWithGroups):
            module.parallel_state = _ParallelStateWithGroups("parallel_state")


@contextlib.contextmanager
def checkpoint_groups(tp: dist.ProcessGroup, pool: dist.ProcessGroup) -> Iterator[None]:
    """Bind the TP and pool groups that ``sharded_state_uses_model_groups`` hands upstream."""
    token = _STATE_GROUPS.set((tp, pool))
    try:
        yield
    finally:
        _STATE_GROUPS.reset(token)


_TE_FUSED_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                   "fused_permute_with_probs", "fused_sort_chunks_by_index",
                   "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
                   "fused_unpermute", "te_general_gemm")


def moe_utils_names_without_te() -> None:
    # transformer/moe/moe_utils.py (0.16.1) imports TE's fused MoE kernels in a try block and,
    # without TE, leaves the names undefined, so the router's gate (router_gating_linear reads
    # te_general_gemm) fails with NameError; 0.19 sets them to None. Here too, where missing.
    module = mcore.moe_utils
    for name in _TE_FUSED_NAMES:
        if not hasattr(module, name):
            setattr(module, name, None)


def mtp_gather_uses_model_group() -> None:
    # transformer/multi_token_prediction.py (0.16.1, _concat_embeddings) gathers eh_proj's
    # output with gather_from_tensor_model_parallel_region(h) and no group (parallel_state's,
    # absent here); 0.19 passes the layer's. The group bound around the forward, or none (the
    # oracle: tp 1), where the gather is the identity (the adapter runs MTP at tp 1 only).
    module = mcore.multi_token_prediction
    original = module.gather_from_tensor_model_parallel_region
    if getattr(original, "_dcp_plan", False):
        return

    def gather(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        group = group if group is not None else _SP_GROUP.get()
        if group is None or group.size() == 1:
            return input_
        out: torch.Tensor = original(input_, group=group)
        return out

    gather._dcp_plan = True  # type: ignore[attr-defined]
    module.gather_from_tensor_model_parallel_region = gather


def apply_common_patches() -> None:
    """The device-independent workarounds (idempotent). Call after ``apply_cpu_patches``."""
    for fn in (padding_mask_scatter_uses_model_group, pipeline_messages_tagged,
               quiet_upstream_warnings, sharded_state_uses_model_groups,
               distributed_optimizer_restores_torch_adam_steps, moe_utils_names_without_te,
               mtp_gather_uses_model_group, optimizer_state_loads_without_grad):
        once(f"{fn.__module__}.{fn.__name__}", fn)


def te_cp_stream_for_dynamic_groups() -> None:
    # extensions/transformer_engine.py creates TEDotProductAttention's CP stream only for a model
    # built with context_parallel_size > 1; a plan's model is built with 1 and its microbatches
    # bind groups of 2 or more through PackedSeqParams.cp_group, which then reach TE's ring
    # without the side stream it overlaps with. GPU only; nothing to do where TE is absent.
    try:
        cls: Any = mcore.te_attention_class()
    except Exception:  # noqa: BLE001 - TE raises ImportError, RuntimeError or OSError
        return
    if getattr(cls, "cp_stream", None) is None:
        cls.cp_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]


def apply_patches(device: torch.device) -> None:
    """The workarounds for training on ``device``: CPU ones first, then the common ones."""
    if device.type == "cpu":
        apply_cpu_patches()
    else:
        ensure_memory_buffer()
        once(te_cp_stream_for_dynamic_groups.__name__, te_cp_stream_for_dynamic_groups)
    apply_common_patches()
