"""Evaluation plans: one pass in file order, the last partial batch kept, the forward-only cost,
the header's ``kind``, the eval rules of ``validate`` and the flags ``dcp-plan --eval`` refuses."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import DEFAULT_FORWARD_FRACTION, CostModel, load_cost_model
from planner.plan import Plan, make_plan
from planner.planfile.io import PlanFile
from planner.planfile.validate import validate
from planner.solver.batches import eval_global_batches
from planner.sources.lengths import LengthTable, read_lengths

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample.jsonl"
GOLDEN = sorted((ROOT / "plans" / "golden").glob("*.arrow"))
BASE = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "8192", "--global-batch-size", "300",
        "--long-sequences", "split"]


def _table(lengths: np.ndarray) -> LengthTable:
    return LengthTable(path="mem.txt", format="text", lengths=lengths,
                       skipped=np.zeros(0, np.int64))


def _lengths(n: int = 70, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 200, size=n).astype(np.int64)


def _config(kind: str = "eval", **kw: object) -> PlannerConfig:
    args: dict[str, object] = dict(parallel=ParallelConfig(dp=2, cp=2),
                                   capacity_tokens_per_rank=128, global_batch_size=16, kind=kind)
    args.update(kw)
    return PlannerConfig(**args)  # type: ignore[arg-type]


def _samples(plan: Plan, i: int) -> list[int]:
    s = plan.steps[i]["sample_index"]
    return sorted(set(s[s >= 0].tolist()))


def test_eval_batches_are_file_order_and_keep_the_last_partial_batch() -> None:
    lengths = np.array([3, 0, 5, 4, 9, 2, 7, 1, 6, 8], dtype=np.int64)
    eligible = lengths > 0
    by_size = eval_global_batches(lengths, eligible, global_batch_size=4)
    assert [b.tolist() for b in by_size] == [[0, 2, 3, 4], [5, 6, 7, 8], [9]]
    by_tokens = eval_global_batches(lengths, eligible, global_batch_tokens=12)
    assert [b.tolist() for b in by_tokens] == [[0, 2, 3], [4, 5], [6, 7], [8], [9]]


def test_eval_plan_is_one_pass_in_file_order() -> None:
    lengths = _lengths()
    plan = make_plan(_table(lengths), _config(), load_cost_model())
    h = plan.header
    assert h.kind == "eval"
    assert h.epochs == ((0, 5),)  # 70 samples, 16 per step: 4 full steps and the last 6 kept
    for i in range(5):
        assert _samples(plan, i) == list(range(16 * i, min(16 * i + 16, 70)))
    validate(h, list(plan.record_batches()), lengths)
    # A train plan of the same lengths shuffles: its first step is not the first 16 samples.
    train = make_plan(_table(lengths), _config("train"), load_cost_model())
    assert train.header.kind == "train"
    assert _samples(train, 0) != list(range(16))


def test_eval_plan_by_tokens_and_with_split_samples() -> None:
    lengths = _lengths(seed=1)
    lengths[[5, 40]] = [700, 900]  # longer than the pool holds (4 x 128): split in their step
    config = _config(global_batch_size=0, global_batch_tokens=1500, long_sequences="split")
    plan = make_plan(_table(lengths), config, load_cost_model())
    seen: list[int] = []
    for i in range(plan.header.num_steps):
        seen += _samples(plan, i)
    assert seen == list(range(len(lengths)))
    assert plan.header.stats["split_samples"] == [5, 40]
    validate(plan.header, list(plan.record_batches()), lengths)


def test_eval_plan_uses_the_forward_only_cost() -> None:
    cost = load_cost_model()
    fwd = cost.forward_only()
    assert cost.forward_fraction == DEFAULT_FORWARD_FRACTION == pytest.approx(1 / 3)
    f = DEFAULT_FORWARD_FRACTION
    assert fwd.linear_s_per_token == cost.linear_s_per_token * f
    assert fwd.attention_s_per_token2 == cost.attention_s_per_token2 * f
    assert fwd.cp_token_s == cost.cp_token_s * f
    assert fwd.cp_fixed_s == cost.cp_fixed_s / 2
    assert fwd.microbatch_s == cost.microbatch_s
    lengths = _lengths()
    plan = make_plan(_table(lengths), _config(), cost)
    assert plan.header.cost_model["name"] == f"{cost.name}/forward"
    assert plan.header.cost_model["parameters"] == fwd.parameters
    # Train plans keep the header they had: forward_fraction is not a parameter.
    assert "forward_fraction" not in cost.to_header()["parameters"]
    measured = CostModel.from_dict({"name": "m", "forward_fraction": 0.4,
                                    "parameters": cost.parameters})
    assert measured.forward_only().linear_s_per_token == pytest.approx(
        cost.linear_s_per_token * 0.4)
    with pytest.raises(ValueError, match="forward_fraction must be in"):
        CostModel.from_dict({"name": "m", "forward_fraction": 0, "parameters": cost.parameters})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("epochs", 2, "an eval plan is one pass"),
    ("drop_last", True, "keeps its last partial batch"),
    ("seed", 3, "is in file order"),
    ("kind", "test", "kind must be one of train, eval"),
])
def test_config_refuses_what_an_eval_plan_cannot_mean(field: str, value: object,
                                                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**{field: value})


def _reordered(plan: Plan) -> list[object]:
    """The plan with its first two steps swapped (step column renumbered): still a valid train
    plan's rows, but no longer in file order."""
    steps = [dict(s) for s in plan.steps]
    steps[0], steps[1] = steps[1], steps[0]
    for i, s in enumerate(steps):
        s["step"] = np.full(len(s["step"]), i, dtype=np.int32)
    return list(Plan(header=plan.header, steps=steps).record_batches())


def test_validate_checks_the_eval_rules() -> None:
    lengths = _lengths()
    plan = make_plan(_table(lengths), _config(), load_cost_model())
    with pytest.raises(ValueError, match="step 1: eval plan out of file order: sample 0 after "
                                         "sample 31"):
        validate(plan.header, _reordered(plan), lengths)
    # The same rows as a train plan are fine: a train plan's steps may come in any order.
    validate(replace(plan.header, kind="train"), _reordered(plan), lengths)
    two = replace(plan.header, epochs=((0, 2), (2, 3)))
    with pytest.raises(ValueError, match="an eval plan is one pass, the header lists 2 epochs"):
        validate(two, list(plan.record_batches()), lengths)
    dropped = replace(plan.header, global_batch={**plan.header.global_batch, "drop_last": True})
    with pytest.raises(ValueError, match="keeps its last partial batch"):
        validate(dropped, list(plan.record_batches()), lengths)
    bigger = replace(plan.header, global_batch={**plan.header.global_batch, "size": 17})
    with pytest.raises(ValueError, match="step 0: eval step holds 16 samples, the global batch "
                                         "size is 17"):
        validate(bigger, list(plan.record_batches()), lengths)
    with pytest.raises(ValueError, match="kind 'test' is not one of train, eval"):
        validate(replace(plan.header, kind="test"), list(plan.record_batches()), lengths)


def test_golden_version_1_plans_read_as_train() -> None:
    assert GOLDEN
    for path in GOLDEN:
        with PlanFile(path) as f:
            assert f.header.format_version == 1
            assert f.header.kind == "train"
        meta = json.loads(f.header.to_json())
        assert meta["kind"] == "train"


def test_cli_plans_and_validates_an_eval_set(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eval.arrow"
    assert main([str(SAMPLE), "--eval", "-o", str(out), *BASE]) == 0
    assert "eval: one pass in file order" in capsys.readouterr().out
    assert main(["validate", str(out), str(SAMPLE)]) == 0
    assert "valid eval plan (7 steps" in capsys.readouterr().out
    with PlanFile(out) as f:
        assert f.header.kind == "eval"
        assert f.header.format_version == 2
    again = tmp_path / "again.arrow"
    assert main([str(SAMPLE), "--eval", "-o", str(again), "--quiet", *BASE]) == 0
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(
        again.read_bytes()).digest()
    lengths = read_lengths(SAMPLE).lengths
    assert len(lengths) == 2000


@pytest.mark.parametrize("flags", [["--drop-last"], ["--epochs", "1"], ["--seed", "2"],
                                   ["--epochs", "2", "--drop-last"]])
def test_cli_refuses_epochs_drop_last_and_seed_with_eval(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    out = tmp_path / "eval.arrow"
    with pytest.raises(SystemExit) as e:
        main([str(SAMPLE), "--eval", "-o", str(out), *BASE, *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--eval plans one pass over the samples in file order" in err
    for flag in flags:
        if flag.startswith("--"):
            assert flag in err
    assert not out.exists()
