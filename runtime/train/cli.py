"""``dcp-train``: train by replaying a plan, or run the single-process reference.

Launch: ``torchrun --nproc-per-node N -m runtime.train --plan P --dataset D`` (gloo on CPU, NCCL
on CUDA), or one plain process for a plan whose pool is 1 and for ``--reference``. The parallel
layout comes from the plan header; the live job is only checked against it.

``--framework`` picks the engine from ``runtime.adapters.FRAMEWORKS``: ``native`` runs
``runtime.train.Trainer`` (and ``runtime.train.oracle`` for ``--reference``); any other
name hands the parsed configs to that adapter's ``launch``.

``--steps K`` is the absolute step to stop before (the run executes steps [start, K), start = 0
or the resumed step), so a resumed run with the same ``--steps`` ends where the uninterrupted
one does. One JSON line per step (rank 0): step, loss, tokens (real tokens of the step), loss
tokens, microbatches, seconds, tokens_per_s. With ``--eval-plan``, after every
``--eval-interval`` steps and after the last, right after that step's line: one line
after_step (the 0-based step it follows), eval_loss, eval_tokens, eval_microbatches, seconds
(``runtime.train.evaluate``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

import torch

from planner.cli.args import (
    ArgumentParser,
    HelpFormatter,
    add_json_arguments,
    add_version,
    error_text,
    flag_message,
    nonnegative_int,
    refuse,
    seed_int,
)
from planner.cli.guard import signals_raise
from planner.sources.dataset import parse_data_path
from planner.sources.fieldname import override_notice
from runtime.adapters import FRAMEWORKS, load_launcher
from runtime.dist.topology import SameOnEveryRank
from runtime.train.backends import ATTENTIONS
from runtime.train.config import DTYPES, TrainConfig
from runtime.train.guards import Terminated, describe_dist_error, raise_terminated
from runtime.train.megatron_options import GRAD_SYNCS, LOAD_BALANCING_TYPES, MegatronOptions
from runtime.train.model import (
    MODEL_FLAGS,
    GPTConfig,
    add_model_arguments,
    model_config_from_args,
)
from runtime.train.oracle import train_reference
from runtime.train.preflight import check_outputs, require_training_plan
from runtime.train.procgroup import process_group, require_one_process
from runtime.train.trainer import Trainer

TRAIN_FLAGS = {**MODEL_FLAGS, "save_every": "--save-every", "steps": "--steps",
               "attention": "--attention", "dtype": "--dtype", "device": "--device"}
"""Config fields -> flags, for error messages."""

REFUSED = {
    "--micro-batch-size": "the plan fixes every step's microbatches (dcp-plan "
    "--max-tokens-per-rank)",
    "--global-batch-size": "the plan fixes every step's samples: give it to dcp-plan",
    "--seq-length": "samples keep their own lengths; the plan says how they are packed",
    "--context-parallel-size": "the plan's header fixes the parallel layout: give it to "
    "dcp-plan, then launch dp x cp ranks",
    "--tensor-model-parallel-size": "the plan's header fixes the parallel layout (dcp-plan "
    "--tp); dcp-train's model runs tp = 1, Megatron's with --framework megatron",
    # Mixture-of-experts features the adapter does not run under dynamic CP (yet).
    "--expert-model-parallel-size": "expert parallelism is not supported yet: every rank "
    "holds all experts (EP 1; experts split over --tp as the dense layers are)",
    "--expert-tensor-parallel-size": "experts are split over the plan's tp, as the dense "
    "layers are",
    "--moe-expert-capacity-factor": "routing is dropless: with a capacity, whether a token "
    "reaches its experts depends on the other tokens of its microbatch, so on how the plan "
    "packed the step; drop it",
    "--moe-pad-expert-input-to-capacity": "routing is dropless (no capacity); drop it",
    "--moe-token-drop-policy": "routing is dropless (no token is dropped); drop it",
    "--moe-z-loss-coeff": "the router z-loss is not handled under dynamic CP yet; balance "
    "with --moe-aux-loss-coeff and --moe-router-load-balancing-type",
    "--moe-router-enable-expert-bias": "the expert-bias update is not handled under dynamic CP "
    "yet; use --moe-router-load-balancing-type global_aux_loss",
    "--moe-token-dispatcher-type": "the adapter runs Megatron's alltoall dispatcher",
    "--moe-input-jitter-eps": "random jitter per token makes the run depend on how the plan "
    "packs the tokens; drop it",
    "--moe-grouped-gemm": "experts run as Megatron's SequentialMLP (grouped GEMMs are not "
    "supported yet); drop it",
}
"""Megatron flags that mean nothing to dcp-train, refused with what to do instead."""


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dcp-train", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_version(p)
    p.add_argument("--plan", required=True, help="plan file (.arrow) made by dcp-plan")
    p.add_argument("--dataset", nargs="+", default=None, metavar="PATH",
                   help="the dataset the plan was made for: files, directories or globs in "
                   "dcp-plan's order (default: the files the plan's header lists)")
    p.add_argument("--data-path", nargs="+", default=None, metavar="[WEIGHT] PATH",
                   help="Megatron-style alternative to --dataset (the weights are the plan's; "
                   "they are read and ignored here)")
    p.add_argument("--field", default=None, metavar="NAME",
                   help="record field (JSONL) or column (Parquet, Arrow) holding the tokens "
                   "(default: the one the plan was made with, dcp-plan --field, recorded in its "
                   "header; else input_ids, then tokens). Only for a dataset whose field was "
                   "renamed since planning: NAME is read instead, with a one-line notice, and "
                   "the plan's fingerprints still check what is read")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a text plan's tokenizer (tokenizer.json or a folder holding one), "
                   "where it is not at the path the plan recorded (dcp-plan --tokenizer); its "
                   "sha256 must be the plan's. A text plan's records are tokenized on the fly "
                   "with it; --vocab-size must hold its ids")
    p.add_argument("--steps", "--train-iters", dest="steps", type=nonnegative_int, default=0,
                   help="absolute step to stop before (0: all steps of the plan)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the initial weights")
    p.add_argument("--log-jsonl", default="", help="rank 0 appends one JSON line per step here")
    p.add_argument("--reference", action="store_true",
                   help="single-process oracle: every sequence alone, no CP, no packing")
    p.add_argument("--framework", choices=tuple(FRAMEWORKS), default="native",
                   help="training engine: native (this project's small GPT and loop), megatron "
                        "(Megatron-core's schedules), torchtitan (torchtitan's trainer); "
                        "--reference is each one's oracle")
    p.add_argument("--attention", choices=ATTENTIONS, default="reference",
                   help="CP attention: reference (all-gather, CPU/GPU), te, torch (CUDA)")
    p.add_argument("--save", default="", help="checkpoint directory written at the end")
    p.add_argument("--save-every", "--save-interval", dest="save_every", type=nonnegative_int,
                   default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", "--load", dest="resume", default="",
                   help="checkpoint directory to continue from")
    p.add_argument("--replace-checkpoints", action="store_true",
                   help="let --save replace checkpoints of another run in its directory, or "
                   "move its latest back to an earlier step (refused without this flag; "
                   "with --framework torchtitan refused, as it keeps no latest to move)")
    p.add_argument("--quiet", action="store_true",
                   help="no per-step lines, no progress bar, no text summary")
    p.add_argument("--verbose", action="store_true",
                   help="also print the framework's known upstream warnings, silenced by "
                   "default (each listed with why it does not apply: runtime/train/quiet.py); "
                   "unknown warnings always print")
    add_json_arguments(p)
    ev = p.add_argument_group("evaluation", "an eval plan (dcp-plan DATA --eval) run forward only "
                              "during training; rank 0 writes one JSON line per evaluation")
    ev.add_argument("--eval-plan", default="", help="evaluation plan (.arrow, kind eval); its "
                    "pool, tp and pp must be the training plan's")
    ev.add_argument("--eval-dataset", default="", help="the dataset the eval plan was made for")
    ev.add_argument("--eval-field", default=None, metavar="NAME",
                    help="as --field, for the eval dataset (default: the eval plan's field)")
    ev.add_argument("--eval-interval", type=nonnegative_int, default=0, metavar="K",
                    help="evaluate after every K training steps and after the last "
                    "(0: only after the last)")
    ev.add_argument("--eval-steps", type=nonnegative_int, default=0, metavar="M",
                    help="evaluate only the eval plan's first M steps (0: all of it)")
    p.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="skip the check, before the first step, of the heaviest microbatch's "
                   "estimated peak memory against the GPU, or on CPU the host's available "
                   "memory shared by its ranks")
    p.add_argument("--skip-nonfinite-steps", action="store_true",
                   help="skip the update of a step whose loss or gradients are NaN/inf "
                   "(default: stop with an error naming the step)")
    p.add_argument("--distributed-timeout-minutes", type=float, default=10.0, metavar="MIN",
                   help="timeout of every process group: a stalled rank ends the job "
                   "(default 10)")
    add_model_arguments(p)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="fp32, or bf16 autocast with fp32 master weights")
    p.add_argument("--bf16", dest="dtype", action="store_const", const="bf16",
                   help="Megatron's spelling of --dtype bf16")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    mg = p.add_argument_group("Megatron-core", "--framework megatron only (Megatron-LM's names)")
    mg.add_argument("--use-distributed-optimizer", action="store_true",
                    help="Megatron's distributed optimizer: fp32 main weights and Adam state "
                    "sharded over the pool, gradients reduce-scattered")
    mg.add_argument("--overlap-grad-reduce", action="store_true",
                    help="reduce gradient buckets during the last microbatch's backward")
    mg.add_argument("--overlap-param-gather", action="store_true",
                    help="all-gather parameter buckets during the next forward (needs "
                    "--use-distributed-optimizer)")
    mg.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                    help="elements per gradient bucket (default: Megatron's, max(4e7, 1e6 x "
                    "pool))")
    mg.add_argument("--clip-grad", type=float, default=0.0, metavar="NORM",
                    help="clip the global gradient norm (0: off; Megatron-LM's default is 1.0)")
    mg.add_argument("--grad-sync", choices=GRAD_SYNCS, default="megatron-ddp",
                    help="megatron-ddp (Megatron's DistributedDataParallel) or pool (the "
                    "adapter's plain all-reduce per gradient, the benchmark baseline)")
    mg.add_argument("--num-experts", type=nonnegative_int, default=0, metavar="E",
                    help="mixture of experts: E experts in every layer's MLP (0: dense)")
    mg.add_argument("--moe-router-topk", type=int, default=2, metavar="K",
                    help="experts per token (dropless routing)")
    mg.add_argument("--moe-ffn-hidden-size", type=nonnegative_int, default=0, metavar="N",
                    help="each expert's SwiGLU width (0: --ffn-hidden-size)")
    mg.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, metavar="C",
                    help="weight of the load-balancing loss (0: none)")
    mg.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES,
                    default="aux_loss",
                    help="aux_loss: per microbatch CP group (depends on the packing); "
                    "seq_aux_loss: per sequence; global_aux_loss: per step (one extra forward "
                    "pass a step for the step's routing statistics)")
    mg.add_argument("--mtp-num-layers", type=nonnegative_int, default=0, metavar="D",
                    help="multi-token prediction: D extra layers, layer d predicting the token "
                    "d + 1 ahead (0: none)")
    mg.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1, metavar="S",
                    help="weight S of the MTP loss: S / D times the sum over depths of each "
                    "depth's loss, per LM loss token")
    refuse(p, REFUSED)
    return p


def _megatron_options(a: argparse.Namespace) -> MegatronOptions:
    return MegatronOptions(use_distributed_optimizer=a.use_distributed_optimizer,
                           overlap_grad_reduce=a.overlap_grad_reduce,
                           overlap_param_gather=a.overlap_param_gather,
                           ddp_bucket_size=a.ddp_bucket_size, clip_grad=a.clip_grad,
                           grad_sync=a.grad_sync, num_experts=a.num_experts,
                           moe_router_topk=a.moe_router_topk,
                           moe_ffn_hidden_size=a.moe_ffn_hidden_size,
                           moe_aux_loss_coeff=a.moe_aux_loss_coeff,
                           moe_router_load_balancing_type=a.moe_router_load_balancing_type,
                           mtp_num_layers=a.mtp_num_layers,
                           mtp_loss_scaling_factor=a.mtp_loss_scaling_factor)


def _plan_datasets(parser: argparse.ArgumentParser, plan: str) -> tuple[str, ...]:
    """The dataset files a plan's header lists (format 2), or its one path (format 1)."""
    from planner.planfile.io import PlanFile
    from planner.sources.dataset import plan_items

    try:
        with PlanFile(plan) as f:
            d = f.header.dataset
    except (OSError, ValueError) as e:
        parser.error(f"--plan: {e}")
    return plan_items(d.files, d.path)


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, GPTConfig, bool, str]:
    """Parse ``dcp-train``'s flags into (TrainConfig, GPTConfig, reference, framework)."""
    p = _parser()
    a = p.parse_args(argv)
    if a.dataset and a.data_path:
        p.error("give the dataset with --dataset or --data-path, not both")
    for flag, value in (("--field", a.field), ("--eval-field", a.eval_field)):
        if value is not None and not value.strip():
            p.error(f"{flag} needs a field name")
    items: tuple[str, ...]
    if a.data_path:
        try:
            items = tuple(parse_data_path(a.data_path)[0])
        except ValueError as e:
            p.error(str(e))
    else:
        items = tuple(a.dataset or ()) or _plan_datasets(p, a.plan)
    try:
        model_config = model_config_from_args(a)
        cfg = TrainConfig(plan=a.plan, dataset=items[0] if len(items) == 1 else " ".join(items),
                          datasets=items if len(items) > 1 else (), field=a.field,
                          tokenizer=a.tokenizer,
                          eval_field=a.eval_field, steps=a.steps,
                          device=a.device, seed=a.seed, attention=a.attention, dtype=a.dtype,
                          lr=a.lr, weight_decay=a.weight_decay, verbose=a.verbose,
                          log_jsonl=a.log_jsonl,
                          save=a.save, save_every=a.save_every, resume=a.resume, quiet=a.quiet,
                          replace_checkpoints=a.replace_checkpoints,
                          json=a.json, summary_json=a.summary_json,
                          eval_plan=a.eval_plan, eval_dataset=a.eval_dataset,
                          eval_interval=a.eval_interval, eval_steps=a.eval_steps,
                          skip_nonfinite_steps=a.skip_nonfinite_steps,
                          memory_check=a.memory_check,
                          distributed_timeout_minutes=a.distributed_timeout_minutes,
                          megatron=_megatron_options(a))
    except ValueError as e:
        p.error(flag_message(str(e), TRAIN_FLAGS))
    changed = cfg.megatron.changed()
    if changed and a.framework != "megatron":
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        p.error(f"{flags}: Megatron-core options; use them with --framework megatron")
    return cfg, model_config, a.reference, a.framework


def _field_notices(cfg: TrainConfig) -> None:
    """One line on stderr (rank 0) for each ``--field`` / ``--eval-field`` that overrides the
    field its plan was made with (``planner.sources.fieldname``: the override wins)."""
    from planner.planfile.io import PlanFile

    if os.environ.get("RANK", "0") != "0":
        return
    for plan, given, flag in ((cfg.plan, cfg.field, "--field"),
                              (cfg.eval_plan, cfg.eval_field, "--eval-field")):
        if given is None or not plan:
            continue
        try:
            with PlanFile(plan) as f:
                recorded = f.header.dataset.field
        except (OSError, ValueError):
            continue  # the run reports an unreadable plan itself
        notice = override_notice(recorded, given, plan, flag=flag)
        if notice:
            print(f"dcp-train: {notice}", file=sys.stderr)


def _require_training_plan(plan: str) -> None:
    """An evaluation plan given as ``--plan`` is refused (``preflight.require_training_plan``)."""
    from planner.planfile.io import PlanFile

    with PlanFile(plan) as f:
        require_training_plan(f.header.kind, plan)


def main(argv: Sequence[str] | None = None) -> int:
    """``dcp-train``; returns the process exit status."""
    cfg, model_config, reference, framework = parse_args(argv)
    _field_notices(cfg)
    torch.manual_seed(cfg.seed)
    with signals_raise(raise_terminated):  # SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, ...
        return _main(cfg, model_config, reference, framework)


def _main(cfg: TrainConfig, model_config: GPTConfig, reference: bool, framework: str) -> int:
    try:
        # Before any work, on every rank and for every engine: the outputs are safe to write,
        # and the plan is one to train.
        check_outputs(cfg)
        _require_training_plan(cfg.plan)
        if framework != "native":
            launch = load_launcher(framework)
            # An adapter opts in to evaluation (module flag SUPPORTS_EVAL, set once its launch
            # runs cfg.eval_plan through runtime.data.evaluation); otherwise the flags would be
            # silently ignored.
            if cfg.eval_plan and not getattr(sys.modules[launch.__module__], "SUPPORTS_EVAL",
                                             False):
                raise ValueError(f"--framework {framework} does not run --eval-plan yet (its "
                                 f"adapter, {launch.__module__}, sets no SUPPORTS_EVAL); "
                                 "evaluate with --framework native")
            return launch(cfg, model_config, reference=reference)
        if reference:
            require_one_process()
            train_reference(cfg, model_config)
            return 0
        with process_group(cfg):
            trainer = Trainer(cfg, model_config)
            try:
                trainer.run()
            finally:
                trainer.close()
    except (ValueError, OSError) as e:
        if not (isinstance(e, SameOnEveryRank) and os.environ.get("RANK", "0") != "0"):
            print(f"dcp-train: error: {flag_message(error_text(e), TRAIN_FLAGS)}",
                  file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        print(f"dcp-train: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except RuntimeError as e:  # a collective that timed out or lost its peer
        message = describe_dist_error(e, cfg.distributed_timeout_minutes)
        if message is None:
            raise
        print(f"dcp-train: error: {message}", file=sys.stderr)
        return 3
    return 0

