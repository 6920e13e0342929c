"""The run's log: ``StepLog`` and ``EvalLog`` (one JSON line per training step and per
evaluation), ``StepLogger`` (rank 0's writer: stdout, ``--log-jsonl``, the progress bar, and
the end-of-run summary of ``run_summary`` / ``format_run_summary``), and ``TrainResult``
(the records, with the final state on request, that a run returns to its caller).

Every engine writes these same records, the native loop and its oracle as well as each
framework adapter, so two runs of one plan compare line by line (``loss``, ``tokens``,
``loss_tokens``) whatever ``--framework`` ran them; keys that only some engines know
(``grad_norm``, MoE and MTP terms) are left out of a line rather than written as null.

A closed stdout (``dcp-train ... | head -1``: the reader ended, the next write is EPIPE) stops
the printing, never the training: the logger says so once on stderr, sends stdout to
``/dev/null`` (so no later print, nor Python's flush at exit, fails) and the run goes on to its
checkpoints, ``--log-jsonl`` and ``--summary-json``.

Trade-off: the logger keeps every step's record in memory until ``close``, so the summary can
give exact medians and totals; a small record per step, fine for the step counts of a plan.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from typing import IO, Any

import torch

from planner.cli.args import emit_summary
from planner.cli.progress import Progress
from planner.fileguard import open_log
from planner.prediction import WARMUP_STEPS, StepPrediction, agreement, agreement_text
from runtime.train.config import TrainConfig


@dataclass(frozen=True, slots=True)
class StepLog:
    """One step's record (one JSON line)."""

    step: int
    loss: float
    tokens: int
    loss_tokens: int
    microbatches: int
    seconds: float
    skipped: bool = False
    """The step's loss or gradients were not finite and its update was skipped."""
    grad_norm: float | None = None
    """The global gradient norm the optimizer reported (Megatron's), where it reports one."""
    moe_aux_loss: float | None = None
    """A MoE model's load-balancing term of the step (weighted by its coefficient)."""
    moe_tokens_per_expert: list[list[int]] | None = None
    """A MoE model's real tokens per expert in the step, one list per MoE layer."""
    mtp_loss: list[float] | None = None
    """Multi-token prediction: each depth's per-token loss over the step (unweighted)."""
    predicted_s: float | None = None
    """The plan's simulated seconds of this step (``planner.prediction``), beside the measured
    ``seconds``; ``StepLogger`` fills it in from the plan when the engine leaves it None."""

    def to_json(self) -> str:
        d: dict[str, Any] = {
            "step": self.step, "loss": self.loss, "tokens": self.tokens,
            "loss_tokens": self.loss_tokens, "microbatches": self.microbatches,
            "seconds": round(self.seconds, 6),
            **({} if self.predicted_s is None else {"predicted_s": self.predicted_s}),
            "tokens_per_s": round(self.tokens / max(self.seconds, 1e-9), 1)}
        for name in ("grad_norm", "moe_aux_loss", "moe_tokens_per_expert", "mtp_loss"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        if self.skipped:
            d["skipped"] = True
        return json.dumps(d)


@dataclass(frozen=True, slots=True)
class EvalLog:
    """One evaluation's record (one JSON line), written by rank 0 right after the line of
    training step ``after_step``: the per-token loss over the pool, the loss tokens it averaged
    and the microbatches each rank ran.

    ``after_step`` is 0-based like ``StepLog.step`` (the final evaluation of a 3-step run
    follows step 2). It replaced ``eval_at_step`` (the count of completed steps, one more):
    the two read alike beside ``"step"`` and disagreed by one, so the old key is not kept.
    """

    after_step: int
    """The 0-based training step this evaluation follows."""
    eval_loss: float
    eval_tokens: int
    eval_microbatches: int
    seconds: float

    def to_json(self) -> str:
        return json.dumps({"after_step": self.after_step, "eval_loss": self.eval_loss,
                           "eval_tokens": self.eval_tokens,
                           "eval_microbatches": self.eval_microbatches,
                           "seconds": round(self.seconds, 6)})


@dataclass(slots=True)
class TrainResult:
    """What a run returns to a caller (tests): its step logs and, on request, the final weights
    and the last step's gradients (reduced over the pool and divided by the token count)."""

    logs: list[StepLog] = field(default_factory=list)
    evals: list[EvalLog] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


class StepLogger:
    """Rank 0's per-step output: a JSON line to stdout and, if asked, to a file; a progress bar
    on stderr when it is a terminal (``begin`` gives the step count, for the ETA); at ``close``,
    the run's summary (``run_summary``) as text on stderr, JSON on stdout (``--json``) and in
    ``--summary-json FILE``."""

    def __init__(self, cfg: TrainConfig, enabled: bool,
                 summary_fields: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.summary_fields = dict(summary_fields or {})
        """Facts of the engine that ran (framework, versions, ...), added to the summary."""
        self.cfg = cfg
        self.quiet = cfg.quiet
        self.stdout_closed = False
        self.file: IO[str] | None = None
        self.logs: list[StepLog] = []
        self.evals: list[EvalLog] = []
        self._prediction: StepPrediction | None = None
        self.bar = Progress("training", unit="step", enabled=enabled and cfg.progress
                            and not cfg.quiet)
        if enabled and cfg.log_jsonl:
            # Appends only to an empty file or a log of this tool (planner.fileguard).
            self.file = open_log(cfg.log_jsonl)

    def begin(self, num_steps: int) -> None:
        """The run will log ``num_steps`` steps (sizes the progress bar)."""
        self.bar(0, num_steps)

    def write(self, log: StepLog | EvalLog) -> None:
        if not self.enabled:
            return
        if isinstance(log, StepLog) and log.predicted_s is None and self.cfg.plan:
            if self._prediction is None:
                self._prediction = StepPrediction(self.cfg.plan)
            log = replace(log, predicted_s=self._prediction(log.step))
        line = log.to_json()
        if not self.quiet:
            self._print(self.bar.write, line)
        if isinstance(log, StepLog):
            self.logs.append(log)
            self.bar.update(1, loss=f"{log.loss:.4f}")
        else:
            self.evals.append(log)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        self.bar.close()
        if self._prediction is not None:
            self._prediction.close()
            self._prediction = None
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.enabled and self.logs and (self.cfg.json or self.cfg.summary_json
                                           or not self.cfg.quiet):
            summary = {**run_summary(self.cfg, self.logs), **self.summary_fields}
            if self.evals:
                summary["evaluations"] = len(self.evals)
                summary["eval_loss_last"] = self.evals[-1].eval_loss
            if not self.cfg.json and not self.cfg.quiet:
                print(format_run_summary(summary), file=sys.stderr, flush=True)
            if self.cfg.json and not self.stdout_closed:
                self._print(lambda _: emit_summary(summary, "", as_json=True, json_path=""), "")
            emit_summary(summary, "", as_json=False, json_path=self.cfg.summary_json)

    def _print(self, write: Any, line: str) -> None:
        """``write(line)`` to stdout; a closed stdout ends the printing (module docstring)."""
        try:
            write(line)
        except BrokenPipeError:
            self.quiet = self.stdout_closed = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)
            print("dcp-train: notice: stdout was closed (its reader ended, as with | head); "
                  "training goes on without printing the steps"
                  + (f" (they go to {self.cfg.log_jsonl})" if self.cfg.log_jsonl else ""),
                  file=sys.stderr, flush=True)


def run_summary(cfg: TrainConfig, logs: list[StepLog]) -> dict[str, Any]:
    """Every end-of-run figure of a training run, JSON-ready."""
    seconds = sorted(log.seconds for log in logs)
    total = float(sum(seconds))
    tokens = sum(log.tokens for log in logs)
    n = len(seconds)
    median = seconds[n // 2] if n % 2 else (seconds[n // 2 - 1] + seconds[n // 2]) / 2
    out: dict[str, Any] = {
        "plan": cfg.plan, "dataset": list(cfg.dataset_paths), "num_steps": n,
        "first_step": logs[0].step, "last_step": logs[-1].step,
        "loss_first": logs[0].loss, "loss_last": logs[-1].loss,
        "tokens": tokens, "loss_tokens": sum(log.loss_tokens for log in logs),
        "microbatches": sum(log.microbatches for log in logs),
        "seconds": total, "seconds_per_step_mean": total / n,
        "seconds_per_step_median": median, "seconds_per_step_min": seconds[0],
        "seconds_per_step_max": seconds[-1],
        "tokens_per_second": tokens / total if total > 0 else None}
    if any(log.predicted_s is not None for log in logs):
        # The plan's prediction against these measurements, after the warm-up steps
        # (planner.prediction): the cost model's scale error and its rank correlation.
        out["prediction"] = agreement([log.step for log in logs], [log.seconds for log in logs],
                                      [log.predicted_s for log in logs], WARMUP_STEPS)
    return out


def format_run_summary(s: dict[str, Any]) -> str:
    """One line of the run's summary (stderr; stdout keeps the JSON lines)."""
    rate = s["tokens_per_second"]
    return (f"dcp-train: {s['num_steps']} steps ({s['first_step']}-{s['last_step']}), loss "
            f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}, {s['tokens']:,} tokens in "
            f"{s['seconds']:.1f} s ({s['seconds_per_step_mean']:.2f} s/step mean, "
            f"{s['seconds_per_step_median']:.2f} median"
            + (f", {rate:,.0f} tokens/s)" if rate else ")")
            + (f"; prediction: {agreement_text(s['prediction'])}" if "prediction" in s else ""))
