"""``dcp-train --framework megatron``: parsed flags -> a Megatron run (or its oracle) -> status.

Launch like the native run: ``torchrun --nproc-per-node N -m runtime.train --framework megatron
--plan P --dataset D`` (gloo on CPU, NCCL with ``--device cuda``); ``--reference`` in one plain
process. The plan header gives dp, cp, tp, pp, vpp and sequence parallelism; the model shape
comes from the usual model flags. Errors a user can fix are ``ValueError``s (the CLI prints them
and exits 2).
"""

from __future__ import annotations

from runtime.adapters.megatron.compat.known_warnings import quiet_upstream_warnings
from runtime.adapters.megatron.trainer.oracle import train_reference
from runtime.adapters.megatron.trainer.train import MegatronTrainer
from runtime.train.config import TrainConfig
from runtime.train.model import GPTConfig
from runtime.train.procgroup import process_group, require_one_process

SUPPORTS_EVAL = True
"""This adapter runs ``--eval-plan`` (Megatron's forward-only schedule on ``EvalSchedule``)."""


def launch(cfg: TrainConfig, model_config: GPTConfig, *, reference: bool) -> int:
    """Run ``cfg`` through Megatron-core (``reference``: its one-process oracle); exit status."""
    if not cfg.verbose:  # Megatron's known warnings (known_warnings.KNOWN_WARNINGS) stay quiet
        quiet_upstream_warnings()
    if reference:
        require_one_process()
    elif cfg.device == "cpu" and cfg.dtype == "bf16" and cfg.megatron.grad_sync != "pool":
        # Megatron's bf16 (bf16 weights, fp32 main weights) runs on CUDA tensors only; on the
        # CPU the adapter trains in fp32, as its tests do.
        raise ValueError("--framework megatron --bf16 is Megatron's mixed precision, for "
                         "--device cuda; on the CPU train in fp32 (--dtype fp32)")
    # Megatron's oracle builds its model on a process group of one rank, so it runs inside too.
    with process_group(cfg):
        if reference:
            train_reference(cfg, model_config)
            return 0
        trainer = MegatronTrainer(cfg, model_config)
        try:
            trainer.run()
        finally:
            trainer.close()
    return 0
