"""The only module that imports Megatron-core: every Megatron name the adapter uses comes from here.

Supported: megatron-core 0.16.1 through 0.19.x (the project's ``megatron`` extra), checked on
import, so another release is a clear error rather than an ``AttributeError`` deep inside a
schedule. The differences between those releases are absorbed here, in the functions below
(``process_group_collection``, ``get_megatron_optimizer``): the rest of the adapter calls them
and never asks which release runs.

Importing Megatron-core without Apex or Transformer Engine warns a dozen times (fallbacks to torch
norms and optimizers, deprecations inside its own packages, torch.jit deprecations it triggers);
the imports run with those warnings silenced, as ``runtime.attention.te`` does for TE, because
the test suite runs with warnings as errors and none of them is about this project's use.
"""

from __future__ import annotations

import warnings
from typing import Any

MIN_VERSION = (0, 16, 1)
MAX_VERSION = (0, 20)
"""Supported releases: MIN_VERSION <= release < MAX_VERSION."""
SUPPORTED = "0.16.1 through 0.19.x"

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core as _core
    from packaging.version import InvalidVersion, Version

VERSION: str = _core.__version__
try:
    _release = Version(VERSION).release
except InvalidVersion:
    _release = ()
if not MIN_VERSION <= _release < MAX_VERSION:
    raise ImportError(f"runtime.adapters.megatron supports megatron-core {SUPPORTED}, found "
                      f"{VERSION}; install the project's 'megatron' extra "
                      "(pip install 'dcp-planner[megatron]')")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel, timers
    from megatron.core import utils as core_utils
    from megatron.core.datasets import utils as datasets_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        param_and_grad_buffer,
    )
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.models.common.language_module import language_module
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_model as gpt_model_module
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, distrib_optimizer
    from megatron.core.optimizer import clip_grads as optimizer_clip_grads
    from megatron.core.optimizer import get_megatron_optimizer as _get_megatron_optimizer
    from megatron.core.optimizer import optimizer as optimizer_module
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import (
        get_forward_backward_func,
        p2p_communication,
        schedules,
    )
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import layers as tp_layers
    from megatron.core.tensor_parallel import mappings as tp_mappings
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import TransformerConfig, multi_token_prediction
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe import experts as moe_experts
    from megatron.core.transformer.moe import moe_layer, moe_utils
    from megatron.core.transformer.moe import router as moe_router
    from megatron.core.transformer.moe import token_dispatcher as moe_token_dispatcher
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )



def moe_modules() -> tuple[Any, ...]:
    """The modules of Megatron's MoE layers and multi-token prediction (for the CPU patches)."""
    return (moe_router, moe_token_dispatcher, moe_utils, moe_experts, moe_layer,
            multi_token_prediction)


def process_group_collection(groups: dict[str, object]) -> ProcessGroupCollection:
    """A ``ProcessGroupCollection`` holding ``groups`` (name -> group or None) for every field
    this release declares (names of other releases are left out); a field of the release that
    ``groups`` does not name is an error, so a newer release's new group is found here, not as
    an ``AttributeError`` deep in DDP."""
    from dataclasses import fields

    names = [f.name for f in fields(ProcessGroupCollection)]
    missing = [n for n in names if n not in groups]
    if missing:
        raise ImportError(f"megatron-core {VERSION}: ProcessGroupCollection has groups the "
                          f"adapter does not know: {', '.join(missing)}")
    pgc = ProcessGroupCollection()
    for name in names:
        setattr(pgc, name, groups[name])
    return pgc


def get_megatron_optimizer(config: OptimizerConfig, chunks: list[Any],
                           pg_collection: ProcessGroupCollection) -> Any:
    """Megatron's optimizer for DDP-wrapped ``chunks`` built from ``pg_collection`` (which
    forbids Megatron's extra gloo groups: ``use_gloo_process_groups=False``)."""
    return _get_megatron_optimizer(config, chunks, pg_collection=pg_collection,
                                   use_gloo_process_groups=False)


def te_layer_spec(num_experts: int | None = None) -> object:
    """Megatron's Transformer Engine layer spec (GPU only: importing TE needs CUDA); MoE layers
    of ``num_experts`` experts (Megatron's SequentialMLP of TE linears) when given."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

    del TEDotProductAttention  # imported to fail here, not inside the model build
    return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts,
                                                      moe_grouped_gemm=False)


def te_attention_class() -> type:
    """Megatron's ``TEDotProductAttention`` (GPU only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    cls: type = TEDotProductAttention
    return cls


__all__ = [
    "Attention", "DistributedDataParallel", "DistributedDataParallelConfig", "Float16Module",
    "GPTModel", "OptimizerConfig", "OptimizerParamScheduler", "P2PCommunicator",
    "PackedSeqParams", "ProcessGroupCollection", "SUPPORTED", "TransformerBlockSubmodules",
    "TransformerConfig", "VERSION", "core_utils", "datasets_utils", "dist_checkpointing",
    "distrib_optimizer", "filesystem_async", "finalize_model_grads", "get_forward_backward_func",
    "get_gpt_layer_local_spec", "get_megatron_optimizer", "get_num_layers_to_build",
    "gpt_model_module", "language_module", "moe_experts", "moe_layer", "moe_modules",
    "moe_router", "moe_token_dispatcher", "moe_utils", "multi_token_prediction",
    "optimizer_clip_grads", "optimizer_module", "p2p_communication", "parallel_state",
    "param_and_grad_buffer", "process_group_collection", "rotary_pos_embedding", "schedules",
    "state_dict_saver", "te_attention_class", "te_layer_spec", "tensor_parallel", "timers",
    "tp_layers", "tp_mappings", "tp_random", "transformer_utils",
]
