"""The CPU workarounds for Megatron-core (0.16.1-0.19.x): one function per workaround.

Megatron-core assumes CUDA in device arguments, streams, RNG calls and a few ``type()`` checks;
on the CPU (gloo) nothing numeric changes. Each patched upstream module gets its own ``torch``
name bound to ``_TorchView``, a view of torch whose ``torch.cuda.current_device()`` answers
``"cpu"``, whose ``synchronize()`` and stream waits do nothing and whose ``torch.zeros`` /
``torch.tensor(..., device="cuda")`` allocate on the CPU. Only the named modules see it; torch
itself is untouched. ``apply_cpu_patches`` applies them all (idempotent); ``patches`` holds the
device-independent ones and ``apply_patches``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from runtime.adapters.megatron.compat import mcore

_applied: set[str] = set()


def once(name: str, fn: Callable[[], None]) -> None:
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

    def record_event(self, event: object = None) -> _HostStream:
        del event
        return self  # an event whose synchronize() and wait() return at once

    def wait(self, stream: object = None) -> None:
        del stream


_HOST_STREAM = _HostStream()
"""The one host "stream": every stream Megatron creates or asks for is this one, so its
"am I on a side stream" checks (token_dispatcher.py) answer no."""


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
        return _HOST_STREAM

    @staticmethod
    def Stream(*args: object, **kwargs: object) -> _HostStream:  # noqa: N802 - torch's name
        del args, kwargs
        return _HOST_STREAM

    @staticmethod
    def stream(stream: object) -> contextlib.AbstractContextManager[None]:
        del stream
        return contextlib.nullcontext()

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


def view(module: types.ModuleType) -> _TorchView:
    view = getattr(module, "torch", None)
    if not isinstance(view, _TorchView):
        view = _TorchView()
        module.torch = view  # type: ignore[attr-defined]
    return view


def _redirect(module: types.ModuleType) -> None:
    view(module).send_cuda_to_cpu()


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


def rng_tracker_without_cuda() -> None:
    # tensor_parallel/random.py: the training RNG tracker stores CUDA RNG states
    # (model_parallel_cuda_manual_seed asserts CUDA) and every sequence-parallel embedding forks
    # it. Megatron's own inference tracker forks as a no-op; with dropout 0 (the adapter's
    # default) no random number is drawn, so nothing differs.
    mcore.tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def recompute_rng_without_cuda() -> None:
    # tensor_parallel/random.py: a checkpointed region (activation recomputation) saves the CUDA
    # RNG state in its forward and restores it around the recomputation. The CPU RNG is saved
    # beside it by the same code; there is no CUDA state to keep.
    mcore.tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mcore.tp_random._set_cuda_rng_state = lambda *args, **kwargs: None


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


def moe_on_cpu() -> None:
    # transformer/moe/router.py moves the gate weight and its expert-bias and global-aux-loss
    # buffers to torch.cuda.current_device(); token_dispatcher.py creates a CUDA stream for its
    # device-to-host copies and waits on it; experts.py and moe_utils.py allocate on the current
    # device; transformer/multi_token_prediction.py allocates its roll buffers and loss tracker
    # there.
    for module in mcore.moe_modules():
        _redirect(module)


def router_gemm_without_te() -> None:
    # transformer/moe/moe_utils.py computes the router's logits with Transformer Engine's GEMM
    # whenever TE imports (te_general_gemm), which takes only CUDA tensors: the fp32 CPU oracle
    # beside a GPU run (TE installed) failed with "CUDAGuardImpl initialized with non-CUDA
    # DeviceType: cpu". Without it, moe_utils takes its torch.mm path (the same product).
    if getattr(mcore.moe_utils, "te_general_gemm", None) is not None:
        mcore.moe_utils.te_general_gemm = None


def apply_cpu_patches() -> None:
    """Every CPU workaround (idempotent). Call before building the model."""
    for fn in (schedules_token_count_on_cpu, p2p_buffers_on_cpu, grad_buffers_on_cpu,
               optimizer_scalars_on_cpu, distributed_optimizer_accepts_cpu_params,
               gradient_clipping_accepts_cpu_grads, checkpoint_writer_on_cpu,
               sequence_parallel_buffers_on_cpu, rotary_on_cpu, rng_tracker_without_cuda,
               recompute_rng_without_cuda, memory_buffer_on_cpu, moe_on_cpu,
               router_gemm_without_te):
        once(fn.__name__, fn)
