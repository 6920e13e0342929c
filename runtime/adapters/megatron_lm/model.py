"""What the launcher does to the model Megatron-LM builds, before DDP wraps it.

Megatron-LM keeps building the model from its flags (0.19: the config container's
``GPTModelBuilder``; before: the script's ``model_provider``). The launcher adds one hook that
sees every chunk before it is wrapped (``cfg.model.pre_wrap_hooks``, or the provider wrapped):

- on a host without CUDA, every self-attention's core attention becomes the adapter's
  ``PlanCoreAttention`` (the packed THD attention of the microbatch's CP group): Megatron's
  local ``DotProductAttention`` refuses packed sequences and CP, and TE needs a GPU. It has no
  parameters, so nothing else changes;
- with ``--init-seed S``, every weight becomes its slice of the adapter's split-independent
  initial tensor (``model.gpt.init_weights``), so that a run of any tp / pp / pool split, and
  the oracle, start from the same weights.

``gpt_config`` reads the model shape from Megatron-LM's arguments (the oracle builds the same
model from it); ``check_oracle_shape`` refuses flags the oracle's model does not have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from runtime.adapters.megatron.compat import mcore
from runtime.adapters.megatron.model.attention import PlanCoreAttention
from runtime.adapters.megatron.model.gpt import init_weights
from runtime.train.megatron_options import MegatronOptions
from runtime.train.model import GPTConfig

Args = Any


def gpt_config(args: Args) -> GPTConfig:
    """The project's model description of Megatron-LM's flags (padded vocabulary)."""
    heads = args.num_attention_heads
    return GPTConfig(
        vocab_size=args.padded_vocab_size, num_layers=args.num_layers,
        hidden_size=args.hidden_size, num_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        ffn_hidden_size=args.ffn_hidden_size, rope_theta=float(args.rotary_base),
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        norm_eps=args.layernorm_epsilon, init_std=args.init_method_std)


def megatron_options(args: Args) -> MegatronOptions:
    """The MoE and MTP fields of Megatron-LM's flags as ``dcp-train``'s ``MegatronOptions``
    (what the oracle's model and its extra loss terms read; a dense model: the defaults)."""
    mtp = {"mtp_num_layers": args.mtp_num_layers,
           "mtp_loss_scaling_factor": args.mtp_loss_scaling_factor} if args.mtp_num_layers else {}
    if not args.num_experts:
        return MegatronOptions(**mtp)
    kind, coeff = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    return MegatronOptions(
        **mtp, num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or 0,
        moe_aux_loss_coeff=float(coeff[0] if isinstance(coeff, (list, tuple)) else coeff),
        moe_router_load_balancing_type=kind[0] if isinstance(kind, (list, tuple)) else kind)


def check_oracle_shape(args: Args) -> list[str]:
    """Flags describing a model the oracle does not build (a SwiGLU, RMSNorm, bias-free RoPE
    GPT, ``runtime.adapters.megatron.model.gpt``), one line each."""
    out = []
    wants = (("--swiglu", args.swiglu), ("--normalization RMSNorm",
                                          args.normalization == "RMSNorm"),
             ("--disable-bias-linear", not args.add_bias_linear),
             ("--position-embedding-type rope", args.position_embedding_type == "rope"))
    out += [f"{flag} is required by the oracle's model" for flag, ok in wants if not ok]
    if getattr(args, "qk_layernorm", False):
        out.append("--qk-layernorm: the oracle's model has none")
    if getattr(args, "rotary_percent", 1.0) != 1.0:
        out.append(f"--rotary-percent {args.rotary_percent}: the oracle rotates every channel")
    if args.kv_channels and args.kv_channels * args.num_attention_heads != args.hidden_size:
        out.append(f"--kv-channels {args.kv_channels}: the oracle's heads are hidden-size / "
                   "num-attention-heads wide")
    if args.hidden_dropout or args.attention_dropout:
        out.append("--hidden-dropout and --attention-dropout must be 0 (the oracle draws no "
                   "random numbers)")
    return out


def swap_core_attention(chunks: Sequence[nn.Module]) -> int:
    """Put ``PlanCoreAttention`` in every self-attention of ``chunks``; returns how many."""
    swapped = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, mcore.Attention) and hasattr(module, "core_attention"):
                old = module.core_attention
                module.core_attention = PlanCoreAttention(
                    module.config, module.layer_number, None,
                    softmax_scale=getattr(old, "softmax_scale", None))
                swapped += 1
    return swapped


def prepare_chunks(chunks: Sequence[nn.Module], args: Args, *, on_cpu: bool,
                   init_seed: int | None) -> None:
    """The module docstring's two changes, on this rank's unwrapped chunks."""
    if on_cpu:
        swap_core_attention(chunks)
    if init_seed is not None:
        tp = args.tensor_model_parallel_size
        tp_rank = mcore.parallel_state.get_tensor_model_parallel_rank()
        init_weights(list(chunks), gpt_config(args), seed=init_seed, tp=tp, tp_rank=tp_rank)


def pre_wrap_hook(args: Callable[[], Args], *, on_cpu: bool, init_seed: int | None
                  ) -> Callable[[list[nn.Module]], list[nn.Module]]:
    """``cfg.model.pre_wrap_hooks``' entry (0.19's model builder)."""

    def hook(chunks: list[nn.Module]) -> list[nn.Module]:
        prepare_chunks(chunks, args(), on_cpu=on_cpu, init_seed=init_seed)
        return chunks
    return hook


def wrap_provider(provider: Callable[..., nn.Module], args: Callable[[], Args], *,
                  on_cpu: bool, init_seed: int | None) -> Callable[..., nn.Module]:
    """A ``model_provider`` whose chunk gets the same changes (0.17 / 0.18, or a script that
    passes its own provider)."""

    def model_provider(*a: Any, **kw: Any) -> nn.Module:
        chunk = provider(*a, **kw)
        prepare_chunks([chunk], args(), on_cpu=on_cpu, init_seed=init_seed)
        return chunk
    return model_provider
