"""``dcp-calibrate --from-log`` (issue 33, item 2): a synthetic log made from a known cost model
with noise gives its coefficients back within their stated errors; terms the log cannot
determine are refused with the reason; the written model plans like any other and says where it
comes from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import CostModel, load_cost_model, simulate_step
from planner.fitlog import fit_log
from planner.plan import make_plan
from planner.planfile.io import PlanFile, write_plan
from planner.provenance import label
from planner.sources.lengths import LengthTable
from runtime.calibrate import main as calibrate

TRUE = CostModel(name="truth", linear_s_per_token=2e-6, attention_s_per_token2=4e-10,
                 cp_fixed_s=2e-3, cp_token_s=3e-6, microbatch_s=5e-3)
STEP_S = 0.02


def _plan(tmp: Path, cp: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(50, 1500, 900), rng.integers(3000, 8000, 60)])
    table = LengthTable(path="synthetic", format="text",
                        lengths=lengths[rng.permutation(len(lengths))],
                        skipped=np.zeros(0, np.int64))
    config = PlannerConfig(parallel=ParallelConfig(dp=4 // cp, cp=cp),
                           capacity_tokens_per_rank=2048 if cp > 1 else 8192,
                           global_batch_size=24, seed=seed,
                           cp_sizes=(1,) if cp == 1 else ())
    plan = make_plan(table, config, load_cost_model("default"))
    return write_plan(tmp / f"cp{cp}.arrow", plan.header, plan.record_batches())


def _log(plan: Path, noise: float, tmp: Path, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    rows = []
    with PlanFile(plan) as f:
        for i in range(f.num_steps):
            b = f.step(i)
            t = simulate_step(TRUE, f.header.parallel.pool_size, *(
                b.column(n).to_numpy() for n in ("microbatch", "rank_start", "cp_size",
                                                  "padded_tokens"))) + STEP_S
            rows.append({"step": i, "loss": 1.0, "seconds": t * (1 + noise * rng.normal())})
    log = tmp / f"{plan.stem}.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return log


def test_a_noisy_log_gives_the_coefficients_back(tmp_path: Path) -> None:
    plan = _plan(tmp_path, cp=4)
    fit = fit_log(str(plan), [json.loads(x) for x in _log(plan, 0.01, tmp_path).read_text()
                              .splitlines()], warmup=2)
    assert fit["cp_sizes"]  # the plan uses CP groups, so the ring terms are fitted
    for term, want in [*TRUE.parameters.items(), ("step_s", STEP_S)]:
        got, err = fit["values"][term], fit["errors"][term]
        assert err < 0.5 * want, (term, got, err)  # the log determines it
        assert abs(got - want) <= 4 * err, (term, got, want, err)  # within its stated error
    assert fit["refused"] == {}
    assert fit["relative_rms"] == pytest.approx(0.01, rel=0.5)


def test_without_noise_the_fit_is_exact(tmp_path: Path) -> None:
    plan = _plan(tmp_path, cp=4)
    rows = [json.loads(x) for x in _log(plan, 0.0, tmp_path).read_text().splitlines()]
    fit = fit_log(str(plan), rows, warmup=2)
    for term, want in TRUE.parameters.items():
        assert fit["values"][term] == pytest.approx(want, rel=1e-6), term


def test_ring_terms_are_refused_without_cp_groups_and_the_model_plans(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, cp=1)  # dp 4, groups of one rank only: no ring to fit
    log = _log(plan, 0.01, tmp_path)
    out = tmp_path / "cm.json"
    assert calibrate(["--from-log", str(log), "--plan", str(plan), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cp_fixed_s" in text
    assert "refused: no step's critical path holds a CP group" in text
    doc = json.loads(out.read_text())
    f = doc["fitted"]
    assert set(f["terms"]) == {"linear_s_per_token", "attention_s_per_token2", "microbatch_s"}
    prior = load_cost_model("default")
    # Refused terms keep the plan's values (assumed); fitted ones are the truth's, near enough.
    assert doc["parameters"]["cp_fixed_s"] == prior.cp_fixed_s
    assert doc["parameters"]["linear_s_per_token"] == pytest.approx(
        TRUE.linear_s_per_token, rel=0.1)
    model = load_cost_model(str(out))
    assert label(model.provenance).startswith(f"fitted from {log}")
    assert model.provenance["terms"]["cp_fixed_s"] == "assumed"
    assert model.provenance["terms"]["linear_s_per_token"] == "measured"
    # It plans like any other cost model.
    from planner.cli import main as plan_main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"length": {n}}}\n' for n in (100, 2000, 300, 50)))
    assert plan_main([str(data), "--dp", "2", "--cp", "2", "--max-tokens-per-rank", "2048",
                      "--global-batch-size", "4", "--cost-model", str(out), "-o",
                      str(tmp_path / "p.arrow"), "--quiet"]) == 0


def test_too_short_a_log_is_refused(tmp_path: Path) -> None:
    plan = _plan(tmp_path, cp=4)
    rows = [json.loads(x) for x in _log(plan, 0.0, tmp_path).read_text().splitlines()][:6]
    with pytest.raises(ValueError, match="4 steps after the 2 warm-up steps; the fit needs"):
        fit_log(str(plan), rows, warmup=2)
