"""The only module that imports Megatron-core: every Megatron name the adapter uses comes from here.

Pinned to megatron-core 0.16.x (the project's ``megatron`` extra; docs/design.md says why that
release). A newer or older release may move these names, so the version is checked on import and
a mismatch is a clear error rather than an ``AttributeError`` deep inside a schedule.

Importing Megatron-core without Apex or Transformer Engine warns a dozen times (fallbacks to torch
norms and optimizers, deprecations inside its own packages, torch.jit deprecations it triggers);
the imports run with those warnings silenced, as ``runtime.attention.te`` does for TE, because
the test suite runs with warnings as errors and none of them is about this project's use.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core as _core
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core import utils as core_utils
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_model as gpt_model_module
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
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
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

VERSION: str = _core.__version__
SUPPORTED = "0.16."

if not VERSION.startswith(SUPPORTED):
    raise ImportError(f"runtime.adapters.megatron supports megatron-core {SUPPORTED}x, found "
                      f"{VERSION}; install the project's 'megatron' extra")


def te_layer_spec() -> object:
    """Megatron's Transformer Engine layer spec (GPU only: importing TE needs CUDA)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

    del TEDotProductAttention  # imported to fail here, not inside the model build
    return get_gpt_layer_with_transformer_engine_spec()


def te_attention_class() -> type:
    """Megatron's ``TEDotProductAttention`` (GPU only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    cls: type = TEDotProductAttention
    return cls


__all__ = [
    "Attention",
    "DistributedDataParallelConfig",
    "GPTModel",
    "P2PCommunicator",
    "PackedSeqParams",
    "ProcessGroupCollection",
    "SUPPORTED",
    "TransformerBlockSubmodules",
    "TransformerConfig",
    "VERSION",
    "core_utils",
    "finalize_model_grads",
    "get_forward_backward_func",
    "get_gpt_layer_local_spec",
    "get_num_layers_to_build",
    "gpt_model_module",
    "p2p_communication",
    "parallel_state",
    "rotary_pos_embedding",
    "schedules",
    "te_attention_class",
    "te_layer_spec",
    "tensor_parallel",
    "tp_layers",
    "tp_mappings",
    "tp_random",
]
