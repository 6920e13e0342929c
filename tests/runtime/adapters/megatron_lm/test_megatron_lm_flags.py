"""The launcher's refusals and plan checks: as functions (no Megatron needed), and through the
real command line (``SystemExit(2)``, every problem listed, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runtime.adapters.megatron_lm import flags
from runtime.adapters.megatron_lm.cli import split_argv
from runtime.data.plan_reader import PlanReader
from tests.runtime.adapters.megatron import harness
from tests.runtime.adapters.megatron_lm.launch import (
    DRIVER,
    FLAGS,
    REPO,
    env,
    launch,
    need_megatron_training,
)


def _args(**over: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, sequence_parallel=False,
        microbatch_group_size_per_vp_stage=None, global_batch_size=16, train_iters=3,
        micro_batch_size=1, calculate_per_token_loss=True, context_parallel_size=1,
        eval_interval=1000, eval_iters=0, transformer_impl="local", cuda_graph_impl="none",
        position_embedding_type="rope")
    base.update(over)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("flags")
    data = harness.write_dataset(tmp / "data.arrow", harness.lengths(0), 64)
    return harness.plan(tmp / "pool4.arrow", data, capacity=32, batch=16, dp=4, cp=1)


def test_every_refused_flag_says_why() -> None:
    on = {"hybrid_context_parallel": True, "sft": True, "iterations_to_skip": [3],
          "rampup_batch_size": ["4", "4", "100"], "cuda_graph_impl": "local",
          "use_torch_fsdp2": True, "multi_latent_attention": True,
          "position_embedding_type": "learned_absolute"}
    got = flags.refusals(_args(**on), ["x", "--dataloader-type", "cyclic"])
    for flag in ("--hybrid-context-parallel", "--sft", "--iterations-to-skip",
                 "--rampup-batch-size", "--cuda-graph-impl", "--use-torch-fsdp2",
                 "--multi-latent-attention",
                 "--position-embedding-type", "--dataloader-type cyclic"):
        assert any(line.startswith(flag) and ": refused: " in line for line in got), flag
    assert flags.refusals(_args(), ["x", "--dataloader-type", "external"]) == []


def test_moe_and_mtp_refusals_are_the_adapters_in_megatron_lm_flag_names() -> None:
    pytest.importorskip("megatron.core")
    moe = dict(num_experts=4, moe_router_topk=2, moe_router_load_balancing_type="seq_aux_loss",
               moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall",
               moe_ffn_hidden_size=256, expert_model_parallel_size=1)
    assert flags.refusals(_args(**moe)) == []  # what the MoE test runs
    got = flags.refusals(_args(**{**moe, "expert_model_parallel_size": 2,
                                  "moe_token_dispatcher_type": "allgather",
                                  "moe_router_enable_expert_bias": True,
                                  "moe_shared_expert_intermediate_size": 64,
                                  "moe_router_load_balancing_type": ["aux_loss",
                                                                     "seq_aux_loss"]}))
    text = "\n".join(got)
    assert "--expert-model-parallel-size 2: refused: expert parallelism is not supported " \
        "yet (every rank holds all experts); give --expert-model-parallel-size 1" in text
    assert "--moe-token-dispatcher-type allgather: refused: the adapter runs Megatron's " \
        "alltoall dispatcher; give --moe-token-dispatcher-type alltoall" in text
    assert "--moe-router-enable-expert-bias True: refused: the expert-bias update" in text
    assert "--moe-shared-expert-intermediate-size 64: refused" in text
    assert "--moe-router-load-balancing-type aux_loss seq_aux_loss: refused: the oracle" in text
    assert all(": refused: " in line for line in got)
    mtp = flags.refusals(_args(mtp_num_layers=2, tensor_model_parallel_size=2,
                               mtp_use_repeated_layer=True))
    text = "\n".join(mtp)
    assert "--tensor-model-parallel-size 2: refused: the MTP logits" in text
    assert "--mtp-use-repeated-layer True: refused: one layer per depth; drop the flag" in text
    assert flags.refusals(_args(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)) == []
    both = flags.refusals(_args(**moe, mtp_num_layers=1))
    assert any(line.startswith("--mtp-num-layers 1: refused: MoE layers with multi-token")
               for line in both), both


def test_requirements_name_the_flag() -> None:
    got = flags.requirements(_args(micro_batch_size=2, calculate_per_token_loss=False,
                                   context_parallel_size=2, eval_interval=None), on_cpu=True)
    assert [g.split()[0] for g in got] == ["--micro-batch-size", "--calculate-per-token-loss",
                                           "--context-parallel-size", "--eval-interval"]
    assert flags.requirements(_args(), on_cpu=False)[0].startswith("--transformer-impl local")


def test_plan_mismatches_name_both_values(plan: Path) -> None:
    with PlanReader(plan) as reader:
        assert flags.plan_mismatches(_args(), reader.header, reader.num_steps,
                                     source="P") == []
        got = flags.plan_mismatches(
            _args(world_size=8, global_batch_size=32, train_iters=9, sequence_parallel=True),
            reader.header, reader.num_steps, source="P")
    text = "\n".join(got)
    assert "data-parallel size (world / (tp x pp)) 8: the plan P was made for a pool of 4" in text
    assert "--global-batch-size 32: the plan P was made for a global batch of 16" in text
    assert "--train-iters 9: the plan P has 3 steps" in text
    assert "--sequence-parallel True" in text


def test_cp_sizes_must_be_megatron_blocks() -> None:
    assert flags.megatron_cp_sizes(8) == {1, 2, 4, 8}
    assert flags.megatron_cp_sizes(6) == {1, 2, 4, 6}


def test_eval_iters_against_the_eval_plan() -> None:
    assert "needs the launcher's --eval-plan" in flags.eval_mismatches(_args(eval_iters=2), "",
                                                                         None)[0]
    assert "has 1 steps" in flags.eval_mismatches(_args(eval_iters=2), "E", 1)[0]
    assert "never evaluates" in flags.eval_mismatches(_args(eval_iters=0), "E", 1)[0]
    assert flags.eval_mismatches(_args(eval_iters=1), "E", 1) == []


def test_command_line_needs_the_separator() -> None:
    with pytest.raises(ValueError, match="no '--'"):
        split_argv(["--plan", "p"])
    assert split_argv(["--plan", "p", "--", "s.py", "--x"]) == (["--plan", "p"], ["s.py", "--x"])


@pytest.mark.slow
def test_launcher_lists_every_problem_without_a_traceback(plan: Path, tmp_path: Path) -> None:
    """One process, a pool-of-4 plan, several refused and mismatched flags: exit 2 before any
    group or model, each named."""
    need_megatron_training()
    data = plan.with_name("data.arrow")
    run = launch(1, plan, data, tmp_path / "log.jsonl", extra=[
        "--iterations-to-skip", "2", "--global-batch-size", "32", "--micro-batch-size", "2",
        "--train-iters", "9", "--dataloader-type", "cyclic"], timeout=300)
    assert run.returncode != 0
    err = run.stderr
    assert "the job does not match the plan path" in err, err[-3000:]
    for needle in ("--iterations-to-skip: refused", "--micro-batch-size 2",
                   "--global-batch-size 32: the plan", "--train-iters 9",
                   "data-parallel size (world / (tp x pp)) 1", "--dataloader-type cyclic"):
        assert needle in err, needle
    assert "]: Traceback" not in err  # no rank raised (torchrun reports the exit itself)


def test_megatron_core_without_megatron_training_is_refused(plan: Path) -> None:
    """The project's own extra on Python 3.11 resolves megatron-core 0.16.1: the launcher says
    which releases it supports (skipped where 0.17+ is what imports)."""
    pytest.importorskip("megatron.core")
    import megatron.core

    if not megatron.core.__version__.startswith("0.16"):
        pytest.skip(f"megatron-core {megatron.core.__version__} ships megatron.training")
    run = subprocess.run([sys.executable, "-m", "runtime.adapters.megatron_lm", "--plan",
                          str(plan), "--", DRIVER, *FLAGS], cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "supports megatron-core 0.17.x through 0.19.x, found 0.16" in run.stderr
    assert "Traceback" not in run.stderr


def test_data_path_only_names_the_plans_own_files(tmp_path: Path) -> None:
    """Megatron-LM's --data-path (prefixes, optionally weighted) is accepted only for the files
    the plan was made for; the plan's files come back, for their fingerprint check."""
    import numpy as np

    from planner.sources.megatron import write_megatron_dataset

    rng = np.random.default_rng(0)
    write_megatron_dataset(tmp_path / "corpus", [rng.integers(0, 64, size=int(n))
                                                 for n in harness.lengths(0)])
    write_megatron_dataset(tmp_path / "other", [[1, 2, 3]] * 48)
    plan = harness.plan(tmp_path / "p.arrow", tmp_path / "corpus.idx", capacity=32, batch=16,
                        dp=4, cp=1)
    with PlanReader(plan) as reader:
        want = (str(tmp_path / "corpus.idx"),)
        for data_path in ([str(tmp_path / "corpus")], ["1.0", str(tmp_path / "corpus")],
                          [str(tmp_path / "corpus.idx")]):
            assert flags.data_path_files(data_path, reader, ()) == want
        with pytest.raises(ValueError, match=r"the plan .* was made for .*corpus\.idx"):
            flags.data_path_files([str(tmp_path / "other")], reader, ())
        with pytest.raises(ValueError, match="give the dataset once"):
            flags.data_path_files([str(tmp_path / "corpus")], reader, want)
