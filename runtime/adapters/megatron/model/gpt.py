"""A Megatron-core ``GPTModel`` from ``dcp-train``'s model-shape flags, with split-proof weights.

The same shape as ``runtime.train.model.GPT`` (Llama-like: RMSNorm, GQA attention with RoPE,
SwiGLU MLP, no biases, no dropout, tied embeddings unless ``--untied``), but Megatron's modules:
``TransformerConfig`` + a layer spec + ``GPTModel``, one model chunk per virtual pipeline stage.
The spec is Megatron's local one with two pieces swapped (``runtime.adapters.megatron.
attention``): the core attention (``PlanCoreAttention`` for packed plan microbatches,
``SequenceCoreAttention`` for the oracle) and the norm (``SequenceParallelRMSNorm``, since the
torch fallback refuses sequence parallelism). With ``attention="te"`` (GPU) it is Megatron's
Transformer Engine spec, whose ``TEDotProductAttention`` takes the CP group from
``PackedSeqParams``.

Initial weights (``init_weights``) do not depend on the tp/pp/vpp split: every parameter is a
slice of one full tensor drawn from a generator seeded by (seed, the parameter's global name),
where the global name numbers layers globally (``decoder.layers.<layer_number - 1>``) and the
last stage's copy of tied embeddings is named ``embedding.word_embeddings.weight``. TP slices
follow Megatron's partition dims; the SwiGLU ``linear_fc1`` holds [gate; up], so each TP rank
takes its slice of each half. So a pp 2 x tp 2 run and the one-process oracle start from the same
function. Megatron's own init would draw different numbers for each split.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.adapters.megatron.binding import mtp
from runtime.adapters.megatron.compat import mcore
from runtime.adapters.megatron.model.attention import (
    PlanCoreAttention,
    SequenceCoreAttention,
    SequenceParallelRMSNorm,
)
from runtime.train.megatron_options import MegatronOptions
from runtime.train.model import GPTConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelParallel:
    """How the model is split (from the plan header), and the training dtype."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    microbatch_group_size: int = 1
    """Megatron's ``microbatch_group_size_per_vp_stage`` (the plan's, default pp)."""
    dtype: torch.dtype = torch.float32
    """Training dtype: bf16 is Megatron's mixed precision (``megatron_precision``, bf16
    weights and fp32 main weights in the optimizer) or else autocast over fp32 weights."""
    megatron_precision: bool = True
    """bf16 as Megatron does it (``TransformerConfig.bf16``); False: autocast (the
    ``PoolGradSync`` baseline and the oracle, whose optimizer is plain AdamW)."""


def shape_fields(model: GPTConfig) -> dict[str, Any]:
    """``TransformerConfig`` fields of ``dcp-train``'s model shape (Llama-like, no dropout)."""
    return dict(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_heads, num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim, ffn_hidden_size=model.ffn_size,
        normalization="RMSNorm", layernorm_epsilon=model.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=model.init_std,
        # No fused kernels (CPU, and bit-for-bit with the oracle); weights are set by
        # init_weights, so Megatron's own initialisation is skipped.
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=True, perform_initialization=False)


def moe_fields(options: MegatronOptions, model: GPTConfig) -> dict[str, Any]:
    """``TransformerConfig`` fields of the MoE and MTP flags (none for a dense model): dropless
    top-k routing through the alltoall dispatcher, experts as Megatron's SequentialMLP."""
    fields: dict[str, Any] = {}
    if options.moe:
        fields.update(
            num_moe_experts=options.num_experts, moe_router_topk=options.moe_router_topk,
            moe_ffn_hidden_size=options.moe_ffn_hidden_size or model.ffn_size,
            moe_aux_loss_coeff=options.moe_aux_loss_coeff,
            moe_router_load_balancing_type=options.moe_router_load_balancing_type,
            moe_grouped_gemm=False)
    if options.mtp_num_layers:
        fields.update(mtp_num_layers=options.mtp_num_layers,
                      mtp_loss_scaling_factor=options.mtp_loss_scaling_factor)
    return fields


def plan_fields(par: ModelParallel) -> dict[str, Any]:
    """The ``TransformerConfig`` fields a plan fixes: its split, the per-token loss, variable
    THD lengths, no static CP, and the mixed precision of ``par.dtype`` (Megatron's bf16: bf16
    weights; the optimizer keeps fp32 main weights)."""
    bf16 = par.dtype == torch.bfloat16 and par.megatron_precision
    dtype = torch.bfloat16 if bf16 else torch.float32
    return dict(
        tensor_model_parallel_size=par.tp, sequence_parallel=par.sequence_parallel,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        microbatch_group_size_per_vp_stage=par.microbatch_group_size if par.vpp > 1 else None,
        context_parallel_size=1,  # each microbatch binds its own group (binding.py)
        # Per-token loss (the plan's CP sizes vary); THD lengths vary between microbatches.
        calculate_per_token_loss=True, variable_seq_lengths=True,
        # 0.16.1 rejects variable_seq_lengths with the default MoE dispatcher even for a dense
        # model (transformer_config.py); the dispatcher is unused here.
        moe_token_dispatcher_type="alltoall",
        # The default "full" only triggers a deprecation warning; no CUDA graphs are used.
        cuda_graph_scope=[],
        batch_p2p_sync=False,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
    )


def transformer_config(model: GPTConfig, par: ModelParallel,
                       options: MegatronOptions | None = None, **overrides: Any
                       ) -> mcore.TransformerConfig:
    """Megatron's ``TransformerConfig`` for ``model`` (and the MoE / MTP ``options``) split as
    ``par``; ``overrides`` replace fields (the oracle's own load balancing)."""
    check_split(par, vocab_size=model.vocab_size, num_query_groups=model.num_query_groups,
                num_layers=model.num_layers)
    moe = moe_fields(options or MegatronOptions(), model)
    return mcore.TransformerConfig(**{**shape_fields(model), **moe, **plan_fields(par),
                                      **overrides})


def check_split(par: ModelParallel, *, vocab_size: int | None = None,
                num_query_groups: int | None = None, num_layers: int | None = None) -> None:
    """The model divides as the plan splits it (ValueError naming the number that does not)."""
    if vocab_size is not None and vocab_size % par.tp:
        raise ValueError(f"vocab size {vocab_size} must be a multiple of tp {par.tp}")
    if num_query_groups is not None and num_query_groups % par.tp:
        raise ValueError(f"query groups {num_query_groups} must be a multiple of tp {par.tp}")
    stages = par.pp * par.vpp
    if num_layers is not None and num_layers % stages:
        raise ValueError(f"{num_layers} layers do not split into pp {par.pp} x vpp "
                         f"{par.vpp} stages")


def layer_spec(config: mcore.TransformerConfig, *, attention: str, vp_stage: int | None,
               pp_rank: int) -> object:
    """The block spec of one model chunk: ``plan`` (packed, ours), ``sequence`` (oracle) or
    ``te`` (Megatron's Transformer Engine spec, GPU)."""
    experts = config.num_moe_experts
    if attention == "te":
        return mcore.te_layer_spec(experts)
    spec = mcore.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                          normalization="RMSNorm")
    core = {"plan": PlanCoreAttention, "sequence": SequenceCoreAttention}[attention]
    spec.submodules.self_attention.submodules.core_attention = core
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    num = mcore.get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return mcore.TransformerBlockSubmodules(layer_specs=[spec] * num,
                                            layer_norm=SequenceParallelRMSNorm)


def gpt_chunk(model: GPTConfig, config: mcore.TransformerConfig,
              pg_collection: mcore.ProcessGroupCollection, *, spec: object, pre_process: bool,
              post_process: bool, vp_stage: int | None, max_sequence_length: int,
              use_te: bool = False) -> nn.Module:
    """One model chunk of ``dcp-train``'s shape (a model provider's body), weights not set;
    the last stage's holds the multi-token prediction block when ``config`` has one
    (``mtp.block_spec``, TE modules with ``use_te``)."""
    mtp_spec = None
    if config.mtp_num_layers and post_process:
        mtp_spec = mtp.block_spec(spec, config, use_te=use_te)
    with mtp.building(pg_collection) if mtp_spec is not None else contextlib.nullcontext():
        chunk: nn.Module = mcore.GPTModel(
            config, spec, vocab_size=model.vocab_size, max_sequence_length=max_sequence_length,
            pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type="rope", rotary_base=int(model.rope_theta),
            pg_collection=pg_collection, vp_stage=vp_stage, mtp_block_spec=mtp_spec)
    head: Any = getattr(chunk, "output_layer", None)
    if mtp_spec is not None and model.tie_embeddings and not pre_process \
            and getattr(head, "weight", None) is not None:
        # The MTP stage holds its own copy of the tied embeddings (which the output layer
        # uses) but still allocates an output weight that nothing reads: not trained.
        head.weight.requires_grad_(False)
    return chunk


def build_chunks(model: GPTConfig, config: mcore.TransformerConfig,
                 pg_collection: mcore.ProcessGroupCollection, *, attention: str, pp_rank: int,
                 max_sequence_length: int) -> list[nn.Module]:
    """This pipeline rank's model chunks (one per virtual stage), weights not yet set (the
    oracle's; a training job builds them through ``PlanJob.get_model``)."""
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    # Built without the embedding group: GPTModel would all-reduce the tied embedding copies
    # through .cuda() (language_module.py); init_weights writes equal copies on both stages.
    build_pgc = _with(pg_collection, embd=None)
    chunks: list[nn.Module] = []
    for c in range(vpp):
        vp_stage = c if vpp > 1 else None
        spec = layer_spec(config, attention=attention, vp_stage=vp_stage, pp_rank=pp_rank)
        chunks.append(gpt_chunk(model, config, build_pgc, spec=spec,
                                pre_process=pp_rank == 0 and c == 0,
                                post_process=pp_rank == pp - 1 and c == vpp - 1,
                                vp_stage=vp_stage, max_sequence_length=max_sequence_length))
    return chunks


def _with(pgc: mcore.ProcessGroupCollection, **groups: object) -> mcore.ProcessGroupCollection:
    out = mcore.ProcessGroupCollection()
    for name, value in vars(pgc).items():
        setattr(out, name, value)
    for name, value in groups.items():
        setattr(out, name, value)
    return out


def unwrap(chunk: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module / PoolGradSync wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, nn.Module):
        chunk = chunk.module
    return chunk


def global_names(chunk: nn.Module) -> dict[str, str]:
    """Local parameter name -> the name it has in the unsplit model (see module docstring)."""
    inner = unwrap(chunk)
    out = {}
    decoder = getattr(inner, "decoder", None)
    layers = list(decoder.layers) if decoder is not None else []
    for name, _ in inner.named_parameters():
        g = name
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            g = f"decoder.layers.{layers[int(local)].layer_number - 1}.{rest}"
        elif name == "output_layer.weight" and getattr(inner, "share_embeddings_and_output_weights",
                                                       False) and not hasattr(inner, "embedding"):
            g = "embedding.word_embeddings.weight"  # the last stage's copy of tied embeddings
        out[name] = g
    return out


def _full(name: str, shape: tuple[int, ...], model: GPTConfig, seed: int) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape)  # RMSNorm scales
    gen = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()))
                                                    % (1 << 63))
    std = model.init_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std /= math.sqrt(2 * model.num_layers)  # residual outputs scaled, as Megatron does
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def partition_dims(chunk: nn.Module) -> dict[int, int]:
    """id(parameter) -> its TP partition dim, for every TP-split weight of ``chunk``.

    Taken from the layer types (column-parallel and vocab-parallel: dim 0, row-parallel: dim 1)
    because with ``perform_initialization=False`` Megatron never sets the ``tensor_model_parallel``
    attributes (tensor_parallel/layers.py sets them inside its init functions); they are set here
    too, for Megatron code that reads them.
    """
    tp = mcore.tensor_parallel
    out: dict[int, int] = {}
    for module in chunk.modules():
        if isinstance(module, tp.RowParallelLinear):
            dim = 1
        elif isinstance(module, (tp.ColumnParallelLinear, tp.VocabParallelEmbedding)):
            dim = 0
        else:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            if not getattr(weight, "tensor_model_parallel", False):
                tp.set_tensor_model_parallel_attributes(weight, True, dim, 1)
            out[id(weight)] = dim
    for p in chunk.parameters():  # other layers (TE's) that mark their own TP weights
        if id(p) not in out and getattr(p, "tensor_model_parallel", False):
            out[id(p)] = int(getattr(p, "partition_dim", 0))
    return out


@torch.no_grad()
def init_weights(chunks: list[nn.Module], model: GPTConfig, *, seed: int, tp: int,
                 tp_rank: int) -> None:
    """Set every parameter to its slice of the split-independent full tensor."""
    for chunk in chunks:
        inner = unwrap(chunk)
        names = global_names(inner)
        dims = partition_dims(inner)
        for name, p in inner.named_parameters():
            partitioned = id(p) in dims
            dim = dims.get(id(p), 0)
            shape = list(p.shape)
            if partitioned:
                shape[dim] *= tp
            full = _full(names[name], tuple(shape), model, seed)
            if partitioned and tp > 1:
                if name.endswith("linear_fc1.weight"):  # [gate; up]: a slice of each half
                    full = torch.cat([h.chunk(tp, dim=0)[tp_rank] for h in full.chunk(2, dim=0)])
                else:
                    full = full.chunk(tp, dim=dim)[tp_rank]
            p.copy_(full.to(p.dtype))
