"""Workarounds for megatron-core 0.16.1, in one place: one function per workaround.

Two kinds:

- **CPU** (``apply_cpu_patches``, only when training on the CPU): Megatron-core assumes CUDA in
  a few device arguments and RNG calls; nothing numeric changes. Each patched upstream module
  gets its own ``torch`` name bound to ``_TorchView``, a view of torch whose ``torch.cuda.
  current_device()`` answers ``"cpu"``, whose ``torch.cuda.synchronize()`` does nothing and whose
  ``torch.zeros(..., device="cuda")`` allocates on the CPU. Only the named modules see it; torch
  itself is untouched.
- **Any device** (``apply_common_patches``): upstream behaviour that is wrong for this use on
  every backend: the padding-mask scatter that ignores the caller's TP group, and pipeline
  messages that gloo cannot tell apart with two pipeline stages.

Each function says which upstream file it works around and why; all are idempotent.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from runtime.adapters.megatron import mcore

_applied: set[str] = set()


def _once(name: str, fn: Callable[[], None]) -> None:
    if name not in _applied:
        fn()
        _applied.add(name)


class _HostStream:
    """A CUDA stream's waits, as no-ops: on the CPU every operation is already in order."""

    def wait_event(self, event: object) -> None:
        del event

    def wait_stream(self, stream: object) -> None:
        del stream

    def synchronize(self) -> None:
        pass


class _CpuCuda:
    """``torch.cuda`` as CPU-only code needs it: a device name, a no-op synchronize and a
    current stream whose waits do nothing."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: object = None) -> None:
        del device

    @staticmethod
    def current_stream(device: object = None) -> _HostStream:
        del device
        return _HostStream()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchView(types.ModuleType):
    """``torch`` as one upstream module sees it: torch itself, plus what the patches change.

    On the CPU (``send_cuda_to_cpu``) ``cuda`` is ``_CpuCuda`` and ``zeros(..., device="cuda")``
    allocates on the CPU; with ``pipeline_messages_tagged`` ``distributed`` tags P2P messages.
    """

    def __init__(self) -> None:
        super().__init__("torch")
        self.on_cpu = False

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def send_cuda_to_cpu(self) -> None:
        self.on_cpu = True
        self.cuda = _CpuCuda()

    def _device(self, device: Any) -> Any:
        return "cpu" if self.on_cpu and device == "cuda" else device

    def zeros(self, *size: Any, device: object = None, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = torch.zeros(*size, device=self._device(device),
                                        **kwargs)
        return out

    def tensor(self, data: Any, *, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, device=self._device(device), **kwargs)


def _view(module: types.ModuleType) -> _TorchView:
    view = getattr(module, "torch", None)
    if not isinstance(view, _TorchView):
        view = _TorchView()
        module.torch = view  # type: ignore[attr-defined]
    return view


def _redirect(module: types.ModuleType) -> None:
    _view(module).send_cuda_to_cpu()


def schedules_token_count_on_cpu() -> None:
    # pipeline_parallel/schedules.py: every schedule sums the per-token loss counts into
    # torch.zeros([], device="cuda").
    _redirect(mcore.schedules)


def p2p_buffers_on_cpu() -> None:
    # pipeline_parallel/p2p_communication.py: shape and receive buffers on
    # torch.cuda.current_device(), and torch.cuda.synchronize() after the shape exchange.
    _redirect(mcore.p2p_communication)


def sequence_parallel_buffers_on_cpu() -> None:
    # tensor_parallel/mappings.py (all-gather / reduce-scatter outputs) and
    # tensor_parallel/layers.py (the sequence-parallel all-gather in the backward of the linear
    # layers) allocate on torch.cuda.current_device().
    _redirect(mcore.tp_mappings)
    _redirect(mcore.tp_layers)


def rotary_on_cpu() -> None:
    # models/common/embeddings/rotary_pos_embedding.py: inv_freq moved to
    # torch.cuda.current_device() unless use_cpu_initialization.
    _redirect(mcore.rotary_pos_embedding)


def grad_buffers_on_cpu() -> None:
    # distributed/param_and_grad_buffer.py: DistributedDataParallel's contiguous param and grad
    # buffers are allocated on torch.cuda.current_device().
    _redirect(mcore.param_and_grad_buffer)


def optimizer_scalars_on_cpu() -> None:
    # optimizer/optimizer.py, optimizer/distrib_optimizer.py, optimizer/clip_grads.py, utils.py: the
    # optimizers keep found_inf / scale / norm scalars in torch.tensor(..., device="cuda") and
    # allocate shard buffers on torch.cuda.current_device().
    # utils.py's multi-tensor fallbacks (no Apex, no TE) return their norms in CUDA tensors.
    for module in (mcore.optimizer_module, mcore.distrib_optimizer, mcore.optimizer_clip_grads,
                   mcore.core_utils):
        _redirect(module)


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor",
                    torch.float16: "torch.cuda.HalfTensor"}


@contextlib.contextmanager
def _cuda_type_names(params: list[torch.Tensor]) -> Iterator[None]:
    """Each CPU parameter's ``type()`` names its CUDA twin inside the block (an instance
    attribute, removed afterwards: torch's method is untouched)."""
    named = []
    try:
        for p in params:
            name = _CUDA_TYPE_NAMES.get(p.dtype)
            if name is not None and p.device.type == "cpu" and "type" not in vars(p):
                p.type = functools.partial(_type_name, name)  # type: ignore[method-assign, assignment]
                named.append(p)
        yield
    finally:
        for p in named:
            del p.type


def _type_name(name: str, *args: Any, **kwargs: Any) -> str:
    if args or kwargs:
        raise TypeError("only type() without arguments is redirected")
    return name


def distributed_optimizer_accepts_cpu_params() -> None:
    # optimizer/distrib_optimizer.py (_build_model_and_main_param_groups) sorts parameters by
    # param.type() and refuses any that is not 'torch.cuda.FloatTensor', '...HalfTensor' or
    # '...BFloat16Tensor'; a CPU tensor's type is 'torch.FloatTensor'. During that call only,
    # the model's CPU parameters answer with their CUDA type name; every tensor operation is
    # the same.
    cls: Any = mcore.distrib_optimizer.DistributedOptimizer
    original = cls._build_model_and_main_param_groups  # a classmethod here, bound to cls

    def build(*args: Any, **kwargs: Any) -> Any:
        # The parameters are the keys of the param -> grad-buffer map among the arguments.
        params = [k for a in (*args, *kwargs.values()) if isinstance(a, dict)
                  for k in a if isinstance(k, torch.Tensor)]
        with _cuda_type_names(params):
            return original(*args, **kwargs)

    cls._build_model_and_main_param_groups = staticmethod(build)


def gradient_clipping_accepts_cpu_grads() -> None:
    # optimizer/clip_grads.py (clip_grad_by_total_norm_fp32, which optimizer/optimizer.py
    # imports by name) asserts param.grad.type() == 'torch.cuda.FloatTensor' before clipping.
    module: Any = mcore.optimizer_module
    original = module.clip_grad_by_total_norm_fp32

    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        with _cuda_type_names(grads):
            return original(params, *args, **kwargs)

    module.clip_grad_by_total_norm_fp32 = clip


def checkpoint_writer_on_cpu() -> None:
    # dist_checkpointing/strategies/filesystem_async.py (preload_tensors) calls
    # torch.cuda.synchronize() after copying the tensors to write to the host, and
    # state_dict_saver.py agrees on write failures in CUDA tensors.
    _redirect(mcore.filesystem_async)
    _redirect(mcore.state_dict_saver)


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


def rng_tracker_without_cuda() -> None:
    # tensor_parallel/random.py: the training RNG tracker stores CUDA RNG states
    # (model_parallel_cuda_manual_seed asserts CUDA) and every sequence-parallel embedding forks
    # it. Megatron's own inference tracker forks as a no-op; with dropout 0 (the adapter's
    # default) no random number is drawn, so nothing differs.
    mcore.tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


class _CpuMemoryBuffer(mcore.core_utils.GlobalMemoryBuffer):  # type: ignore[misc]
    """Megatron's scratch buffer (sequence-parallel all-gathers), allocated on the CPU."""

    def get_tensor(self, tensor_shape: list[int], dtype: torch.dtype, name: str,
                   mem_alloc_context: object = None) -> torch.Tensor:
        del mem_alloc_context
        need = math.prod(tensor_shape)
        key = (name, dtype)
        buf = self.buffer.get(key)
        if buf is None or buf.numel() < need:
            buf = self.buffer[key] = torch.empty(need, dtype=dtype, requires_grad=False)
        out: torch.Tensor = buf[:need].view(*tensor_shape)
        return out


def memory_buffer_on_cpu() -> None:
    # parallel_state.py / utils.py: tensor_parallel/layers.py takes its sequence-parallel
    # all-gather buffer from parallel_state's global GlobalMemoryBuffer, which allocates on
    # torch.cuda.current_device() (and exists only after initialize_model_parallel).
    if mcore.parallel_state._GLOBAL_MEMORY_BUFFER is None:
        mcore.parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()


def ensure_memory_buffer() -> None:
    """Megatron's global scratch buffer for sequence parallelism, on GPU (needs no parallel
    state: ``_set_global_memory_buffer`` only creates the buffer)."""
    if mcore.parallel_state._GLOBAL_MEMORY_BUFFER is None:
        mcore.parallel_state._set_global_memory_buffer()


def apply_cpu_patches() -> None:
    """Every CPU workaround (idempotent). Call before building the model."""
    for fn in (schedules_token_count_on_cpu, p2p_buffers_on_cpu, grad_buffers_on_cpu,
               optimizer_scalars_on_cpu, distributed_optimizer_accepts_cpu_params,
               gradient_clipping_accepts_cpu_grads, checkpoint_writer_on_cpu,
               distributed_optimizer_restores_torch_adam_steps,
               sequence_parallel_buffers_on_cpu, rotary_on_cpu, rng_tracker_without_cuda,
               memory_buffer_on_cpu):
        _once(fn.__name__, fn)


# ---- any device -----------------------------------------------------------------------------

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
    view = _view(mcore.p2p_communication)
    if not isinstance(view.__dict__.get("distributed"), _DistWithTags):
        setattr(view, "distributed", _DistWithTags("torch.distributed"))  # noqa: B010


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


class _TorchLoadsWeightsOnly(types.ModuleType):
    """``torch`` whose ``load`` never unpickles arbitrary objects (``weights_only=True``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(f: Any, *args: Any, weights_only: bool = True, **kwargs: Any) -> Any:
        del weights_only
        return torch.load(f, *args, weights_only=True, **kwargs)


@contextlib.contextmanager
def checkpoint_bytes_weights_only() -> Iterator[None]:
    # torch/distributed/checkpoint/default_planner.py (DefaultLoadPlanner.load_bytes), which
    # Megatron's torch_dist strategy loads through, reads every non-tensor object of a
    # checkpoint with torch.load(weights_only=False): a crafted shard file would run code.
    # During a Megatron checkpoint load it reads them with weights_only=True (tensors,
    # containers, numbers, strings and the classes Megatron registers as safe globals).
    import torch.distributed.checkpoint.default_planner as planner_module

    module: Any = planner_module
    saved = module.torch
    module.torch = _TorchLoadsWeightsOnly("torch")
    try:
        yield
    finally:
        module.torch = saved


def apply_common_patches() -> None:
    """The device-independent workarounds (idempotent). Call after ``apply_cpu_patches``."""
    for fn in (padding_mask_scatter_uses_model_group, pipeline_messages_tagged,
               quiet_upstream_warnings, sharded_state_uses_model_groups):
        _once(fn.__name__, fn)


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
        _once(te_cp_stream_for_dynamic_groups.__name__, te_cp_stream_for_dynamic_groups)
    apply_common_patches()
