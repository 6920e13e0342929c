"""The Megatron model a plan trains in ``dcp-train``, and its oracle's terms: ``gpt`` (GPTModel
from a ``GPTConfig``, the layer spec with the plan's core attention, split-independent
initial weights), ``attention`` (the core attention that runs any CP group on any device, and
the sequence-parallel RMSNorm), ``oracle_terms`` (the load-balancing and MTP terms the
one-process oracle computes for itself).
"""

__all__: list[str] = []
