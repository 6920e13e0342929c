"""What Megatron-LM's ``pretrain()`` needs on a host without CUDA: one function per patch.

Megatron-core's own CPU workarounds (``runtime.adapters.megatron.compat.cpu_patches``: the
schedules, P2P, DDP buffers, optimizers, clipping, the checkpoint writer, RoPE, the RNG
tracker) still apply; these are the ones Megatron-LM's loop adds on top (core_v0.19.0 lines).
Each patched module gets the same ``_TorchView`` of torch (``cpu_patches.view``), whose
``cuda`` answers for the CPU; the rest are attribute patches on Megatron-LM's modules. Nothing
numeric changes: every patched site moves a scalar, a timestamp or an RNG state between
devices, synchronises, or checks for a GPU. ``apply()`` runs them all (idempotent).

What the launcher sets on the arguments instead (``flags.adjust`` and below): gloo,
``--rerun-mode disabled`` and ``--use-cpu-initialization`` (which skips
``model_module.cuda()``, ``dist_utils.py:174`` / ``training.py`` ``get_model``).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from runtime.adapters.megatron.compat import cpu_patches, mcore
from runtime.adapters.megatron_lm import mlm


class _CpuCudaForLoop(cpu_patches._CpuCuda):
    """``torch.cuda`` as Megatron-LM's loop asks it on the CPU: available to ``initialize``
    only (``initialize.py:66`` asserts it; elsewhere, as ``update_seqlen_stats_from_cu_seqlens``,
    it would pick a CUDA device), no devices (so no CUDA seeding, ``initialize.py:447``), the
    CPU RNG for the checkpoint's "CUDA" RNG state (``checkpointing.py:417``)."""

    devices = 0

    def __init__(self, available: bool) -> None:
        self.available = available

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return _CpuCudaForLoop.devices

    @staticmethod
    def set_device(device: object) -> None:
        del device

    @staticmethod
    def get_rng_state(device: object = None) -> torch.Tensor:
        del device
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: object = None) -> None:
        del state, device  # the CPU RNG is restored from its own entry of the checkpoint


def _redirect(module: Any, *, available: bool = False) -> None:
    if module is None:
        return
    view = cpu_patches.view(module)
    view.send_cuda_to_cpu()
    view.cuda = _CpuCudaForLoop(available)


def loop_modules_on_cpu() -> None:
    # initialize.py:66 (CUDA assert), training.py:1131-1138 (startup timestamps on 'cuda'),
    # 4588 (do_train/valid flags), 2613/2884/4270 (loss and log tensors), core/timers.py:152-303
    # (synchronize, log buffer), training/utils/common_utils.py:285-308 (current_device),
    # checkpointing.py:375/417 (metadata tensor, RNG state), models/dist_utils.py:303-366 (DDP
    # stream).
    _redirect(mlm.initialize, available=True)
    for module in (mlm.training, mcore.timers, mlm.checkpointing, mlm.training_common_utils,
                   mlm.dist_utils, mlm.training_utils):
        _redirect(module)


@contextlib.contextmanager
def megatron_builds_its_groups() -> Iterator[None]:
    """Inside ``_initialize_distributed``: one "device", so that Megatron-LM runs
    ``mpu.initialize_model_parallel`` (``initialize.py:358`` skips it without a GPU)."""
    _CpuCudaForLoop.devices = 1
    try:
        yield
    finally:
        _CpuCudaForLoop.devices = 0


def no_jit_warmup() -> None:
    # initialize.py:497-558: _warmup_jit_function runs the fused bias-gelu / dropout kernels on
    # torch.rand(device="cuda") tensors (called from set_jit_fusion_options, training.py:1117).
    mlm.initialize._warmup_jit_function = lambda *args, **kwargs: None


def device_arch_on_cpu() -> None:
    # arguments.py:1413: with tp > 1, validate_args reads the GPU's compute capability
    # (get_device_properties raises without CUDA); 0 is "before Blackwell", its CPU meaning.
    mlm.arguments.get_device_arch_version = lambda: 0


def tied_embeddings_synced_on_cpu() -> None:
    # language_module.py:304-308: with tied embeddings under pipeline parallelism the first and
    # last stage all-reduce their copies at construction, after weight.data.cuda() (a tensor
    # method no view reaches). The same all-reduce, on the CPU tensor.
    cls = mcore.language_module.LanguageModule
    original = cls.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup(self: Any) -> None:
        config = self.config
        meta = config.init_model_with_meta_device
        config.init_model_with_meta_device = True  # skips the .cuda() and the all-reduce
        try:
            original(self)
        finally:
            config.init_model_with_meta_device = meta
        if dist.is_initialized() and not meta and self._is_in_embd_group():
            dist.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)

    cls.setup_embeddings_and_output_layer = setup


class _TrackerOnCpu:
    """The RNG tracker as Megatron-LM's checkpoints see it on the CPU: the adapter's tracker
    (Megatron's inference tracker: no CUDA states) saves one empty entry, because a load of an
    empty dict exits the job (``checkpointing.py:2668``: "Unable to load rng state"); loading
    sets nothing."""

    def get_states(self) -> dict[str, torch.Tensor]:
        return {"cpu-host": torch.zeros(0, dtype=torch.uint8)}

    def set_states(self, states: object) -> None:
        del states

    def __getattr__(self, name: str) -> Any:
        return getattr(mcore.tp_random.get_cuda_rng_tracker(), name)


class _TensorParallelForCheckpoints(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("megatron.core.tensor_parallel")

    def __getattr__(self, name: str) -> Any:
        return getattr(mcore.tensor_parallel, name)

    @staticmethod
    def get_cuda_rng_tracker() -> _TrackerOnCpu:
        return _TrackerOnCpu()


def rng_tracker_state_on_cpu() -> None:
    # checkpointing.py:417 (save) and 2629-2684 (load) through its own tensor_parallel name.
    mlm.checkpointing.tensor_parallel = _TensorParallelForCheckpoints()


def apply() -> None:
    """Every patch above, once per process (after ``compat.patches.apply_patches``)."""
    for fn in (loop_modules_on_cpu, no_jit_warmup, device_arch_on_cpu,
               tied_embeddings_synced_on_cpu, rng_tracker_state_on_cpu):
        cpu_patches.once(f"{fn.__module__}.{fn.__name__}", fn)
