"""The run's config: ``TrainConfig`` (every setting of ``dcp-train`` besides the model shape),
``DTYPES`` (its ``--dtype`` names), and the two schedules read off it, ``step_range`` (the steps
a run executes) and ``should_evaluate`` (the steps an evaluation follows).

Every engine takes this one config: the native loop (``runtime.train.trainer``), its oracle
(``runtime.train.oracle``) and each framework adapter (``runtime.adapters.*``), so ``dcp-train``
parses its flags once (``runtime.train.cli``) whatever ``--framework`` runs. ``__post_init__``
rejects what no engine can run (``ValueError`` naming the flag); what only one engine refuses
is that engine's check. The schedules live here, not beside one loop, because every engine must
step and evaluate at the same steps for its logs to be comparable with the oracle's.

Trade-off: one flat dataclass for every engine rather than one per framework. A flag reads the
same under every ``--framework``, at the cost of fields some engines ignore; Megatron's own
settings are grouped in ``MegatronOptions`` (``runtime.train.megatron_options``), which the
other engines refuse unless left at their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.planfile.schema import PlanHeader
from runtime.train.backends import ATTENTIONS
from runtime.train.megatron_options import MegatronOptions

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``--dtype``: the torch dtype each name stands for."""


MAX_TIMEOUT_MINUTES = 525_600
"""The longest ``--distributed-timeout-minutes`` (365 days): beyond, the timeout overflows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything a training run needs besides the model shape."""

    plan: str
    """Path of the plan file."""
    dataset: str
    """The dataset the plan was made for (a path, directory or glob; see ``datasets``)."""
    datasets: tuple[str, ...] = ()
    """Several dataset items in order (``dcp-train --dataset A B``); empty: ``dataset`` alone."""
    field: str | None = None
    """Record field (JSONL) or column (Parquet, Arrow) of the tokens; None: the one the plan
    was made with (its header's ``dataset.field``), which this overrides (a renamed field)."""
    tokenizer: str | None = None
    """A text plan's tokenizer (``tokenizer.json`` or its folder), overriding the path its
    header records (the sha256 must match); None: the recorded path. Refused for a plan of
    token ids."""
    steps: int = 0
    """Absolute step to stop before; 0 means every step of the plan."""
    device: str = "cpu"
    """cpu or cuda."""
    seed: int = 0
    """Seed of the initial weights and of torch's RNG."""
    attention: str = "reference"
    """CP attention: reference (all-gather, any device), te (Transformer Engine, CUDA), torch
    (all-gather + torch's fused varlen kernel on CUDA; an SDPA stand-in on CPU)."""
    dtype: str = "fp32"
    """fp32, or bf16 (autocast; fp32 master weights and optimizer)."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    verbose: bool = False
    """Show the framework's known upstream warnings (``runtime.train.quiet``), silenced by
    default."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    log_jsonl: str = ""
    """File that rank 0 appends one JSON line per step to; empty: stdout only."""
    save: str = ""
    """Checkpoint directory written at the end (and every save_every steps)."""
    save_every: int = 0
    """Steps between checkpoints; 0: only at the end."""
    resume: str = ""
    """Checkpoint directory to continue from."""
    replace_checkpoints: bool = False
    """Let ``save`` replace another run's checkpoints in its directory, or move its ``latest``
    back to an earlier step; refused otherwise (``checkpoint.check_continues``)."""
    quiet: bool = False
    """Do not print the per-step lines."""
    eval_plan: str = ""
    """Evaluation plan (``dcp-plan --eval``) run forward only during training; empty: none."""
    eval_dataset: str = ""
    """The dataset the eval plan was made for (required with ``eval_plan``)."""
    eval_field: str | None = None
    """As ``field``, for the eval dataset (None: the eval plan's recorded field)."""
    eval_interval: int = 0
    """Evaluate after every ``eval_interval`` training steps (absolute: after steps K, 2K, ...)
    and after the run's last step; 0: only after the last step."""
    eval_steps: int = 0
    """Evaluate only the eval plan's first ``eval_steps`` steps; 0: the whole eval plan."""
    json: bool = False
    """Print the end-of-run summary as one JSON line on stdout (after the step lines)."""
    summary_json: str = ""
    """File the end-of-run summary is written to as JSON."""
    progress: bool = True
    """A progress bar (rate, ETA) on stderr when it is a terminal (rank 0)."""
    memory_check: bool = True
    """Refuse, before the first step, a run whose heaviest microbatch's estimated peak
    exceeds a rank's memory (``runtime.train.memcheck``)."""

    skip_nonfinite_steps: bool = False
    """Skip the update of a step whose loss or gradients are not finite (logged) instead of
    stopping the run."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of every process group (Megatron's flag): a stalled rank ends the job."""
    megatron: MegatronOptions = MegatronOptions()
    """Megatron-core's DDP and optimizer settings (``--framework megatron`` only)."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got "
                             f"{self.attention!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.steps < 0 or self.save_every < 0:
            raise ValueError("steps and save_every must be >= 0")
        if self.eval_interval < 0 or self.eval_steps < 0:
            raise ValueError("--eval-interval and --eval-steps must be >= 0")
        if self.eval_plan and not self.eval_dataset:
            raise ValueError("--eval-plan needs --eval-dataset (the dataset the eval plan was "
                             "made for)")
        if not self.eval_plan and (self.eval_dataset or self.eval_interval or self.eval_steps
                                   or self.eval_field is not None):
            raise ValueError("--eval-dataset, --eval-field, --eval-interval and --eval-steps "
                             "need --eval-plan")
        for name in ("field", "eval_field"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must be a field name or None, got ''")
        if not 0 < self.distributed_timeout_minutes <= MAX_TIMEOUT_MINUTES:
            # inf or 1e308 overflowed timedelta / torch's milliseconds (a traceback).
            raise ValueError("--distributed-timeout-minutes must be > 0 and at most "
                             f"{MAX_TIMEOUT_MINUTES} (about a year), got "
                             f"{self.distributed_timeout_minutes}")
        # The torch path also runs on CPU, with an SDPA stand-in for the CUDA kernel (tests).
        if self.attention == "te" and self.device != "cuda":
            raise ValueError("--attention te needs --device cuda")

    def eval_tokenizer(self, header: PlanHeader) -> str | None:
        """``tokenizer`` for the eval plan of ``header`` if that plan is of text too (the
        training plan's text tokenizer may evaluate on a plan of token ids)."""
        return self.tokenizer if header.dataset.tokenizer else None

    @property
    def dataset_paths(self) -> tuple[str, ...]:
        """What ``open_token_source`` opens: ``datasets``, else ``dataset``."""
        return self.datasets or (self.dataset,)


def should_evaluate(cfg: TrainConfig, step: int, last_step: int) -> bool:
    """Whether to evaluate after training step ``step`` (0-based) of a run ending at
    ``last_step``: every ``eval_interval`` completed steps, counted from step 0 (so a resumed
    run evaluates where the uninterrupted one does), and after the last step, once."""
    if not cfg.eval_plan:
        return False
    done = step + 1
    return step == last_step or (cfg.eval_interval > 0 and done % cfg.eval_interval == 0)


def step_range(cfg: TrainConfig, start: int, num_steps: int) -> range:
    """The absolute steps a run executes: from ``start`` (0, or the step a resume continues
    at) to ``cfg.steps`` or the plan's ``num_steps``, whichever comes first."""
    stop = min(cfg.steps, num_steps) if cfg.steps else num_steps
    return range(start, stop)
