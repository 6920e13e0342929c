"""The launcher with a probe or a mutation in front of it (tests only): ``probe.py MODE ARGS``.

Modes:
- ``flops``: record, per training iteration, the real tokens and the sum of squared sequence
  lengths Megatron-LM's FLOPs figure receives (``num_floating_point_operations``), to
  ``$DCP_PROBE_OUT`` on rank 0;
- ``no-rope-rebinding``: the forward step does not bind the microbatch's CP group into the
  layers (RoPE keeps the build-time group; the core attention still reads the batch's);
- ``no-recompute-rebinding``: a recomputed forward does not re-enter the binding;
- ``no-router-rebinding``: a MoE model's routers keep the build-time TP x CP group (their
  counts and load-balancing statistics reduce over it, not over the microbatch's group);
- ``no-host-memory``: the host reports no available memory (the memory check's budget is the
  weights a rank holds).
A mutation must make the run fail or diverge from the oracle.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))))))


def _flops() -> None:
    from runtime.adapters.megatron_lm import mlm

    original = mlm.training.num_floating_point_operations
    path = os.environ["DCP_PROBE_OUT"]

    def counted(args: Any, batch_size: Any, *a: Any, **kw: Any) -> Any:
        if int(os.environ.get("RANK", "0")) == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"tokens": kw.get("total_real_tokens_in_batch"),
                                    "squares": kw.get("seqlen_squared_sum_in_batch")}) + "\n")
        return original(args, batch_size, *a, **kw)
    mlm.training.num_floating_point_operations = counted


def _no_rope_rebinding() -> None:
    from runtime.adapters.megatron.binding import forward

    @contextlib.contextmanager
    def unbound(model: Any, cp_group: Any, tp_cp_group: Any = None) -> Iterator[None]:
        del model, cp_group, tp_cp_group
        yield
    forward.bind_cp_group = unbound  # type: ignore[attr-defined]


def _no_recompute_rebinding() -> None:
    from runtime.adapters.megatron.binding import recompute

    recompute.rebound = lambda function, binding: function


def _no_router_rebinding() -> None:
    from runtime.adapters.megatron.binding import routers
    from runtime.adapters.megatron.compat import mcore

    def build_time(self: Any, batch: Any) -> Any:
        del self, batch
        return mcore.parallel_state.get_tensor_and_context_parallel_group()
    routers.RouterSteps.tp_cp_group = build_time  # type: ignore[method-assign]


def _no_host_memory() -> None:
    import runtime.calibrate.memory as host

    host.host_available_bytes = lambda: 0


MODES = {"flops": _flops, "no-host-memory": _no_host_memory,
         "no-rope-rebinding": _no_rope_rebinding,
         "no-recompute-rebinding": _no_recompute_rebinding,
         "no-router-rebinding": _no_router_rebinding}

if __name__ == "__main__":
    mode = sys.argv[1]
    from runtime.adapters.megatron_lm.cli import main

    if mode == "flops":  # after the launcher imported megatron.training (mlm's shims)
        from runtime.adapters.megatron_lm import mlm  # noqa: F401
    MODES[mode]()
    sys.exit(main(sys.argv[2:]))
