"""A small GPT for packed (THD) microbatches with pluggable attention.

The model sees one packed buffer of T tokens (the local shard of a CP group, or one whole sequence
for the reference) and never the batch structure: everything but attention is per token, so the
only place where context parallelism matters is the attention callable, which the caller binds to
one microbatch (its cu_seqlens, its CP group) and passes to :meth:`GPT.forward`.

Shapes: ``tokens`` and ``position_ids`` are 1-D ``[T]``; q is ``[T, num_heads, head_dim]``, k and v
are ``[T, num_query_groups, head_dim]`` (grouped-query attention); the callable returns
``[T, num_heads, head_dim]``. Positions restart at 0 for every sequence, so rotary embeddings
(RoPE) computed from ``position_ids`` give every CP rank the right phases for its zigzag chunks
without knowing where they came from.

Architecture (Llama-like): token embedding -> N x [RMSNorm -> GQA attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (tied to the embedding by default).
No biases, no dropout: the forward is a deterministic function of weights and tokens, which is
what the equivalence tests need.

Initial weights depend only on ``seed`` (a private generator, CPU, fp32), so every rank and the
reference start from bit-identical parameters whatever the device.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

AttentionFn = Callable[[Tensor, Tensor, Tensor, int], Tensor]
"""(q [T, H, D], k [T, G, D], v [T, G, D], layer_index) -> [T, H, D], causal within sequences."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of the model; the defaults make a tiny model for CPU tests."""

    vocab_size: int = 256
    """Token ids must be < vocab_size."""
    num_layers: int = 2
    """Transformer blocks."""
    hidden_size: int = 64
    """Model width; a multiple of num_heads."""
    num_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA); divides num_heads."""
    ffn_hidden_size: int = 0
    """SwiGLU inner width; 0 means 4 x hidden_size."""
    rope_theta: float = 10000.0
    """RoPE base."""
    tie_embeddings: bool = True
    """Share the LM head with the token embedding."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "num_query_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.num_heads % self.num_query_groups:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_query_groups "
                             f"{self.num_query_groups}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.ffn_hidden_size < 0:
            raise ValueError(f"ffn_hidden_size must be >= 0, got {self.ffn_hidden_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables ``[T, 1, head_dim/2]`` (fp32) for the given positions."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    )
    angles = position_ids.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (GPT-NeoX convention), in fp32."""
    x32 = x.float()
    a, b = x32.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


class Block(nn.Module):
    """One pre-norm transformer block; ``layer_index`` is passed to the attention callable."""

    def __init__(self, config: GPTConfig, layer_index: int) -> None:
        super().__init__()
        c = config
        self.config = c
        self.layer_index = layer_index
        self.attn_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.qkv = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_query_groups) * c.head_dim,
                             bias=False)
        self.proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.ffn_size, bias=False)
        self.down = nn.Linear(c.ffn_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionFn) -> Tensor:
        c = self.config
        t = x.shape[0]
        qkv = self.qkv(self.attn_norm(x))
        q, k, v = qkv.split(
            [c.num_heads * c.head_dim, c.num_query_groups * c.head_dim,
             c.num_query_groups * c.head_dim], dim=-1)
        q = apply_rope(q.view(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(t, c.num_query_groups, c.head_dim), cos, sin)
        v = v.reshape(t, c.num_query_groups, c.head_dim)
        out = attention(q.contiguous(), k.contiguous(), v.contiguous(), self.layer_index)
        x = x + self.proj(out.reshape(t, c.num_heads * c.head_dim))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        y: Tensor = x + self.down(F.silu(gate) * up)
        return y


class GPT(nn.Module):
    """Decoder-only transformer over one packed buffer; see the module docstring."""

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = (None if config.tie_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, std) weights from a private CPU generator; residual outputs scaled down.

        The generator makes the weights independent of the global RNG and of the device, so the
        reference and every rank agree bit for bit.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:  # RMSNorm scales
                p.fill_(1.0)
                continue
            s = out_std if name.endswith(("proj.weight", "down.weight")) else std
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)

    def forward(self, tokens: Tensor, position_ids: Tensor, attention: AttentionFn) -> Tensor:
        """Logits ``[T, vocab_size]`` for one packed buffer.

        Args:
            tokens: ``[T]`` token ids.
            position_ids: ``[T]`` position of each token within its own sequence.
            attention: the microbatch's attention callable (see :data:`AttentionFn`).
        """
        if tokens.dim() != 1 or tokens.shape != position_ids.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and position_ids "
                             f"{tuple(position_ids.shape)} must be equal 1-D shapes")
        cos, sin = rope_tables(position_ids, self.config.head_dim, self.config.rope_theta)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin, attention)
        x = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight)


def expand_kv(k: Tensor, num_heads: int) -> Tensor:
    """Repeat each of the G key/value heads num_heads/G times: ``[T, G, D] -> [T, H, D]``."""
    groups = k.shape[1]
    return k if groups == num_heads else k.repeat_interleave(num_heads // groups, dim=1)


def sequence_attention(q: Tensor, k: Tensor, v: Tensor, layer_index: int) -> Tensor:
    """Full causal attention over one whole sequence (the reference; ``layer_index`` unused).

    The batch dimension matters: CPU SDPA takes its fused kernel (memory linear in T) only for
    4-D ``[B, H, T, D]`` inputs; 3-D ones go to the math path, which holds T x T scores per
    head (the torchtitan oracle did that and needed over 120 GB for a 16K-token document).
    """
    del layer_index
    h = q.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], expand_kv(k, h).transpose(0, 1)[None],
        expand_kv(v, h).transpose(0, 1)[None], is_causal=True)
    return out[0].transpose(0, 1)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model-shape flags shared by ``dcp-train`` and ``dcp-calibrate`` (Megatron-LM's names
    are aliases: ``--num-layers``, ``--num-attention-heads``, ``--num-query-groups``,
    ``--untie-embeddings-and-output-weights``)."""
    g = parser.add_argument_group("model shape")
    g.add_argument("--vocab-size", type=int, default=256,
                   help="token ids must be below this")
    g.add_argument("--layers", "--num-layers", dest="layers", type=int, default=2,
                   help="transformer blocks")
    g.add_argument("--hidden-size", type=int, default=64, help="model width")
    g.add_argument("--heads", "--num-attention-heads", dest="heads", type=int, default=4,
                   help="query heads")
    g.add_argument("--query-groups", "--num-query-groups", dest="query_groups", type=int,
                   default=2, help="key/value heads (GQA)")
    g.add_argument("--ffn-hidden-size", type=int, default=0,
                   help="SwiGLU width (0: 4 x hidden)")
    g.add_argument("--untied", "--untie-embeddings-and-output-weights", dest="untied",
                   action="store_true", help="separate LM head weights")


MODEL_FLAGS = {"vocab_size": "--vocab-size", "num_layers": "--layers",
               "hidden_size": "--hidden-size", "num_heads": "--heads",
               "num_query_groups": "--query-groups", "ffn_hidden_size": "--ffn-hidden-size"}
"""GPTConfig fields -> the flags that set them (for error messages)."""


def model_config_from_args(args: argparse.Namespace) -> GPTConfig:
    """GPTConfig from the flags of ``add_model_arguments`` (ValueError on a bad shape)."""
    return GPTConfig(vocab_size=args.vocab_size, num_layers=args.layers,
                     hidden_size=args.hidden_size, num_heads=args.heads,
                     num_query_groups=args.query_groups, ffn_hidden_size=args.ffn_hidden_size,
                     tie_embeddings=not args.untied)


def check_token_ids(tokens: Tensor, vocab_size: int, where: Callable[[], str]) -> None:
    """ValueError when a token id is outside [0, vocab_size) (CPU tensors; ``where`` names the
    place and is only called on failure, so the check costs a min and a max).

    The embedding would otherwise fail with a bare IndexError (CPU) or a device-side assert.
    """
    if tokens.numel() == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0:
        # No vocabulary holds a negative id: the data is damaged or not token ids.
        raise ValueError(f"{where()}: token id {low} is negative; token ids are >= 0 (the "
                         "dataset is damaged, or its field does not hold token ids)")
    if high >= vocab_size:
        raise ValueError(f"{where()}: token id {high} is outside the model's vocabulary "
                         f"[0, {vocab_size}); set --vocab-size above the dataset's largest id")
