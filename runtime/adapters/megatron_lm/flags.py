"""Megatron-LM's flags on the plan path: the ones it refuses, the ones it needs, the plan checks.

All of it runs right after Megatron-LM's own ``validate_args`` (``hooks.Launcher``), on every
rank alike, before any process group, model or dataset exists: a refusal costs nothing and
names the flag, the plan's value and Megatron-LM's. Three kinds of check:

- ``refusals``: flags whose machinery the plan replaces or cannot replay (each with its reason;
  the MoE and multi-token prediction ones in ``model_flags``);
- ``requirements``: what per-microbatch CP needs of any job (one microbatch is one plan pack,
  the loss is summed per token);
- ``plan_mismatches``: the job the flags describe against the plan the launcher was given
  (pool, tp, pp, vpp, sequence parallelism, the microbatch group size, the global batch, the
  steps, the layout and the CP sizes Megatron's groups can hold), and for a text plan
  ``text_tokenizer``: Megatron-LM's tokenizer flags against the plan's tokenizer.

``adjust`` then sets the few fields the plan path fixes (variable sequence lengths, the
external loader; on a CPU host gloo and the rerun machine off), and says so.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from planner.groups import ZIGZAG
from planner.planfile.schema import PlanHeader
from planner.sources.dataset import plan_items
from planner.sources.textenc import TokenizerSpec, tokenizer_file
from runtime.adapters.megatron_lm import model_flags

Args = Any
"""Megatron-LM's argument namespace (``argparse.Namespace``)."""

_MLM_ATTENTION = "only Transformer Engine's attention reads a per-microbatch CP group"


def _set(name: str) -> Callable[[Args], bool]:
    return lambda a: bool(getattr(a, name, None))


REFUSED: tuple[tuple[str, Callable[[Args], bool], str], ...] = (
    ("--hybrid-context-parallel", _set("hybrid_context_parallel"),
     "it is Megatron-LM's own dynamic CP (one forward per sequence, no pipeline parallelism); "
     "the plan already gives every microbatch its CP group"),
    ("--sft", _set("sft"), "SFTDataset packs its own sequences and evaluate() averages per "
     "microbatch under it; the plan's packs come from the plan's dataset"),
    ("--iterations-to-skip", _set("iterations_to_skip"), "a skipped step draws batches from "
     "Megatron-LM's iterator, not the plan's; leave the samples out of the plan instead"),
    ("--rampup-batch-size", _set("rampup_batch_size"), "the plan fixes every step's batch"),
    ("--step-batch-size-schedule", _set("step_batch_size_schedule"),
     "the plan fixes every step's batch"),
    ("--decrease-batch-size-if-needed", _set("decrease_batch_size_if_needed"),
     "the plan fixes every step's batch"),
    ("--phase-transition-iterations", _set("phase_transition_iterations"),
     "the plan fixes every step's batch"),
    ("--train-samples", _set("train_samples"), "the plan counts steps: use --train-iters"),
    ("--cuda-graph-impl", lambda a: (getattr(a, "cuda_graph_impl", "none") or "none") != "none",
     "a CUDA graph replays fixed shapes; plan microbatches vary in length and count"),
    ("--optimizer-cuda-graph", _set("optimizer_cuda_graph"),
     "it wraps the schedule the plan's microbatch count goes through"),
    ("--moe-expert-rank-capacity-factor", _set("moe_expert_rank_capacity_factor"),
     "it wraps the schedule the plan's microbatch count goes through"),
    ("--overlap-moe-expert-parallel-comm", _set("overlap_moe_expert_parallel_comm"),
     "its schedule builds the forward from a schedule plan, not the plan's forward step"),
    ("--use-megatron-fsdp", _set("use_megatron_fsdp"), "the plan path runs Megatron-core's DDP "
     "and optimizer (its FSDP is untested with per-microbatch CP groups)"),
    ("--use-torch-fsdp2", _set("use_torch_fsdp2"), "the plan path runs Megatron-core's DDP "
     "(torch FSDP2: use dcp-train --framework torchtitan)"),
    ("--full-validation", _set("full_validation"), "evaluation runs the eval plan's steps "
     "(--eval-iters of them)"),
    ("--multiple-validation-sets", _set("multiple_validation_sets"),
     "evaluation runs one eval plan"),
    ("--perform-rl-step", _set("perform_rl_step"), "RL steps build their own batches"),
    ("--multi-latent-attention", _set("multi_latent_attention"),
     "Megatron's MLA asserts that no per-microbatch CP size is given"),
    ("--dataloader-inter-document-masking", _set("dataloader_inter_document_masking"),
     "the plan's packs carry their own sequence boundaries"),
    ("--reset-position-ids", _set("reset_position_ids"),
     "the plan's packs restart positions at every sequence already"),
    ("--reset-attention-mask", _set("reset_attention_mask"),
     "the plan's packs mask across sequences already"),
    ("--eod-mask-loss", _set("eod_mask_loss"), "the plan's labels decide the loss mask"),
    ("--use-legacy-models", _set("use_legacy_models"), "the plan path binds Megatron-core's "
     "GPTModel"),
    ("--position-embedding-type", lambda a: getattr(a, "position_embedding_type", "rope")
     != "rope", "the plan path binds RoPE to each microbatch's CP group (learned absolute and "
     "other position embeddings are not covered)"),
)
"""(flag, is it set, why the plan path refuses it)."""


def refusals(args: Args, argv: list[str] | None = None) -> list[str]:
    """Every refused flag the job sets, with the reason; ``argv``: the command line, for the
    one flag whose default validate_args fills in (``--dataloader-type``)."""
    out = [f"{flag}: refused: {why}" for flag, given, why in REFUSED if given(args)]
    out += model_flags.refusals(args)
    loader = _value(argv or [], "--dataloader-type")
    if loader not in (None, "external"):
        out.append(f"--dataloader-type {loader}: refused: the plan is the data loader (the "
                   "launcher sets --dataloader-type external)")
    return out


def _value(argv: list[str], flag: str) -> str | None:
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def requirements(args: Args, *, on_cpu: bool) -> list[str]:
    """What per-microbatch CP needs of every job, beyond the plan."""
    out = []
    if args.micro_batch_size != 1:
        out.append(f"--micro-batch-size {args.micro_batch_size}: the plan path needs 1 (one "
                   "microbatch is one plan pack of several sequences)")
    if not args.calculate_per_token_loss:
        out.append("--calculate-per-token-loss is required: each rank's loss is a sum over its "
                   "share of the tokens, normalised by the step's token count")
    if args.context_parallel_size != 1:
        out.append(f"--context-parallel-size {args.context_parallel_size}: the plan gives every "
                   "microbatch its CP group; Megatron-LM's static CP must be 1 (the pool is its "
                   "data-parallel size)")
    if args.eval_interval is None:
        out.append("--eval-interval is required (Megatron-LM divides by it when it sizes the "
                   "datasets; with --eval-iters 0 any value)")
    if on_cpu and args.transformer_impl != "local":
        out.append(f"--transformer-impl {args.transformer_impl}: a host without CUDA needs "
                   "local (Transformer Engine runs on GPUs)")
    if not on_cpu and args.transformer_impl != "transformer_engine":
        out.append(f"--transformer-impl {args.transformer_impl}: on a GPU the plan path needs "
                   f"transformer_engine ({_MLM_ATTENTION})")
    return out


def megatron_cp_sizes(pool: int) -> set[int]:
    """The CP group sizes Megatron's hybrid DP x CP groups exist for: 1, the powers of two
    below the pool (aligned blocks) and the pool itself."""
    sizes = {1, pool}
    k = 2
    while k < pool:
        sizes.add(k)
        k *= 2
    return sizes


def plan_mismatches(args: Args, header: PlanHeader, num_steps: int, *, source: str) -> list[str]:
    """The job the flags describe against the training plan, each line naming both values."""
    p = header.parallel
    out = []

    def differ(flag: str, mine: object, plan: object, what: str) -> None:
        if mine != plan:
            out.append(f"{flag} {mine}: the plan {source} was made for {what} {plan}")

    dp = args.world_size // (args.tensor_model_parallel_size
                             * args.pipeline_model_parallel_size)
    differ("data-parallel size (world / (tp x pp))", dp, p.pool_size, "a pool of")
    differ("--tensor-model-parallel-size", args.tensor_model_parallel_size, p.tp, "tp")
    differ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size, p.pp, "pp")
    differ("virtual pipeline stages (--num-layers-per-virtual-pipeline-stage / "
           "--num-virtual-stages-per-pipeline-rank)",
           args.virtual_pipeline_model_parallel_size or 1, p.vpp, "vpp")
    differ("--sequence-parallel", bool(args.sequence_parallel),
           bool(p.sequence_parallel and p.tp > 1), "sequence parallelism")
    if p.vpp > 1:
        differ("--microbatch-group-size-per-virtual-pipeline-stage",
               args.microbatch_group_size_per_vp_stage or p.pp, p.microbatch_group_size,
               "a microbatch group size of")
    size = int(header.global_batch.get("size", 0) or 0)
    if size:
        differ("--global-batch-size", args.global_batch_size, size, "a global batch of")
    if args.train_iters is not None and args.train_iters > num_steps:
        out.append(f"--train-iters {args.train_iters}: the plan {source} has {num_steps} steps "
                   "(Megatron-LM's iteration i runs plan step i)")
    if max(header.cp_sizes) > 1 and header.layout != ZIGZAG:
        out.append(f"the plan {source} has layout {header.layout!r}: Megatron's THD RoPE splits "
                   "every sequence in zigzag chunks (plan with --layout zigzag)")
    odd = sorted(set(header.cp_sizes) - megatron_cp_sizes(p.pool_size))
    if odd:
        out.append(f"the plan {source} uses CP sizes {odd}: Megatron's hybrid DP x CP groups "
                   f"over a pool of {p.pool_size} exist for "
                   f"{sorted(megatron_cp_sizes(p.pool_size))} only")
    return out


def text_tokenizer(args: Args, header: PlanHeader, *, source: str
                   ) -> tuple[list[str], str | None]:
    """(problems, tokenizer path) of Megatron-LM's tokenizer flags for a text plan (its header's
    ``dataset.tokenizer``); a plan of token ids takes any (``([], None)``).

    The launcher tokenizes the plan's records itself, with the plan's tokenizer
    (``runtime.data.token_text``); Megatron-LM's tokenizer only sizes the vocabulary. So
    ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`` must name the plan's
    ``tokenizer.json`` (same sha256; PATH is then where it is read from), and
    ``NullTokenizer``'s ``--vocab-size`` must hold the tokenizer's ids; any other type would be
    another tokenizer than the one the ids come from, and is refused.
    """
    recorded = header.dataset.tokenizer
    if not recorded:
        return [], None
    spec = TokenizerSpec.from_dict(recorded)
    kind = getattr(args, "tokenizer_type", None)
    plan = f"the plan {source} is of text tokenized with {spec.path} ({spec.vocab_size} ids)"
    if kind == "NullTokenizer":
        vocab = int(getattr(args, "vocab_size", 0) or 0)
        if vocab < spec.vocab_size:
            return [f"--vocab-size {vocab}: {plan}; give --vocab-size {spec.vocab_size} or "
                    "more"], None
        return [], None
    if kind != "HuggingFaceTokenizer":
        return [f"--tokenizer-type {kind}: {plan}; give --tokenizer-type "
                "HuggingFaceTokenizer --tokenizer-model with its folder (or NullTokenizer "
                "with --vocab-size)"], None
    model = str(getattr(args, "tokenizer_model", "") or "")
    try:
        f = tokenizer_file(model)
    except ValueError as e:
        return [f"--tokenizer-model {model}: {e}; {plan}: name a local folder or file holding "
                "that tokenizer.json (a hub name cannot be compared)"], None
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    if digest != spec.sha256:
        return [f"--tokenizer-model {model}: {f} (sha256 {digest[:12]}) is another tokenizer; "
                f"{plan} (sha256 {spec.sha256[:12]})"], None
    return [], str(f)


def eval_mismatches(args: Args, eval_plan: str, eval_steps: int | None) -> list[str]:
    """``--eval-iters`` against the eval plan (None: no eval plan given)."""
    if eval_steps is None:
        if args.eval_iters:
            return [f"--eval-iters {args.eval_iters}: evaluation needs the launcher's "
                    "--eval-plan (or --eval-iters 0)"]
        return []
    if not args.eval_iters:
        return [f"--eval-plan {eval_plan}: --eval-iters is 0, so Megatron-LM never evaluates"]
    if args.eval_iters > eval_steps:
        return [f"--eval-iters {args.eval_iters}: the eval plan {eval_plan} has {eval_steps} "
                "steps (each evaluation runs its first --eval-iters steps)"]
    return []


def adjust(args: Args, *, on_cpu: bool) -> list[str]:
    """Set what the plan path fixes; returns one note per change for the log."""
    notes = []
    # arguments.py hard-sets it False, with no flag: pack lengths vary, so do P2P shapes.
    args.variable_seq_lengths = True
    if not args.num_experts and args.moe_token_dispatcher_type == "allgather":
        # TransformerConfig rejects variable lengths with the default MoE dispatcher even for a
        # dense model (transformer_config.py); a dense model dispatches nothing.
        args.moe_token_dispatcher_type = "alltoall"
    if args.dataloader_type != "external":
        args.dataloader_type = "external"
        notes.append("--dataloader-type external (the plan is the data loader)")
    if on_cpu:
        if args.distributed_backend != "gloo":
            args.distributed_backend = "gloo"
            notes.append("--distributed-backend gloo (no CUDA on this host)")
        if args.rerun_mode != "disabled":
            # rerun_state_machine.py saves torch.cuda.get_rng_state() every step.
            args.rerun_mode = "disabled"
            notes.append("--rerun-mode disabled (its state saving reads the CUDA RNG)")
    return notes


def data_path_files(data_path: list[str], reader: Any, given: tuple[str, ...]
                    ) -> tuple[str, ...]:
    """``--data-path`` accepted only as the plan's own files (``prefix`` names ``prefix.idx`` /
    ``.bin``; weights are dropped: the plan's blend decides the mix); returns the plan's files,
    whose fingerprints ``open_plan_source`` checks. ``given``: the launcher's ``--dataset``."""
    entries = list(data_path)
    if len(entries) > 1 and len(entries) % 2 == 0 and _is_number(entries[0]):
        entries = entries[1::2]  # "weight prefix weight prefix": the plan's blend decides
    files = [str(f["path"]) for f in reader.header.dataset.files] or [reader.header.dataset.path]

    def key(p: str) -> str:
        p = os.path.realpath(p)
        return p[:-4] if p.endswith((".idx", ".bin")) else p

    if given:
        raise ValueError("give the dataset once: --data-path (Megatron-LM's) or the launcher's "
                         "--dataset")
    if [key(e) for e in entries] != [key(f) for f in files]:
        raise ValueError(f"--data-path {' '.join(data_path)}: the plan {reader.path} was made "
                         f"for {' '.join(files)} (the plan's data is read through the plan; "
                         "--data-path may only name the same files)")
    # Stored paths are files, never patterns (a name with glob characters is escaped).
    return tuple(plan_items(reader.header.dataset.files, reader.header.dataset.path))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
