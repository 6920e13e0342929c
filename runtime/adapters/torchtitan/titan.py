"""The only module that imports torchtitan (pinned: 0.3.0), and every workaround it needs.

The rest of ``runtime.adapters.torchtitan`` takes torchtitan's classes from here, so an upgrade
touches one file: the names below, and the workarounds, each a function with the upstream file
it works around and why. None of them changes numerics; all are about CUDA-only assumptions on a
CPU host (CI) and gloo's missing reduce op. The torch names torchtitan 0.3.0 needs from a torch
newer than the GPU machines' 2.11 are supplied by ``compat`` (only where missing), first.

Import order matters for the first one: torchtitan decides its device type once, when
``torchtitan/tools/utils.py`` is first imported, so it is imported here under the CPU fallback
before anything else of torchtitan.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch._utils

from runtime.adapters.torchtitan import compat
from runtime.train.quiet import KnownWarning, quiet

TORCHTITAN_VERSION = "0.3.0"


def _import_with_cpu_device_type() -> None:
    """``torchtitan/tools/utils.py`` sets ``device_type = _get_available_device_type() or
    "cuda"`` at import, so a host without an accelerator would allocate on "cuda". Answer "cpu"
    for the duration of that one import (the attribute is then read by every other module)."""
    original = torch._utils._get_available_device_type

    def with_cpu_fallback() -> str | None:
        found: str | None = original()  # type: ignore[no-untyped-call]
        return found or "cpu"

    torch._utils._get_available_device_type = with_cpu_fallback
    try:
        import torchtitan.tools.utils  # noqa: F401 - evaluated once, under the fallback
    finally:
        torch._utils._get_available_device_type = original
    _cpu_device_type_if_imported_before()


def _cpu_device_type_if_imported_before() -> None:
    """A job that imported torchtitan before this module (``from torchtitan.config import
    ...`` first, isort's order) on a host without an accelerator: ``tools/utils.py`` already
    chose "cuda", and ``distributed/utils.py``, ``parallel_dims.py``, ``components/metrics.py``,
    ... copied ``device_type`` / ``device_module`` at their import, so the trainer would call
    ``torch.cuda.set_device`` (``torch._C`` has no ``_cuda_setDevice`` on a CPU build). Give
    every torchtitan module loaded so far the CPU pair, as the fallback above would have;
    modules imported later read it from ``tools/utils.py``. Nothing changes where an
    accelerator is present."""
    import sys

    utils = sys.modules["torchtitan.tools.utils"]
    if getattr(utils, "device_type", None) != "cuda" or torch._utils._get_available_device_type(
            ) is not None:  # type: ignore[no-untyped-call]
        return
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "torchtitan" or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"  # type: ignore[attr-defined]
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = torch.cpu  # type: ignore[attr-defined]


# ``models/common/attention.py`` calls ``torch.compile`` while defining ``FlexAttention``, which
# imports inductor, which imports ``torch/utils/mkldnn.py``, whose ``torch.jit.script_method``
# raises a DeprecationWarning: an error under pytest's warnings-as-errors. Nothing here uses
# FlexAttention; the warning is about torch's own code, so it is ignored for the import only.
compat.install()  # the torch names torchtitan imports that an older torch (2.11) lacks
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    _import_with_cpu_device_type()

    import torchtitan
    import torchtitan.components.metrics as _metrics
    import torchtitan.distributed.utils as _dist_utils
    import torchtitan.tools.utils as _utils
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpointer.base import BaseCheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX, BaseLoss, CrossEntropyLoss
    from torchtitan.components.metrics import DeviceMemStats, MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.components.validate import Validator
    from torchtitan.config import CommConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, parallelize_llama
    from torchtitan.models.llama3 import config_registry as llama3_registry
    from torchtitan.models.llama3.model import Llama3TransformerBlock
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.protocols.module import Module
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

if torchtitan.__version__ != TORCHTITAN_VERSION:
    raise ImportError(f"runtime.adapters.torchtitan is written for torchtitan=="
                      f"{TORCHTITAN_VERSION}, found {torchtitan.__version__}: "
                      "pip install '.[torchtitan]'")

DEVICE_TYPE: str = _utils.device_type
"""The device type torchtitan allocates on: "cuda" where CUDA is available, else "cpu"."""


class _CpuMemoryMonitor:
    """Stands in for ``DeviceMemoryMonitor``, which asks ``torch.cpu.get_device_name`` (absent)."""

    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self) -> Any:
        return DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def _cpu_memory_monitor() -> None:
    """``components/metrics.py``: ``DeviceMemoryMonitor`` calls ``get_device_name`` and
    ``get_device_properties`` of the device module; ``torch.cpu`` has neither. On CPU the
    metrics processor gets a monitor that reports zero memory."""
    _metrics.build_device_memory_monitor = _CpuMemoryMonitor


def _cpu_local_device() -> None:
    """``tools/utils.py``: ``get_local_device`` refuses to run without ``LOCAL_RANK`` (set by
    torchrun, not by a test harness or a plain process). On CPU every rank uses the one "cpu"
    device whatever its local rank."""

    def local_cpu() -> torch.device:
        return torch.device("cpu")

    _utils.get_local_device = local_cpu


def _pg_timeouts() -> None:
    """``distributed/utils.py``: ``set_pg_timeouts`` (after the first step: every mesh group and
    the default group get ``comm.train_timeout_seconds``) runs ``barrier(device_ids=[...])``,
    which gloo rejects, and calls ``torch.distributed.set_timeout``, which torch 2.13 does not
    have. The same barrier-then-set, with a barrier gloo takes and torch's setter
    (``runtime.dist.groups.set_group_timeout``); applied on CPU, and on CUDA where torch lacks
    ``set_timeout``."""
    from runtime.dist.groups import set_group_timeout

    def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()
        else:
            torch.distributed.barrier()
        for group in mesh_groups(parallel_dims) + [None]:
            set_group_timeout(group, timeout)

    _dist_utils.set_pg_timeouts = set_pg_timeouts


def mesh_groups(parallel_dims: Any) -> list[Any]:
    """The process group of every one-dimensional mesh of torchtitan's ``ParallelDims``."""
    return [mesh.get_group()
            for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]


def _cpu_peak_flops() -> None:
    """``tools/utils.py``: ``get_peak_flops`` runs ``lspci`` (absent here) to name the GPU and
    warns twice per trainer when it cannot; a CPU has no peak-FLOPS entry anyway (MFU is
    meaningless there), so answer torchtitan's own fallback value without asking."""
    fallback = 312e12  # what torchtitan assumes for an unknown device (A100 bf16)

    def cpu_peak_flops(device_name: str) -> float:
        del device_name
        return fallback

    _utils.get_peak_flops = cpu_peak_flops


if DEVICE_TYPE == "cpu":
    _cpu_peak_flops()
    _cpu_memory_monitor()
    _cpu_local_device()
if DEVICE_TYPE == "cpu" or not hasattr(torch.distributed, "set_timeout"):
    _pg_timeouts()


def gloo_sum_reduction(model: torch.nn.Module) -> None:
    """FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``) reduce-scatters with
    ``ReduceOp.PREMUL_SUM``, which gloo does not have. Force a plain SUM on every FSDP module.
    Exact here: torchtitan already sets the gradient divide factor to 1 (``distributed/fsdp.py``,
    the loss is divided by the global token count instead), so there is nothing to pre-multiply.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


KNOWN_WARNINGS = (
    KnownWarning(
        r"torch\.distributed is already initialized\. Skipping init_distributed",
        category=None,
        why="distributed/utils.py init_distributed, once per rank: dcp-train creates the "
        "process group itself (runtime.train.procgroup.process_group, with "
        "--distributed-timeout-minutes), and PlanTrainer applies the timeout to torchtitan's "
        "mesh groups (set_group_timeout); nothing of torchtitan's comm config is lost"),
    KnownWarning(
        r"Setting validation steps to -1 might cause hangs",
        category=None,
        why="components/validate.py, once per rank: PlanValidator runs an EvalSchedule, whose "
        "pass holds the same steps and microbatches on every rank (checked collectively when "
        "it is built), so no rank runs out of data before the others"),
    KnownWarning(
        r"To get the last learning rate computed by the scheduler",
        category=UserWarning, module=r"torch\.optim\.lr_scheduler",
        why="on --resume, components/optimizer/lr_scheduler.py load_state_dict recomputes each "
        "scheduler's last rate with get_lr() outside a step, on purpose (its comment says "
        "why); torch warns about any such call"),
)
"""torchtitan's warnings that do not apply to a plan's run (``runtime.train.quiet``): off
unless ``dcp-train --verbose``."""


def quiet_upstream_warnings() -> None:
    """Silence ``KNOWN_WARNINGS`` in this process (``launch`` does, unless ``--verbose``)."""
    quiet(KNOWN_WARNINGS)


@contextmanager
def quiet_cpu_dtensor_warnings() -> Iterator[None]:
    """DTensor warns that its random ops "may not have complete support on cpu device mesh"
    (``torch/distributed/tensor/_random.py``) when torchtitan seeds and initialises on a CPU
    mesh. The adapter overwrites every weight with its own seeded ones, so the warning does not
    apply; silence exactly it (pytest runs with warnings as errors)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*may not have complete support on cpu")
        yield


__all__ = [
    "DEVICE_TYPE",
    "IGNORE_INDEX",
    "KNOWN_WARNINGS",
    "TORCHTITAN_VERSION",
    "BaseCheckpointManager",
    "BaseDataLoader",
    "BaseLoss",
    "BaseTokenizer",
    "CheckpointManager",
    "CommConfig",
    "ComplexRoPE",
    "CrossEntropyLoss",
    "Embedding",
    "FlexAttention",
    "LRSchedulersContainer",
    "Linear",
    "Llama3Model",
    "Llama3TransformerBlock",
    "MetricsProcessor",
    "ModelSpec",
    "Module",
    "ParallelismConfig",
    "RMSNorm",
    "ScaledDotProductAttention",
    "Trainer",
    "TrainingConfig",
    "Validator",
    "default_adamw",
    "gloo_sum_reduction",
    "init_logger",
    "llama3_registry",
    "make_ffn_config",
    "make_gqa_config",
    "mesh_groups",
    "parallelize_llama",
    "quiet_cpu_dtensor_warnings",
    "quiet_upstream_warnings",
    "torchtitan",
]
