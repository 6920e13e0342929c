"""The CPU-side pieces of ``bench/megatron_gpu.py run --gpus 1 --moe``: the arguments its runs
get (parsed by ``dcp-train``'s own parser), the verdict and the routing comparison.

The whole mode runs on this machine with ``--smoke`` (CPU, reference attention; BENCHMARKS.md
has the command); here only what decides PASS or FAIL, fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.megatron_gpu import BF16_TOL, PARITY, main
from bench.megatron_gpu_moe import compare, moe_argv, routing_diff
from runtime.train.cli import parse_args


def _log(step: int, loss: float, aux: float, counts: list[list[int]]) -> dict[str, object]:
    return {"step": step, "loss": loss, "moe_aux_loss": aux, "moe_tokens_per_expert": counts,
            "tokens_per_s": 100.0 + step}


def test_both_runs_are_moe_runs_of_the_same_model(tmp_path: Path) -> None:
    args = argparse.Namespace(lr=3e-4, steps=4)
    production = ["--device", "cuda", "--dtype", "bf16", "--attention", "te",
                  "--use-distributed-optimizer", "--overlap-grad-reduce",
                  "--overlap-param-gather"]
    gpu, ref = moe_argv(tmp_path, args, "global_aux_loss", small=PARITY, production=production)
    g_cfg, g_model, g_ref, g_engine = parse_args(gpu)
    r_cfg, r_model, r_ref, r_engine = parse_args(ref)
    assert g_model == r_model
    assert g_engine == r_engine == "megatron"
    assert r_ref
    assert not g_ref
    assert g_cfg.megatron.num_experts == r_cfg.megatron.num_experts == 4
    assert g_cfg.megatron.moe_ffn_hidden_size == r_model.ffn_size // 2
    assert g_cfg.megatron.load_balancing == r_cfg.megatron.load_balancing == "global_aux_loss"
    assert g_cfg.megatron.use_distributed_optimizer
    assert not r_cfg.megatron.use_distributed_optimizer
    assert (g_cfg.device, g_cfg.dtype, g_cfg.attention) == ("cuda", "bf16", "te")
    assert (r_cfg.device, r_cfg.dtype) == ("cpu", "fp32")
    assert g_cfg.plan == r_cfg.plan
    assert g_cfg.steps == r_cfg.steps == 4


def test_verdict_needs_the_loss_and_the_term_within_tolerance() -> None:
    counts = [[10, 6, 2, 2], [5, 5, 5, 5]]
    ref = [_log(0, 10.0, 0.02, counts), _log(1, 9.0, 0.021, counts)]
    close = [_log(0, 10.01, 0.0201, counts), _log(1, 9.01, 0.0211, counts)]
    row = compare("seq_aux_loss", close, ref, rc=0, oracle_rc=0, warmup=1, tol=BF16_TOL)
    assert row["ok"]
    assert row["steps_compared"] == 2
    assert row["max_rel_loss_diff"] == pytest.approx(0.01 / 9.0)
    assert row["median_tokens_per_s"] == 101.0  # step 1, after the warm-up
    off_aux = [_log(0, 10.0, 0.03, counts)]
    assert not compare("seq_aux_loss", off_aux, ref, rc=0, oracle_rc=0, warmup=0,
                       tol=BF16_TOL)["ok"]
    # A failed GPU run, or no step in common, is a FAIL; an oracle cut short is not.
    assert not compare("seq_aux_loss", close, ref, rc=1, oracle_rc=0, warmup=0,
                       tol=BF16_TOL)["ok"]
    assert not compare("seq_aux_loss", close, [], rc=0, oracle_rc=0, warmup=0,
                       tol=BF16_TOL)["ok"]
    assert compare("seq_aux_loss", close, ref[:1], rc=0, oracle_rc=124, warmup=0,
                   tol=BF16_TOL)["ok"]


def test_routing_difference_is_the_share_of_moved_choices() -> None:
    ref = [_log(0, 1.0, 1.0, [[10, 10], [12, 8]])]
    got = [_log(0, 1.0, 1.0, [[11, 9], [12, 8]])]
    assert routing_diff(got, ref) == [pytest.approx(1 / 40)]
    assert routing_diff(ref, ref) == [0.0]


def test_moe_mode_is_one_gpu_and_known_types(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--gpus 1"):
        main(["run", "--moe", "--gpus", "2", "--dir", str(tmp_path), "--out", str(tmp_path)])
