"""A ``pretrain_gpt.py`` of the project's own: Megatron-LM's ``__main__`` shape, for CI.

Megatron-LM's own ``pretrain_gpt.py`` (with its ``gpt_builders.py`` and ``model_provider.py``)
lives in its repository, not in the megatron-core wheel; the tests run this script instead, the
same calls in the same order as core_v0.19.0's ``__main__``: ``parse_and_validate_args`` ->
``gpt_config_from_args`` -> ``pretrain_cfg_container_from_args`` -> ``pretrain`` (the model
built by the config container's GPT builder, as upstream). The dataset provider and forward
step below are what a script must pass; under the launcher the plan's replace them::

    torchrun --nproc-per-node 4 -m runtime.adapters.megatron_lm --plan PLAN -- \\
        runtime/adapters/megatron_lm/pretrain_gpt.py <Megatron-LM flags>
"""

from __future__ import annotations

from typing import Any


def train_valid_test_datasets_provider(num_samples: Any, vp_stage: int | None = None) -> Any:
    raise RuntimeError("run this script through the plan launcher (python -m "
                       "runtime.adapters.megatron_lm --plan PLAN -- pretrain_gpt.py ...)")


def forward_step(data_iterator: Any, model: Any) -> Any:
    raise RuntimeError("run this script through the plan launcher")


if __name__ == "__main__":
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
             forward_step)
