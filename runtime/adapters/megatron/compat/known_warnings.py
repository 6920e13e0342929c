"""Megatron-core's warnings known not to apply to a plan's run (``runtime.train.quiet``).

``launch`` silences them unless ``dcp-train --verbose``; anything else Megatron, or torch under
it, warns still prints. Megatron-core's import-time warnings (no Apex or Transformer Engine) are
``mcore``'s, silenced around its imports. Read in megatron-core 0.16.1 and 0.19.2: the ones
below come once per rank on ``--resume``, from the load path of ``dist_checkpointing``.
"""

from __future__ import annotations

from runtime.train.quiet import KnownWarning, quiet

KNOWN_WARNINGS = (
    KnownWarning(
        r"`load_state_dict` is deprecated and will be removed in future versions",
        category=FutureWarning, module=r"megatron\.core\.dist_checkpointing",
        why="dist_checkpointing/strategies/torch.py loads through torch.distributed.checkpoint's "
        "load_state_dict, the older name of its load: the same reader and plan; our resume "
        "verifies every file against the step's manifest and is tested bit for bit"),
    KnownWarning(
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        category=FutureWarning, module=r"torch\.distributed\.checkpoint",
        why="Megatron's torch strategy stores its shards as ShardedTensor (its checkpoint "
        "format, which the saved steps must keep to resume); torch's checkpoint planner warns "
        "about the type on every load"),
)
"""Each with why it does not apply here; ``dcp-train --verbose`` shows them."""


def quiet_upstream_warnings() -> None:
    """Silence ``KNOWN_WARNINGS`` in this process (``launch`` does, unless ``--verbose``)."""
    quiet(KNOWN_WARNINGS)
