from __future__ import annotations

import json

import numpy as np
import pytest

from planner.cost import CostModel, load_cost_model, simulate_step, step_lower_bound

UNIT = CostModel(name="unit", linear_s_per_token=1.0, attention_s_per_token2=0.0)


def test_presets_load_and_default_is_dense_7b() -> None:
    assert load_cost_model().name == "dense-7b-h200"
    assert load_cost_model("small-2048-h200").linear_s_per_token > 0
    with pytest.raises(ValueError, match="unknown cost model 'nope'"):
        load_cost_model("nope")


def test_json_file_and_bad_parameters(tmp_path) -> None:  # noqa: ANN001
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"name": "m", "parameters": {"linear_s_per_token": 1,
                                                         "attention_s_per_token2": 2}}))
    assert load_cost_model(str(p)).attention_s_per_token2 == 2
    p.write_text(json.dumps({"parameters": {"linear_s_per_token": -1,
                                            "attention_s_per_token2": 2}}))
    with pytest.raises(ValueError, match="linear_s_per_token must be a finite number >= 0"):
        load_cost_model(str(p))
    p.write_text(json.dumps({"parameters": {"linear_s_per_token": 1, "attention_s_per_token2": 2,
                                            "bogus": 1}}))
    with pytest.raises(ValueError, match="unknown cost-model parameters \\['bogus'\\]"):
        load_cost_model(str(p))


def test_group_time_formula() -> None:
    m = CostModel(name="m", linear_s_per_token=2.0, attention_s_per_token2=0.5, cp_fixed_s=3.0,
                  cp_token_s=0.25, microbatch_s=7.0)
    # k=1: a*S + b*sum P^2 + microbatch
    assert m.group_time(1, [4, 6]) == pytest.approx(2 * 10 + 0.5 * (16 + 36) + 7)
    # k=4: (a S + b sum P^2)/4 + 3*(3 + 0.25*S/4) + 7
    assert m.group_time(4, [8]) == pytest.approx((16 + 32) / 4 + 3 * (3 + 0.5) + 7)


def test_simulator_critical_path_waits_for_every_member() -> None:
    # Pool of 4. mb0: rank 0 alone (10 s), ranks 1..3 alone (1 s each). mb1: group {0,1} (5 s).
    # Rank 1 must wait for rank 0: the step takes 10 + 5 = 15 s, although rank 1's busy time is 6.
    mb = np.array([0, 0, 0, 0, 1, 1, 1])
    start = np.array([0, 1, 2, 3, 0, 2, 3])
    k = np.array([1, 1, 1, 1, 2, 1, 1])
    padded = np.array([10, 1, 1, 1, 10, 1, 1])
    assert simulate_step(UNIT, 4, mb, start, k, padded) == pytest.approx(15.0)


def test_lower_bound_is_max_of_average_and_single_sequence() -> None:
    lengths = np.array([100, 10, 10, 10])
    # unit cost: work = sum of padded lengths; 130/4 = 32.5 < 100 at k=1, but the 100-token
    # sequence can run at k=2 or 4: its best time is 25 (k=4) and its best work 100.
    lb = step_lower_bound(UNIT, 4, lengths, (1, 2, 4), capacity=1000, tp_eff=1, layout="zigzag")
    assert lb == pytest.approx(max(130 / 4, 25.0))
