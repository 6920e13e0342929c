"""torchtitan configs for ``bench/torchtitan_registry_gpu.py``: the registry's
``llama3_debugmodel`` job with the GPU bench's model shape, for ``torchtitan.train --module``.

torchtitan parses its config with tyro but keeps ``model_spec`` off the command line
(``tyro.conf.Suppress``), so no flag sets the model's layers, width, heads or vocabulary; a
torchtitan user who wants another model writes a config function and names its module with
``--module``. These do that and nothing else: torchtitan's ``llama3_debugmodel`` through
``runtime.adapters.torchtitan.registry.with_plan`` (the plan's trainer, data loader,
attention), with the model swapped for the llama3 that ``dcp-train --framework torchtitan``
builds from ``bench/torchtitan_gpu.py``'s shape flags (``PARITY`` / ``SMOKE``, parsed by
``dcp-train``'s own parser), so both entry points train the same model from the same seed.
Optimizer, schedule, clipping, precision and activation checkpointing stay torchtitan's and are
set by flags (``bench/torchtitan_registry_gpu.py``'s ``REGISTRY_FLAGS``).
"""

from __future__ import annotations

import argparse

from bench.torchtitan_gpu import PARITY, SMOKE
from runtime.adapters.torchtitan.model import llama3_config, model_spec
from runtime.adapters.torchtitan.registry import with_plan
from runtime.adapters.torchtitan.titan import CrossEntropyLoss
from runtime.adapters.torchtitan.titan import llama3_registry as _llama3
from runtime.adapters.torchtitan.trainer import PlanTrainer
from runtime.train.model import add_model_arguments, model_config_from_args

ROPE_LEN = 131072
"""RoPE table length, torchtitan's llama3 value: covers the bench plans' longest segment
(``single.arrow``: 32,768 tokens); each position's rotation does not depend on it."""


def _shaped(flags: list[str]) -> PlanTrainer.Config:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    shape = model_config_from_args(parser.parse_known_args(flags)[0])
    config = _llama3.llama3_debugmodel()
    config.model_spec = model_spec(llama3_config(shape, max_seq_len=ROPE_LEN))
    # The debug config's loss was sized for its own 2,048-token vocabulary.
    config.loss = CrossEntropyLoss.Config(global_vocab_size=shape.vocab_size)
    return with_plan(config)


def llama3_bench_parity() -> PlanTrainer.Config:
    """``llama3_debugmodel`` at ``bench/torchtitan_gpu.py``'s 1-GPU parity shape (2 x 256)."""
    return _shaped(PARITY)


def llama3_bench_smoke() -> PlanTrainer.Config:
    """``llama3_debugmodel`` at ``bench/torchtitan_gpu.py``'s CPU smoke shape (1 x 32)."""
    return _shaped(SMOKE)
