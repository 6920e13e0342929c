"""Where the launcher enters Megatron-LM's loop: module attributes, set once at start-up.

``Launcher.install()`` replaces, in Megatron-LM's modules (no file is edited):

- ``arguments.validate_args``: after Megatron-LM's own validation, the plan's checks
  (``flags``), the plan record of ``--load`` (``checkpoint``), the dataset; ``SystemExit(2)``
  with every problem listed, before any group or model exists;
- ``initialize._initialize_distributed``: Megatron's hybrid DP x CP groups are created with
  the others (``initialize_model_parallel(hybrid_context_parallel=True)``, while
  ``args.hybrid_context_parallel`` stays off); on a CPU host gloo is initialised first (the CPU
  patches of ``cpu`` went in at ``install()``: ``initialize_megatron`` asserts CUDA first);
- ``training.pretrain`` (and ``megatron.training.pretrain``, which scripts import): the datasets
  provider becomes placeholders, the forward step the plan's, and the model gets the launcher's
  pre-wrap hook (``model``); the rest of the call is the user's;
- ``training.get_forward_backward_func``: the schedule Megatron-LM builds is called with the
  plan's data iterator and microbatch count for ``args.curr_iteration`` (training; a MoE
  model with ``global_aux_loss`` first runs the step's forward-only statistics pass through
  the same schedule) or the eval plan's next step (``forward_only``: evaluation), so
  ``get_num_microbatches()`` keeps its global batch meaning for consumed samples, the LR
  schedule, logging and checkpoints;
- ``training.train_step``, ``training.evaluate_and_print_results``: ``--log-jsonl`` lines;
- ``training.save_checkpoint`` / ``load_checkpoint``: the plan record beside each checkpoint;
  a fresh torch Adam given the state the load describes (no Apex or TE).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import torch
import torch.distributed as dist

from planner.fileguard import open_log
from planner.prediction import StepPrediction
from runtime.adapters.megatron.binding.step_loss import StepLoss
from runtime.adapters.megatron_lm import LauncherOptions, checkpoint, cpu, flags, mlm, model
from runtime.adapters.megatron_lm.session import PlanSession
from runtime.train.runlog import EvalLog, StepLog


class _Placeholder:
    """What Megatron-LM's loader holds in place of a dataset: the plan's iterators replace it
    in every schedule call, so nothing may draw from it."""

    def __init__(self, split: str) -> None:
        self.split = split

    def __iter__(self) -> _Placeholder:
        return self

    def __next__(self) -> Any:
        raise RuntimeError(f"the {self.split} batches come from the plan; something drew "
                           "from Megatron-LM's own data iterator")


class Launcher:
    """The hooks of one process (module docstring)."""

    def __init__(self, options: LauncherOptions) -> None:
        self.options = options
        self.on_cpu = not torch.cuda.is_available()
        self.session = PlanSession(options.plan, options.eval_plan)
        self.args: Any = None
        self.log: IO[str] | None = None
        self.prediction: StepPrediction | None = None
        """The plan's simulated seconds per step, for the log's ``predicted_s`` (rank 0)."""
        self._eval_step = 0
        self._eval_reports: list[dict[str, torch.Tensor]] = []
        self._eval_microbatches = 0
        self._step: StepLoss | None = None
        self._tagged_p2p: Any = None
        self.device = torch.device("cpu")

    # ---- installation ------------------------------------------------------------------------

    def install(self) -> None:
        """Set every hook (idempotent per process: a second launcher replaces the first's)."""
        if int(os.environ.get("RANK", "0")) == 0 and self.options.log_jsonl:
            self.log = open_log(self.options.log_jsonl, inputs=[self.options.plan])
            self.prediction = StepPrediction(self.options.plan)
        mlm.no_compile_helpers()
        if self.on_cpu:
            cpu.apply()  # before pretrain(): initialize_megatron asserts CUDA first thing
        a, t = mlm.arguments, mlm.training
        a.validate_args = self._validate_args(a.validate_args)
        mlm.initialize._initialize_distributed = self._initialize_distributed(
            mlm.initialize._initialize_distributed)
        pretrain = self._pretrain(t.pretrain)
        t.pretrain = pretrain
        sys.modules["megatron.training"].pretrain = pretrain  # type: ignore[attr-defined]
        t.get_forward_backward_func = self._get_forward_backward_func(
            t.get_forward_backward_func)
        t.train_step = self._train_step(t.train_step)
        t.evaluate_and_print_results = self._evaluate(t.evaluate_and_print_results)
        t.save_checkpoint = self._save_checkpoint(t.save_checkpoint)
        t.load_checkpoint = _load_checkpoint(t.load_checkpoint)

    # ---- arguments ---------------------------------------------------------------------------

    def _validate_args(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def validate_args(args: Any, defaults: dict[str, Any] | None = None) -> Any:
            out = original(args, defaults or {})
            self.check(args)
            return out
        return validate_args

    def check(self, args: Any) -> None:
        """Every flag and plan check (``flags``); exits with all problems listed."""
        s = self.session
        problems = flags.refusals(args, sys.argv) + flags.requirements(args, on_cpu=self.on_cpu)
        problems += flags.plan_mismatches(args, s.header, s.reader.num_steps,
                                          source=self.options.plan)
        eval_steps = s.eval_reader.num_steps if s.eval_reader is not None else None
        problems += flags.eval_mismatches(args, self.options.eval_plan, eval_steps)
        text_problems, tokenizer = flags.text_tokenizer(args, s.header, source=self.options.plan)
        problems += text_problems
        dataset = self.options.dataset
        try:
            if args.data_path:
                dataset = flags.data_path_files(args.data_path, s.reader, dataset)
            if args.load and not problems:
                checkpoint.check_load(args.load, s.reader, ckpt_step=args.ckpt_step,
                                      finetune=args.finetune)
        except ValueError as e:
            problems.append(str(e))
        if problems:
            _exit(problems)
        notes = flags.adjust(args, on_cpu=self.on_cpu)
        if self.on_cpu and not args.use_cpu_initialization:
            args.use_cpu_initialization = True  # dist_utils.py:174 model_module.cuda()
            notes.append("--use-cpu-initialization (no CUDA on this host)")
        try:
            s.open_sources(dataset, self.options.eval_dataset, tokenizer=tokenizer)
        except ValueError as e:
            _exit([str(e)])
        if notes and int(os.environ.get("RANK", "0")) == 0:
            print("dcp launcher: set " + "; ".join(notes), flush=True)
        self.args = args

    # ---- process groups ----------------------------------------------------------------------

    def _initialize_distributed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        ps = mlm.initialize.mpu
        init_mp = ps.initialize_model_parallel

        @functools.wraps(init_mp)
        def initialize_model_parallel(*a: Any, **kw: Any) -> Any:
            pool = self.session.header.parallel.pool_size
            if any(1 < k < pool for k in self.session.header.cp_sizes):
                kw["hybrid_context_parallel"] = True  # the plan's aligned-block groups
            return init_mp(*a, **kw)

        @functools.wraps(original)
        def initialize_distributed(*a: Any, **kw: Any) -> Any:
            args = mlm.get_args()
            if self.on_cpu and not dist.is_initialized():
                from datetime import timedelta

                dist.init_process_group("gloo", timeout=timedelta(
                    minutes=args.distributed_timeout_minutes))
            ps.initialize_model_parallel = initialize_model_parallel
            try:
                if self.on_cpu:
                    with cpu.megatron_builds_its_groups():
                        out = original(*a, **kw)
                else:
                    out = original(*a, **kw)
            finally:
                ps.initialize_model_parallel = init_mp
            self._after_groups()
            return out
        return initialize_distributed

    def _after_groups(self) -> None:
        from runtime.adapters.megatron.binding.install import install
        from runtime.adapters.megatron.compat import cpu_patches, mcore

        device = torch.device("cpu") if self.on_cpu else torch.device(
            "cuda", torch.cuda.current_device())
        install(device)
        if self.on_cpu:
            # initialize_model_parallel made a CUDA scratch buffer (sequence parallelism).
            mcore.parallel_state._GLOBAL_MEMORY_BUFFER = None
            cpu_patches.memory_buffer_on_cpu()
        self.device = device

    # ---- pretrain ----------------------------------------------------------------------------

    def _pretrain(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def pretrain(*a: Any, **kw: Any) -> Any:
            bound = mlm.bind_pretrain(a, kw, original)
            bound.arguments["train_valid_test_dataset_provider"] = self._datasets_provider()
            bound.arguments["forward_step_func"] = self.session.forward_step
            cfg = mlm.pretrain_argument(bound, "cfg_container")
            provider = mlm.pretrain_argument(bound, "model_provider")
            if provider is not None:
                bound.arguments["model_provider"] = model.wrap_provider(
                    provider, mlm.get_args, on_cpu=self.on_cpu, init_seed=self.options.init_seed)
            elif cfg is not None and getattr(cfg, "model", None) is not None:
                cfg.model.pre_wrap_hooks.append(model.pre_wrap_hook(
                    mlm.get_args, on_cpu=self.on_cpu, init_seed=self.options.init_seed))
            else:
                raise ValueError("pretrain() was given neither a model provider nor a config "
                                 "container with a model")
            try:
                return original(*bound.args, **bound.kwargs)
            finally:
                if self.log is not None:
                    self.log.flush()
        return pretrain

    def _datasets_provider(self) -> Callable[..., Any]:
        def provider(num_samples: Any, vp_stage: int | None = None) -> tuple[Any, Any, Any]:
            del num_samples, vp_stage
            valid = _Placeholder("evaluation") if self.options.eval_plan else None
            return _Placeholder("training"), valid, None
        provider.is_distributed = True  # type: ignore[attr-defined]  # every rank "builds" it
        return provider

    # ---- the schedule ------------------------------------------------------------------------

    def _get_forward_backward_func(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def get_forward_backward_func(*a: Any, **kw: Any) -> Callable[..., Any]:
            return self._schedule(original(*a, **kw))
        return get_forward_backward_func

    def _schedule(self, real: Callable[..., Any]) -> Callable[..., Any]:
        s = self.session

        def forward_backward(*, model: Any, forward_only: bool = False, **kw: Any) -> Any:
            chunks = model if isinstance(model, list) else [model]
            if s.batches is None:
                try:
                    s.attach(chunks, device=self.device, vocab_size=self.args.padded_vocab_size,
                             eval_iters=self.args.eval_iters if s.eval_reader else 0)
                except ValueError as e:  # the job's rank order or groups are not the plan's
                    _exit([str(e)])
                self._check_memory()
            config = mlm.training.get_model_config(chunks[0])
            config.variable_seq_lengths = True
            if self.on_cpu and self.args.pipeline_model_parallel_size > 1:
                assert s.groups is not None
                kw["p2p_communicator"] = self._p2p(config)
                kw["pg_collection"] = kw.get("pg_collection") or s.groups.pg_collection
            if forward_only:
                step = self._eval_step
                self._eval_step += 1
                kw["data_iterator"] = s.eval_data_iterator(step)
                kw["num_microbatches"] = s.eval_num_microbatches(step)
                self._eval_microbatches += kw["num_microbatches"]
            else:
                step = self.args.curr_iteration
                kw["num_microbatches"] = s.num_microbatches(step)
                if s.begin_step(step):  # global_aux_loss: every microbatch's routing first
                    assert s.routers is not None
                    with s.routers.counting():
                        real(**{**kw, "forward_step_func": s.counting_step,
                                "data_iterator": s.data_iterator(step)},
                             model=model, forward_only=True)
                kw["data_iterator"] = s.data_iterator(step)
            s.count_flops = not forward_only
            try:
                reports = real(model=model, forward_only=forward_only, **kw)
            finally:
                s.count_flops = False
            if forward_only:
                self._eval_reports += list(reports or [])
            else:
                self._step = s.step_loss(list(reports or []), training=True)
            return reports
        return forward_backward

    def _check_memory(self) -> None:
        """Before the first step (``memory``), from the iteration a ``--load`` resumed at."""
        if not self.options.memory_check:
            return
        from runtime.adapters.megatron_lm.memory import check_launch_memory

        try:
            check_launch_memory(self.options.plan, self.session.reader, self.args, self.device,
                                int(self.args.iteration))
        except ValueError as e:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"dcp launcher: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def _p2p(self, config: Any) -> Any:
        # gloo matches point-to-point messages by (peer, tag): untagged sends and receives in
        # both directions of a pipeline pair can cross (compat/patches.py).
        from runtime.adapters.megatron.compat import patches

        if self._tagged_p2p is None:
            assert self.session.groups is not None
            self._tagged_p2p = patches.TaggedP2PCommunicator(
                self.session.groups.pg_collection.pp, config)
        return self._tagged_p2p

    # ---- logging and checkpoints -------------------------------------------------------------

    def _train_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def train_step(*a: Any, **kw: Any) -> Any:
            step = self.args.curr_iteration
            t0 = time.perf_counter()
            out = original(*a, **kw)
            if self.log is not None:
                loss = self._step
                assert loss is not None
                grad_norm = out[5]
                self._write(StepLog(
                    step=step, loss=loss.loss, moe_aux_loss=loss.moe_aux_loss,
                    moe_tokens_per_expert=loss.moe_tokens_per_expert, mtp_loss=loss.mtp_loss,
                    tokens=self.session.step_tokens(step), loss_tokens=loss.loss_tokens,
                    microbatches=self.session.num_microbatches(step),
                    seconds=time.perf_counter() - t0, skipped=bool(out[1]),
                    predicted_s=None if self.prediction is None else self.prediction(step),
                    grad_norm=None if grad_norm is None else float(grad_norm)))
            return out
        return train_step

    def _evaluate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        import inspect

        signature = inspect.signature(original)

        @functools.wraps(original)
        def evaluate_and_print_results(*a: Any, **kw: Any) -> Any:
            iteration = signature.bind(*a, **kw).arguments.get("iteration", 0)
            self._eval_step, self._eval_reports, self._eval_microbatches = 0, [], 0
            t0 = time.perf_counter()
            out = original(*a, **kw)
            if self.session.batches is not None and self._eval_step:
                loss = self.session.step_loss(self._eval_reports, training=False)
                if self.log is not None:
                    self._write(EvalLog(after_step=int(iteration) - 1, eval_loss=loss.loss,
                                        eval_tokens=loss.loss_tokens,
                                        eval_microbatches=self._eval_microbatches,
                                        seconds=time.perf_counter() - t0))
            return out
        return evaluate_and_print_results

    def _save_checkpoint(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def save_checkpoint(iteration: int, *a: Any, **kw: Any) -> Any:
            out = original(iteration, *a, **kw)
            if dist.get_rank() == 0 and self.args.save:
                checkpoint.write_record(self.args.save, int(iteration), self.session.reader)
            if dist.is_initialized():
                dist.barrier()
            return out
        return save_checkpoint

    def _write(self, line: StepLog | EvalLog) -> None:
        assert self.log is not None
        self.log.write(line.to_json() + "\n")
        self.log.flush()


def _load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    from runtime.adapters.megatron.parallel.checkpoint import fresh_adam_state

    @functools.wraps(original)
    def load_checkpoint(ddp_model: Any, optimizer: Any, *a: Any, **kw: Any) -> Any:
        # Without Apex or TE Megatron's optimizer is torch's AdamW, which has no state before
        # its first step: the distributed optimizer cannot describe what it is to load.
        if optimizer is not None:
            fresh_adam_state(optimizer)
        return original(ddp_model, optimizer, *a, **kw)
    return load_checkpoint


def _exit(problems: list[str]) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print("dcp launcher: the job does not match the plan path:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(2)
