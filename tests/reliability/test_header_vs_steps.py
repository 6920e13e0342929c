"""The header fields that describe the steps are checked against them (issue 22).

Before: stats, ``global_batch.size``, ``layout``, ``tp``, ``pp`` and ``seed`` could be edited
(with the header checksum recomputed) and ``dcp-plan validate`` said "valid". Now ``dcp-plan
validate`` (``validate(thorough=True)``, ``planner.planfile.headercheck``) recomputes what the
steps determine: each step's samples against the seed's draw order and the global batch, every
stat (counts, ratios, simulated time, lower bounds, whose terms depend on the layout, the CP
sizes, tp with sequence parallelism and the capacity). ``tp`` without sequence parallelism and
``pp`` with vpp 1 leave no trace in the rows (the runtime checks them against the live job).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main as plan_main
from planner.planfile.io import PlanFile, write_plan
from planner.planfile.schema import PlanHeader
from tests.reliability.helpers import SAMPLE, no_traceback

PLANS = {
    "size": ["--dp", "4", "--cp", "2", "--max-tokens-per-rank", "4096", "--global-batch-size",
             "64", "--epochs", "2", "--seed", "5"],
    "tokens": ["--dp", "4", "--cp", "2", "--max-tokens-per-rank", "4096",
               "--global-batch-tokens", "60000", "--epochs", "2", "--seed", "7", "--drop-last"],
    "sp": ["--dp", "2", "--cp", "2", "--tp", "2", "--sequence-parallel",
           "--max-tokens-per-rank", "1024", "--global-batch-size", "32", "--long-sequences",
           "split"],
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("headers")
    out = {}
    for name, flags in PLANS.items():
        out[name] = d / f"{name}.arrow"
        assert plan_main([str(SAMPLE), "-o", str(out[name]), "--quiet", *flags]) == 0
    return out


def _edited(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """The plan with its header edited and every checksum recomputed (what an editor that
    knows the format writes)."""
    with PlanFile(src) as f:
        header = json.loads(f.header.to_json())
        batches = [f.step(i) for i in range(f.num_steps)]
    edit(header)
    return write_plan(dst, PlanHeader.from_json(json.dumps(header)), batches, check=False)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(h: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = h
        for p in parents:
            node = node[p]
        node[last] = value(node[last]) if callable(value) else value
    return edit


EDITS = [
    ("size", "seed", 6, "its samples are not the next 64 of the epoch 0 order that the "
                        "header's seed 6"),
    ("size", "global_batch.size", 32, "holds 64 samples, the header's global_batch.size is 32"),
    ("size", "layout", "contiguous", "stats lower_bound_seconds is"),
    ("size", "stats.real_tokens", lambda v: v + 1, "stats real_tokens is"),
    ("size", "stats.slot_fill", lambda v: v * 1.01, "stats slot_fill is"),
    ("size", "stats.simulated_seconds", lambda v: v * 1.001, "stats simulated_seconds is"),
    ("size", "stats.cp_size_groups", lambda v: {**v, "1": v["1"] + 1}, "stats cp_size_groups"),
    ("size", "stats.dropped_samples", [0], "of the epoch 0 order"),
    ("tokens", "global_batch.tokens", 30000, "more than the header's global_batch.tokens 30000"),
    ("tokens", "global_batch.tokens", 120000, "although the next sample"),
    ("tokens", "seed", 8, "of the epoch 0 order that the header's seed 8"),
    ("tokens", "stats.undrawn_samples", lambda v: [v[0][1:], v[1]],
     "undrawn_samples is not what the seed's order leaves"),
    ("sp", "parallel.tp", 1, "stats "),
    ("sp", "stats.num_microbatches", lambda v: v - 1, "stats num_microbatches is"),
]


@pytest.mark.parametrize(("plan", "field", "value", "message"), EDITS,
                         ids=[f"{p}-{f}-{i}" for i, (p, f, _, _) in enumerate(EDITS)])
def test_an_edited_header_is_named(plans: dict[str, Path], tmp_path: Path, plan: str,
                                   field: str, value: Any, message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    edited = _edited(plans[plan], tmp_path / "edited.arrow", _set(field, value))
    assert plan_main(["validate", str(edited)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert no_traceback(err)


def test_unedited_plans_pass(plans: dict[str, Path], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    for name, path in plans.items():
        same = _edited(path, tmp_path / f"{name}.arrow", lambda h: None)
        assert plan_main(["validate", str(same), str(SAMPLE)]) == 0, capsys.readouterr().err
        assert "valid train plan" in capsys.readouterr().out


def test_version_1_golden_plans_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """Older writers recorded fewer stats: those they did record are checked, the rest not."""
    from tests.reliability.helpers import ROOT

    golden = sorted((ROOT / "plans" / "golden").glob("*.arrow"))
    assert golden
    for path in golden:
        assert plan_main(["validate", str(path)]) == 0, capsys.readouterr().err
