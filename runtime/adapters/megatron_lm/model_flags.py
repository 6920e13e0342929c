"""The MoE and multi-token prediction flags on the plan path: what runs, what is refused.

A MoE (``--num-experts``) or MTP (``--mtp-num-layers``) job runs through the binding that
``dcp-train --framework megatron`` uses, so it is refused what that path refuses
(``binding.routers.moe_refusals``, ``binding.mtp.mtp_refusals``, checked here on a view of
Megatron-LM's arguments under ``TransformerConfig``'s field names and worded in Megatron-LM's
flag names), and, because the launcher's oracle builds the model from a few flags only, every
other ``moe_*`` / ``mtp_*`` setting away from Megatron's default (``TransformerConfig``'s
dataclass defaults, which Megatron-LM's parser uses) is refused too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from runtime.adapters.megatron.binding.refusal import Refusal

Args = Any
"""Megatron-LM's argument namespace (``argparse.Namespace``)."""

RUN = frozenset({"moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff",
                 "moe_router_load_balancing_type", "moe_token_dispatcher_type",
                 "mtp_num_layers", "mtp_loss_scaling_factor"})
"""The MoE / MTP settings the plan path runs and its oracle builds: top-k softmax routing into
Megatron's SequentialMLP experts (dropless, alltoall, one load-balancing type); MTP depth and
weight. Any other ``moe_*`` / ``mtp_*`` flag away from its default is refused."""

_FLAGS = {"num_moe_experts": "--num-experts",
          "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank"}


class _ConfigView:
    """Megatron-LM's arguments under ``TransformerConfig``'s field names."""

    def __init__(self, args: Args) -> None:
        self._args = args

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, "num_experts" if name == "num_moe_experts" else name, None)


def flag_of(field: str) -> str:
    """Megatron-LM's flag of a ``TransformerConfig`` field."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _worded(view: Any, refusals: list[Refusal]) -> list[str]:
    out = []
    for r in refusals:
        flag = flag_of(r.field)
        fix = ("" if r.want is None else "; drop the flag" if r.want in ("None", "False")
               else f"; give {flag} {r.want.strip(chr(39))}")
        out.append(f"{flag} {getattr(view, r.field)}: refused: {r.why}{fix}")
    return out


def refusals(args: Args) -> list[str]:
    """Every MoE / MTP flag of the job the plan path does not run, one line each (module
    docstring); none for a dense model without MTP."""
    from runtime.adapters.megatron.binding.mtp import mtp_refusals
    from runtime.adapters.megatron.binding.routers import moe_refusals

    view = _ConfigView(args)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    vpp = int(getattr(args, "virtual_pipeline_model_parallel_size", 1) or 1)
    out = _worded(view, moe_refusals(view, tp=tp, sequence_parallel=bool(
        getattr(args, "sequence_parallel", False))) + mtp_refusals(view, tp=tp, vpp=vpp))
    named = {line.split(" ", 1)[0] for line in out}
    prefixes = (("moe_",) if getattr(args, "num_experts", None) else ()) + \
        (("mtp_",) if getattr(args, "mtp_num_layers", None) else ())
    for name, default in _defaults(prefixes).items():
        value = getattr(args, name, default)
        if name not in RUN and value != default and flag_of(name) not in named:
            out.append(f"{flag_of(name)} {value}: refused: the plan path and its oracle run "
                       "top-k softmax routing into Megatron's SequentialMLP experts (dropless, "
                       "alltoall) and plain MTP layers only; leave it at its default "
                       f"({default})")
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, name, None)
        if getattr(args, "num_experts", None) and isinstance(value, (list, tuple)) \
                and len(value) > 1:
            out.append(f"{flag_of(name)} {' '.join(map(str, value))}: refused: the oracle "
                       "computes one load-balancing term; give one value")
    return out


def _defaults(prefixes: tuple[str, ...]) -> dict[str, Any]:
    """Megatron's default of every setting starting with one of ``prefixes``
    (``TransformerConfig``'s, and the two MoE flags Megatron-LM adds: ``--moe-layer-freq``,
    ``--moe-use-upcycling``)."""
    from runtime.adapters.megatron.compat import mcore

    if not prefixes:
        return {}
    out: dict[str, Any] = ({"moe_layer_freq": 1, "moe_use_upcycling": False}
                           if "moe_" in prefixes else {})
    for f in dataclasses.fields(mcore.TransformerConfig):
        if f.name.startswith(prefixes):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
    return out
