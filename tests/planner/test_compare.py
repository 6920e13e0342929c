"""`dcp-plan compare`: its figures are the plans' own (every step planned), sampling says so and
stays close, impossible setups are refused with the reason, and the figure is guarded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner import read_plan
from planner.cli import main

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample.jsonl"
GRID = ["compare", str(SAMPLE), "--pools", "4,8", "--cp", "2,4,8",
        "--max-tokens-per-rank", "2048,8192", "--global-batch-size", "64"]


def _compare(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert main([*GRID, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_every_step_planned_gives_the_plans_figures(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    doc = _compare(capsys)
    assert not doc["sampled"]
    assert doc["num_steps"] == doc["sampled_steps"] == 32
    assert [(r["pool_size"], r["capacity_tokens_per_rank"]) for r in doc["setups"]] == \
        [(4, 8192), (8, 8192)]
    # Cap 2048 cannot hold the long samples under --long-sequences error: refused, with why.
    assert [(r["pool_size"], r["capacity_tokens_per_rank"]) for r in doc["refused"]] == \
        [(4, 2048), (8, 2048)]
    assert all("--long-sequences split" in r["reason"] for r in doc["refused"])
    pool4 = doc["setups"][0]
    assert pool4["vs_static_cp"]["8"] is None
    assert pool4["static_cp_notes"]["8"] == "cp 8 does not divide the pool of 4"
    # The same setup as a plan (dp 2 x cp 4: the largest listed cp dividing 8).
    row = doc["setups"][1]
    out = tmp_path / "p.arrow"
    assert main([str(SAMPLE), "--dp", "2", "--cp", "4", "--max-tokens-per-rank", "8192",
                 "--global-batch-size", "64", "-o", str(out), "--quiet"]) == 0
    s = read_plan(out).header.stats
    assert row["step_seconds"] == pytest.approx(s["simulated_seconds"] / s["num_steps"],
                                                rel=1e-12)
    assert row["tokens_per_second"] == pytest.approx(
        s["real_tokens"] / s["simulated_seconds"], rel=1e-12)
    assert row["vs_megatron"] == pytest.approx(s["vs_megatron"], rel=1e-12)
    assert row["vs_static_cp"]["4"] == pytest.approx(s["vs_static_cp"], rel=1e-12)
    assert row["padding"] == pytest.approx(s["padding_overhead"], rel=1e-12)
    assert row["gpus"] == 8
    assert row["step_seconds_error"] == 0.0


def test_sampled_steps_say_so_and_stay_close(capsys: pytest.CaptureFixture[str]) -> None:
    full = _compare(capsys)["setups"]
    doc = _compare(capsys, "--sample-steps", "12")
    assert doc["sampled"]
    assert doc["sampled_steps"] == 12
    for a, b in zip(full, doc["setups"], strict=True):
        assert 0 < b["step_seconds_error"] < 0.1
        assert b["step_seconds"] == pytest.approx(a["step_seconds"], rel=0.05)
        assert b["vs_megatron"] == pytest.approx(a["vs_megatron"], rel=0.1)
    assert main([*GRID, "--sample-steps", "12"]) == 0
    text = capsys.readouterr().out
    assert "sampled   12 of 32 steps per setup" in text
    assert "refused   pool 4, cap 2,048: " in text


def test_figure_is_written_and_guarded(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    fig = tmp_path / "setups.png"
    assert main([*GRID, "--figure", str(fig)]) == 0
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*GRID, "--figure", str(fig)]) == 0          # an earlier figure is replaced
    plan, notes = tmp_path / "p.arrow", tmp_path / "notes.png"
    assert main([str(SAMPLE), "--dp", "2", "--cp", "2", "--max-tokens-per-rank", "8192",
                 "--global-batch-size", "200", "-o", str(plan), "--quiet"]) == 0
    notes.write_text("my notes")
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for bad, message in [(str(SAMPLE), "is the input"), (str(plan), "is not a figure"),
                         (str(notes), "is not a figure"),
                         (str(tmp_path / "a.gif"), "give a .png, .svg or .pdf")]:
        assert main([*GRID, "--figure", bad]) == 2
        assert message in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before   # nothing changed
    assert SAMPLE.read_bytes() == before.get(SAMPLE.name, SAMPLE.read_bytes())


def test_no_possible_setup_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(SAMPLE), "--pools", "2", "--max-tokens-per-rank", "1024",
                 "--global-batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "no setup can plan this dataset" in err
    assert "pool 2, cap 1,024" in err
