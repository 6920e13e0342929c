"""torchtitan's llama3, debug-sized from dcp-train's shape flags, with the plan's attention.

``llama3_config`` builds a ``Llama3Model.Config`` the way torchtitan's own ``debugmodel`` flavor
is built (fused QKV, GQA, complex RoPE, SwiGLU, RMSNorm, torchtitan's initialisers), but from a
``GPTConfig`` (layers, width, heads, kv heads, FFN width, vocabulary, RoPE base, tied
embeddings) and with every layer's ``inner_attention`` replaced by :class:`PlanAttention`, which
runs the microbatch's CP group. ``initial_state_dict`` gives the weights for a seed: the same
full (unsharded) tensors for the FSDP-sharded trainer and for the one-process oracle, so both
start bit-identical.

Differences from ``runtime.model.GPT`` (the native model) are torchtitan's: adjacent-pair RoPE
(complex), depth-scaled init of the output projections, untied embedding init N(0, 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from runtime.adapters.torchtitan.attention import PlanAttention
from runtime.adapters.torchtitan.titan import (
    ComplexRoPE,
    Embedding,
    Linear,
    Llama3Model,
    Llama3TransformerBlock,
    ModelSpec,
    RMSNorm,
    make_ffn_config,
    make_gqa_config,
    parallelize_llama,
)
from runtime.train.model import GPTConfig

_NORM_INIT = {"weight": nn.init.ones_}


def _linear_init(std: float) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}


def _depth_init(std: float, layer_index: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    # torchtitan's llama3 scales the init of each block's output projections with depth.
    return _linear_init(std / math.sqrt(2 * (layer_index + 1)))


def ffn_hidden_size(model_config: GPTConfig) -> int:
    """SwiGLU width: the flag, or torchtitan's llama rule (8/3 x width, a multiple of 16)."""
    if model_config.ffn_hidden_size:
        return model_config.ffn_hidden_size
    width = int(8 * model_config.hidden_size / 3)
    return 16 * ((width + 15) // 16)


def llama3_config(model_config: GPTConfig, *, max_seq_len: int) -> Llama3Model.Config:
    """The llama3 model config for ``model_config``'s shape, attention replaced by the plan's.

    Args:
        model_config: the shape flags of dcp-train.
        max_seq_len: longest position + 1 that RoPE must cover (the longest padded segment).
    """
    dim, std = model_config.hidden_size, model_config.init_std
    head_dim = model_config.head_dim
    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=max_seq_len,
                              theta=model_config.rope_theta, scaling="none")
    layers = []
    for i in range(model_config.num_layers):
        norm = partial(RMSNorm.Config, normalized_shape=dim, eps=model_config.norm_eps,
                       param_init=_NORM_INIT)
        layers.append(Llama3TransformerBlock.Config(
            attention_norm=norm(), ffn_norm=norm(),
            attention=make_gqa_config(
                dim=dim, n_heads=model_config.num_heads,
                n_kv_heads=model_config.num_query_groups, fuse_qkv=True,
                wqkv_param_init=_linear_init(std), wo_param_init=_depth_init(std, i),
                inner_attention=PlanAttention.Config(layer_index=i), rope=rope),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=ffn_hidden_size(model_config),
                w1_param_init=_linear_init(std), w2w3_param_init=_depth_init(std, i))))
    vocab = model_config.vocab_size
    tied = model_config.tie_embeddings
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=tied,
        # With tying the LM head's init is the one used (torchtitan skips the embedding's).
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim,
            param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, eps=model_config.norm_eps,
                            param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=_linear_init(dim ** -0.5)),
        layers=layers)


def with_plan_attention(config: Llama3Model.Config) -> Llama3Model.Config:
    """``config`` (any llama3 flavor, e.g. torchtitan's ``model_registry("8B").model``) with
    every layer's inner attention replaced by :class:`PlanAttention`, in place; returned."""
    for i, layer in enumerate(config.layers):
        layer.attention.inner_attention = PlanAttention.Config(layer_index=i)
    return config


def model_spec(config: Llama3Model.Config) -> ModelSpec:
    """torchtitan's ``ModelSpec`` for a llama3 config (llama3's own parallelize function)."""
    return ModelSpec(name="llama3", flavor="dcp", model=config, parallelize_fn=parallelize_llama,
                     pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None)


def gpt_shape(config: Llama3Model.Config) -> GPTConfig:
    """The attention shape of a llama3 config, as ``runtime.backends`` takes it."""
    attention = config.layers[0].attention
    n_kv = attention.n_kv_heads or attention.n_heads
    return GPTConfig(vocab_size=config.vocab_size, num_layers=len(config.layers),
                     hidden_size=attention.n_heads * (config.dim // attention.n_heads),
                     num_heads=attention.n_heads, num_query_groups=n_kv)


def memory_shape(config: Llama3Model.Config) -> GPTConfig:
    """The GPT shape ``planner.memory`` estimates for a llama3 config: ``gpt_shape`` with its
    SwiGLU width (the first layer's ``w1``) and its embedding tying."""
    shape = gpt_shape(config)
    return replace(shape, ffn_hidden_size=int(config.layers[0].feed_forward.w1.out_features),
                   tie_embeddings=bool(config.enable_weight_tying))


def build_llama3(config: Llama3Model.Config, *, seed: int) -> nn.Module:
    """The whole model on the CPU in fp32, initialised by torchtitan's initialisers from ``seed``.

    The global RNG is forked, so callers' random streams are untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = config.build()
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
    model.train()
    built: nn.Module = model
    return built
