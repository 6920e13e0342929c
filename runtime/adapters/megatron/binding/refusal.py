"""One refused setting of a Megatron model: what the binding's start-up checks return.

``routers.moe_refusals`` and ``mtp.mtp_refusals`` list them for a ``TransformerConfig`` (or a
view of Megatron-LM's arguments under its field names); ``PlanJob`` raises them in config words
(``config_message``), the Megatron-LM launcher words them in its flags' names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Refusal:
    """A setting the adapter does not run under dynamic CP."""

    field: str
    """The ``TransformerConfig`` field (Megatron-LM's flag of the same name, but
    ``num_moe_experts``: ``--num-experts``)."""
    why: str
    want: str | None
    """The value to set instead (its repr), or None where ``why`` says what to use."""


def config_message(config: Any, refusals: list[Refusal]) -> str:
    """``field=value: why: set want`` for each refusal, joined."""
    return "; ".join(f"{r.field}={getattr(config, r.field, None)!r}: {r.why}"
                     + ("" if r.want is None else f": set {r.want}") for r in refusals)
