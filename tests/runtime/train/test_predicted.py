"""Predicted beside measured (issue 33, item 1), through real ``dcp-train`` runs: every step
line carries the plan's simulated seconds of that step, the summary holds their agreement after
the warm-up, and ``dcp-plan report --log`` draws the panel, refusing another plan's log."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from planner import read_plan
from planner.cli import main as plan_main
from planner.prediction import WARMUP_STEPS, agreement, spearman
from runtime.train import main
from tests.runtime.train.test_train_dist import _lengths, _plan, _write_dataset


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, object]],
                                                            dict[str, object]]:
    tmp = tmp_path_factory.mktemp("predicted")
    data = _write_dataset(tmp / "data.arrow", _lengths(seed=4))
    plan = _plan(tmp / "plan.arrow", data, "zigzag")
    log, summary = tmp / "train.jsonl", tmp / "summary.json"
    assert main(["--plan", str(plan), "--dataset", str(data), "--reference", "--quiet",
                 "--vocab-size", "64", "--hidden-size", "32", "--seed", "3",
                 "--log-jsonl", str(log), "--summary-json", str(summary)]) == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    return plan, log, lines, json.loads(summary.read_text())


def test_every_step_line_carries_the_plans_simulated_time(run: tuple[Path, Path, list[dict[
        str, object]], dict[str, object]]) -> None:
    plan, _, lines, _ = run
    view = read_plan(plan)
    simulated = view.summary().column("simulated_s").to_pylist()
    assert len(lines) == view.num_steps >= 4
    for d in lines:
        assert list(d)[:7] == ["step", "loss", "tokens", "loss_tokens", "microbatches",
                               "seconds", "predicted_s"]
        assert d["predicted_s"] == pytest.approx(simulated[int(str(d["step"]))], rel=1e-8)
    # The steps differ, so the predictions do: a constant would say nothing.
    assert len({d["predicted_s"] for d in lines}) > 1


def test_the_summary_compares_after_the_warm_up(run: tuple[Path, Path, list[dict[str, object]],
                                                           dict[str, object]]) -> None:
    _, _, lines, summary = run
    a = summary["prediction"]
    assert isinstance(a, dict)
    assert a["warmup_steps"] == [0, 1]
    assert WARMUP_STEPS == 2
    kept = lines[WARMUP_STEPS:]
    assert a["steps_compared"] == len(kept)
    m = [float(str(d["seconds"])) for d in kept]
    p = [float(str(d["predicted_s"])) for d in kept]
    # The lines round seconds to 1e-6 s; the summary sums the unrounded ones (steps of a few ms).
    assert a["measured_over_predicted"] == pytest.approx(sum(m) / sum(p),
                                                         abs=len(m) * 5e-7 / sum(p) + 1e-12)
    assert a["ratio_min"] <= a["measured_over_predicted"] <= a["ratio_max"]


def test_spearman_and_warm_up_by_hand() -> None:
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 30, 40])) == pytest.approx(1)
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([4.0, 3, 2, 1])) == pytest.approx(-1)
    # Ties share their mean rank: (1, 2.5, 2.5, 4) against (1, 2, 3, 4).
    assert spearman(np.array([1.0, 2, 2, 3]), np.array([1.0, 2, 3, 4])) == pytest.approx(
        0.9486833, rel=1e-6)
    assert spearman(np.array([1.0, 1, 1]), np.array([1.0, 2, 3])) is None
    a = agreement([5, 6, 7, 8, 9], [9.0, 9, 2, 4, 6], [1.0, 1, 1, 2, 3])
    assert a["warmup_steps"] == [5, 6]
    assert a["steps_compared"] == 3
    assert a["measured_over_predicted"] == pytest.approx(2.0)
    assert a["spearman"] == pytest.approx(1.0)
    assert agreement([0, 1], [1.0, 1.0], [1.0, 1.0])["measured_over_predicted"] is None


def test_report_draws_the_panel_and_refuses_another_plans_log(
        run: tuple[Path, Path, list[dict[str, object]], dict[str, object]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    plan, log, lines, summary = run
    out = tmp_path / "report.html"
    assert plan_main(["report", str(plan), "--log", str(log), "-o", str(out)]) == 0
    page = out.read_text()
    assert "<h2 id='measured'>Predicted against measured</h2>" in page
    a = summary["prediction"]
    assert isinstance(a, dict)
    assert f"measured/predicted {a['measured_over_predicted']:.3g}" in page
    assert "warm-up (steps 0-1)" in page
    assert "<svg" in page.split("id='measured'")[1]

    other = tmp_path / "other.jsonl"
    bad = dict(lines[1], predicted_s=float(str(lines[1]["predicted_s"])) * 2)
    other.write_text("\n".join(json.dumps(d) for d in [lines[0], bad]) + "\n")
    assert plan_main(["report", str(plan), "--log", str(other), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "step 1 was run with a prediction of" in err
    assert "a log of another plan" in err
    beyond = tmp_path / "beyond.jsonl"
    beyond.write_text(json.dumps(dict(lines[0], step=len(lines))) + "\n")
    assert plan_main(["report", str(plan), "--log", str(beyond), "-o", str(out)]) == 2
    assert f"step {len(lines)} is not a step of" in capsys.readouterr().err
