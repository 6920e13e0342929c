"""``--reference``: the launcher's oracle, the same job in one process, every sequence alone.

``python -m runtime.adapters.megatron_lm --reference --plan PLAN --init-seed S -- SCRIPT FLAGS``
parses the user's Megatron-LM flags as a world of one (the split flags dropped: tp, pp, vpp,
SP, static CP, the distributed optimizer, overlap, recomputation, bf16 / fp16, checkpoints,
TensorBoard, W&B; the vocabulary padded for the distributed run's tp, so the shapes agree), so
Megatron-LM's own ``get_optimizer_param_scheduler`` gives the same warmup and decay. The model is
the adapter's oracle model (``model.gpt.build_chunks`` with whole-sequence attention), from the
same split-independent weights (``--init-seed``), trained in fp32 on the CPU with AdamW over
Megatron's parameter groups (no decay on 1-D weights) and Megatron's gradient clipping. A MoE
model's load-balancing term is the adapter's definition computed every segment alone
(``model.oracle_terms.MoETerms``, as ``dcp-train --reference --framework megatron``), and
multi-token prediction's term each segment's depths alone (``MTPTerms``). Every
step runs every sample segment of the plan's step alone (``runtime.train.oracle.reference_step``,
shared with ``dcp-train --reference``); evaluations follow Megatron-LM's (every
``--eval-interval`` iterations and after the last, each over the eval plan's first
``--eval-iters`` steps). The ``--log-jsonl`` lines are the launcher's.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from planner.sources.dataset import plan_items
from runtime.adapters.megatron_lm import LauncherOptions

_VALUE_FLAGS = frozenset({
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--microbatch-group-size-per-virtual-pipeline-stage", "--context-parallel-size",
    "--save", "--load", "--save-interval", "--tensorboard-dir", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--wandb-project", "--wandb-exp-name",
    "--wandb-save-dir", "--ckpt-format", "--make-vocab-size-divisible-by",
    "--distributed-backend", "--transformer-impl", "--data-path"})
_BOOL_FLAGS = frozenset({
    "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--overlap-param-gather", "--bf16", "--fp16", "--recompute-activations",
    "--distribute-saved-activations", "--no-load-optim", "--no-load-rng", "--finetune",
    "--use-cpu-initialization", "--async-save"})
SPLIT_FLAGS = _VALUE_FLAGS | _BOOL_FLAGS
"""The flags a world of one drops (module docstring)."""


def single_process_argv(argv: list[str]) -> tuple[list[str], int, list[str]]:
    """(the flags without ``SPLIT_FLAGS``, the run's tp, ``--data-path``'s values)."""
    out: list[str] = []
    values: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in _VALUE_FLAGS:
            taken = [value] if eq else []
            if not eq:
                i += 1
                while i < len(argv) and not argv[i].startswith("--"):
                    taken.append(argv[i])
                    i += 1
            else:
                i += 1
            values[flag] = taken
            continue
        if flag not in _BOOL_FLAGS:
            out.append(argv[i])
        i += 1
    tp = int((values.get("--tensor-model-parallel-size") or ["1"])[0])
    divisible = int((values.get("--make-vocab-size-divisible-by") or ["128"])[0])
    out += ["--make-vocab-size-divisible-by", str(divisible * tp),
            "--transformer-impl", "local", "--distributed-backend", "gloo"]
    return out, tp, values.get("--data-path", [])


def run(options: LauncherOptions, command: list[str]) -> None:
    """The oracle of ``options`` for the user's ``command`` (module docstring)."""
    if options.init_seed is None:
        raise ValueError("--reference needs --init-seed S (give the distributed run the same, "
                         "so that both start from the same weights)")
    script_args = command[2:] if command[0] == "-m" else command[1:]
    argv, _, data_path = single_process_argv(script_args)
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        os.environ[name] = value
    sys.argv = ["reference", *argv]
    from runtime.adapters.megatron_lm import mlm

    args = mlm.arguments.parse_and_validate_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            _train(options, args, data_path)
        finally:
            dist.destroy_process_group()


def _train(options: LauncherOptions, args: Any, data_path: list[str]) -> None:
    from planner.fileguard import open_log
    from planner.prediction import StepPrediction
    from runtime.adapters.megatron.binding.install import install
    from runtime.adapters.megatron.model.gpt import (
        ModelParallel,
        transformer_config,
    )
    from runtime.adapters.megatron.model.oracle_terms import MoETerms, MTPTerms
    from runtime.adapters.megatron.parallel.optim import adamw_groups
    from runtime.adapters.megatron.trainer.oracle import reference_model, segment_logits
    from runtime.adapters.megatron_lm import flags, mlm, model
    from runtime.adapters.megatron_lm.hooks import _exit
    from runtime.adapters.megatron_lm.session import PlanSession
    from runtime.train.config import TrainConfig
    from runtime.train.oracle import SegmentTerms, reference_eval, reference_step
    from runtime.train.runlog import EvalLog, StepLog

    a: Any = args
    problems = model.check_oracle_shape(a) + flags.refusals(a)
    session = PlanSession(options.plan, options.eval_plan)
    try:
        eval_steps = session.eval_reader.num_steps if session.eval_reader is not None else None
        problems += flags.eval_mismatches(a, options.eval_plan, eval_steps)
        text_problems, tokenizer = flags.text_tokenizer(a, session.header, source=options.plan)
        problems += text_problems
        dataset = options.dataset
        if data_path:
            try:
                dataset = flags.data_path_files(data_path, session.reader, dataset)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            _exit(problems)
        session.open_sources(dataset, options.eval_dataset, tokenizer=tokenizer)
        source = session.source
        assert source is not None
        device = torch.device("cpu")
        install(device)
        model_config = model.gpt_config(a)
        header = session.header
        megatron = model.megatron_options(a)
        # Megatron's own load-balancing loss is off: MoETerms computes the adapter's definition
        # (dcp-train --reference --framework megatron's oracle).
        config = transformer_config(model_config, ModelParallel(dtype=torch.float32), megatron,
                                    **({"moe_aux_loss_coeff": 0.0} if megatron.moe else {}))
        net = reference_model(model_config, config, header, seed=options.init_seed or 0,
                              device=device)
        groups_wd = adamw_groups(net.named_parameters(), a.weight_decay)
        for group, mult in zip(groups_wd, (1.0, 0.0), strict=True):
            group["wd_mult"] = mult
        optimizer = torch.optim.AdamW(groups_wd, lr=a.lr,
                                      betas=(a.adam_beta1, a.adam_beta2),
                                      eps=a.adam_eps, foreach=False)
        scheduler = mlm.training.get_optimizer_param_scheduler(optimizer)
        files = dataset or plan_items(header.dataset.files, header.dataset.path)
        cfg = TrainConfig(plan=options.plan, dataset=files[0], datasets=tuple(files),
                          eval_plan=options.eval_plan, eval_dataset=files[0] if options.eval_plan
                          else "", eval_steps=a.eval_iters if options.eval_plan else 0)
        mtp_logits: dict[str, torch.Tensor] = {}
        logits_of = segment_logits(net, cfg, device, mtp_logits)
        terms: SegmentTerms | None = None
        if megatron.moe:
            terms = MoETerms(net, megatron, session.reader, logits_of)
        elif megatron.mtp_num_layers:
            terms = MTPTerms(megatron, mtp_logits)
        prediction = StepPrediction(options.plan)  # the launcher's lines carry it too
        log = open_log(options.log_jsonl, inputs=[options.plan]) if options.log_jsonl else None
        try:
            iters = a.train_iters
            interval = a.eval_interval
            vocab = model_config.vocab_size
            for step in range(iters):
                line = reference_step(net, optimizer, session.reader, source, step,
                                      vocab, cfg, device, logits_of,
                                      clip_grad=a.clip_grad, terms=terms)
                line = dataclasses.replace(line, predicted_s=prediction(step))
                if not line.skipped:
                    scheduler.step(increment=a.global_batch_size)
                lines: list[StepLog | EvalLog] = [line]
                last = step == iters - 1
                if session.eval_reader is not None and session.eval_source is not None:
                    evals = int(interval and (step + 1) % interval == 0) + int(last)
                    lines += [reference_eval(net, session.eval_reader, session.eval_source, cfg,
                                             step, vocab, device, logits_of)
                              for _ in range(evals)]
                for out in lines:
                    print(out.to_json(), flush=True)
                    if log is not None:
                        log.write(out.to_json() + "\n")
                        log.flush()
        finally:
            if log is not None:
                log.close()
    finally:
        session.close()
