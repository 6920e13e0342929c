"""A MoE GPT through Megatron-LM's own ``pretrain()`` (megatron-core 0.19.2's wheel) with a plan
whose microbatches use CP groups of 1, 2 and 4 ranks, on 4 gloo ranks, against the launcher's
one-process oracle (every segment alone, the adapter's load-balancing definition computed
independently: relative 1e-5 on every step's loss, gradient norm and load-balancing term; the
tokens per expert exactly; Megatron-LM's printed load-balancing loss is the same term).
Skipped without a supported ``megatron.training``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from runtime.data.plan_reader import PlanReader
from tests.runtime.adapters.megatron_lm.launch import (
    assert_same_steps,
    close,
    launch,
    lines,
    make_data,
    need_megatron_training,
    ok,
    reference,
)

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def moe_flags(load_balancing: str) -> list[str]:
    """A tiny MoE: 4 SequentialMLP experts, top-2 dropless routing through alltoall."""
    return ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
            load_balancing, "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type",
            "alltoall"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    need_megatron_training()
    return make_data(tmp_path_factory.mktemp("megatron_lm_moe"))


@pytest.mark.parametrize(("plan", "load_balancing"), [
    ("pool4", "seq_aux_loss"), ("pool4", "global_aux_loss"), ("pp2", "global_aux_loss")])
def test_moe_with_per_microbatch_cp_equals_the_oracle(data: dict[str, Path], tmp_path: Path,
                                                      plan: str, load_balancing: str) -> None:
    """Each microbatch's CP group bound into the routers (seq_aux_loss: per sequence over its
    group's ranks; global_aux_loss: the step's statistics pass first, through 1F1B too)."""
    with PlanReader(data[plan]) as reader:
        used = {int(k) for s in range(3) for k in np.unique(reader.step(s).cp_size)}
    assert used == ({1, 2, 4} if plan == "pool4" else {1, 2})
    extra = moe_flags(load_balancing)
    if plan == "pp2":
        extra += ["--pipeline-model-parallel-size", "2"]
    run = launch(4, data[plan], data["data"], tmp_path / "run.jsonl", extra=extra)
    ok(run)
    ok(reference(data[plan], data["data"], tmp_path / "ref.jsonl", extra=extra))
    got, want = lines(tmp_path / "run.jsonl")[0], lines(tmp_path / "ref.jsonl")[0]
    assert_same_steps(got, want)
    for g, w in zip(got, want, strict=True):
        assert g["moe_aux_loss"] > 0, g
        assert close(g["moe_aux_loss"], w["moe_aux_loss"]), (g, w)
        assert g["moe_tokens_per_expert"] == w["moe_tokens_per_expert"], (g, w)
        assert sum(g["moe_tokens_per_expert"][0]) == 2 * g["tokens"]  # top-2 of real tokens
    # Megatron-LM's own log line: the same term, unweighted, per MoE layer (2 layers).
    name = {"seq_aux_loss": "seq_load_balancing_loss",
            "global_aux_loss": "global_load_balancing_loss"}[load_balancing]
    # Its second line averages the first two iterations, its lm loss as well (docs).
    printed = [float(m) for m in re.findall(rf"\| {name}: ([0-9.E+-]+) \|", run.stdout)]
    lm = [float(m) for m in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", run.stdout)]
    assert len(printed) == len(lm) == len(got) == 3, run.stdout[-3000:]

    def as_printed(values: list[float]) -> list[float]:
        return [values[0], (values[0] + values[1]) / 2, *values[2:]]
    for value, want_value in zip(lm, as_printed([g["loss"] for g in got]), strict=True):
        assert close(value, want_value, 1e-5), (value, want_value)
    term = as_printed([g["moe_aux_loss"] / 1e-2 / 2 for g in got])
    for value, want_value in zip(printed, term, strict=True):
        assert close(value, want_value, 1e-5), (value, want_value)


def test_routers_keeping_their_build_time_group_is_caught(data: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """Without the routers' per-microbatch TP x CP group (the mutation ``probe.py
    no-router-rebinding``), the run fails or leaves the oracle."""
    extra = moe_flags("seq_aux_loss")
    run = launch(4, data["pool4"], data["data"], tmp_path / "run.jsonl", extra=extra,
                 probe="no-router-rebinding")
    if run.returncode != 0:
        return
    ok(reference(data["pool4"], data["data"], tmp_path / "ref.jsonl", extra=extra))
    got, want = lines(tmp_path / "run.jsonl")[0], lines(tmp_path / "ref.jsonl")[0]
    assert not all(close(g["moe_aux_loss"], w["moe_aux_loss"])
                   for g, w in zip(got, want, strict=True))
    with pytest.raises(AssertionError):
        assert_same_steps(got, want)


def test_moe_flags_the_plan_path_does_not_run_are_refused(data: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """The adapter's own MoE refusals in Megatron-LM's flag names, and any other MoE flag
    away from its default: exit 2 before any group or model, each named."""
    extra = [*moe_flags("seq_aux_loss"), "--moe-z-loss-coeff", "1e-3",
             "--moe-expert-capacity-factor", "1.0", "--moe-router-score-function", "sigmoid"]
    run = launch(1, data["pool4"], data["data"], tmp_path / "log.jsonl", extra=extra,
                 timeout=300)
    assert run.returncode != 0
    err = run.stderr
    assert "the job does not match the plan path" in err, err[-3000:]
    for needle in ("--moe-z-loss-coeff 0.001: refused: the router z-loss",
                   "--moe-expert-capacity-factor 1.0: refused: routing is dropless",
                   "--moe-router-score-function sigmoid: refused"):
        assert needle in err, (needle, err[-3000:])
    assert "--num-experts" not in err  # MoE itself runs
    assert "]: Traceback" not in err
