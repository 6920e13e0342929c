"""`dcp-plan` end to end: plan, validate, show, errors that name the problem, nothing partial."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from planner import read_plan
from planner.cli import main

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample.jsonl"
BASE = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "8192", "--global-batch-size", "100",
        "--long-sequences", "split"]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_plan_summary_validate_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.arrow"
    # cp 4: static CP 4 holds every segment, so both baselines have a number.
    base = [*BASE[:2], "--cp", "4", *BASE[4:]]
    assert main([str(SAMPLE), "-o", str(out), *base]) == 0
    text = capsys.readouterr().out
    for word in ("steps", "microbatches per step", "padding", "slot fill", "lower bound", "speed"):
        assert word in text
    stats = read_plan(out).header.stats
    # The predicted gain: a line per baseline in the summary and in show.
    gain = [f"{stats['vs_static_cp']:.3f}x over static CP 4 (per step: min",
            f"{stats['vs_megatron']:.3f}x over Megatron's greedy (per step: min"]
    assert f"gain      {gain[0]}" in text
    assert f"          {gain[1]}" in text
    assert main(["validate", str(out), str(SAMPLE)]) == 0
    assert "valid train plan (20 steps" in capsys.readouterr().out
    assert main(["show", str(out), "--steps", "0:3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["step", "microbatches", "groups"]
    assert lines[0].split()[8:10] == ["vs_static_cp", "vs_megatron"]
    per_step = stats["baselines"]["static-cp"]["per_step"]
    assert [float(x.split()[8]) for x in lines[1:4]] == per_step[:3]
    assert lines[4].startswith("... 17 more steps")
    assert [x.split(" (")[0] for x in lines[5:7]] == [f"gain: {g.split(' (')[0]}" for g in gain]
    assert lines[7] == "cost: dense-7b-h200: preset (estimate); all 5 terms assumed"
    assert lines[8].startswith("warning: the cost model is an estimate")
    assert main([str(SAMPLE), "-o", str(out), *base, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["vs_static_cp"] == stats["vs_static_cp"] >= 1.0
    assert printed["vs_megatron"] == stats["vs_megatron"] >= 1.0
    assert printed["gain"]["static-cp"]["quantiles"] == stats["baselines"]["static-cp"][
        "quantiles"]
    assert "per_step" not in printed["gain"]["static-cp"]   # the plan holds those


def test_same_inputs_give_byte_identical_plans(tmp_path: Path) -> None:
    a, b = tmp_path / "a.arrow", tmp_path / "b.arrow"
    assert main([str(SAMPLE), "-o", str(a), "--quiet", *BASE]) == 0
    assert main([str(SAMPLE), "-o", str(b), "--quiet", *BASE]) == 0
    assert _sha(a) == _sha(b)
    c = tmp_path / "c.arrow"
    assert main([str(SAMPLE), "-o", str(c), "--quiet", *BASE, "--seed", "1"]) == 0
    assert _sha(a) != _sha(c)


def test_microbatch_tolerance_trades_time_for_fewer_microbatches(tmp_path: Path) -> None:
    runs = {}
    for tol in ("0", "0.5"):
        out = tmp_path / f"t{tol}.arrow"
        assert main([str(SAMPLE), "-o", str(out), "--quiet", *BASE,
                     "--microbatch-tolerance", tol]) == 0
        runs[tol] = read_plan(out).header.stats
    assert (runs["0.5"]["num_microbatches"] <= runs["0"]["num_microbatches"])
    assert runs["0.5"]["simulated_seconds"] >= runs["0"]["simulated_seconds"] * (1 - 1e-9)


def test_default_output_under_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "mydata.jsonl"
    data.write_text("".join(json.dumps({"length": n}) + "\n" for n in range(1, 50)))
    monkeypatch.chdir(tmp_path)
    assert main([str(data), "--quiet", *BASE]) == 0
    assert (tmp_path / "plans" / "mydata.arrow").is_file()


def test_bad_record_names_file_and_line_and_leaves_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, "x"]}\n{"length": 5}\n')
    out = tmp_path / "bad.arrow"
    assert main([str(data), "-o", str(out), "--quiet", *BASE]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err
    assert "non-integer" in err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [data]
    assert main([str(data), "-o", str(out), "--skip-bad-records", *BASE]) == 0
    assert "1 bad records skipped" in capsys.readouterr().out
    plan = read_plan(out)
    assert plan.header.stats["dropped_samples"] == [1]
    assert set(plan.table.column("sample_index").to_pylist()) - {-1} == {0, 2}


def test_long_sequence_error_names_the_sample(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "long.jsonl"
    data.write_text('{"length": 10}\n{"length": 40000}\n')
    assert main([str(data), "-o", str(tmp_path / "x.arrow"), *BASE[:-2]]) == 2
    err = capsys.readouterr().err
    assert "sample 1" in err
    assert "40000" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cp-sizes", "1,3"], "cp size 3 is not valid for a pool of 4"),
        (["--min-cp", "8"], "--min-cp 8 leaves no group size"),
        (["--vpp", "2"], "--vpp 2 needs --pp >= 2"),
        (["--microbatch-tolerance", "1.5"], "--microbatch-tolerance must be in [0, 1)"),
    ],
)
def test_bad_flags_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    flags: list[str], message: str) -> None:
    assert main([str(SAMPLE), "-o", str(tmp_path / "x.arrow"), *BASE, *flags]) == 2
    assert message in capsys.readouterr().err


def test_notebook_view_conversions_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("pandas")
    pytest.importorskip("polars")
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    out = tmp_path / "p.arrow"
    assert main([str(SAMPLE), "-o", str(out), "--quiet", *BASE]) == 0
    plan = read_plan(out)
    df = plan.to_pandas()
    assert len(df) == plan.table.num_rows
    assert plan.to_polars().height == len(df)
    summary = plan.summary().to_pandas()
    assert list(summary["step"]) == list(range(plan.num_steps))
    assert np.all(summary["simulated_s"] >= summary["lower_bound_s"] * (1 - 1e-9))
    assert plan.step(2).column("step").to_pylist() == [2] * plan.step(2).num_rows
    assert plan.plot_step_load(0) is not None
    assert plan.plot_cp_mix() is not None


def _pad_plan(tmp_path: Path, lengths: list[int], *extra: str) -> Path:
    data = tmp_path / "lengths.txt"
    data.write_text("".join(f"{n}\n" for n in lengths))
    out = tmp_path / f"pad{'-'.join(extra) or '1'}.arrow"
    assert main([str(data), "--dp", "3", "--cp", "2", "--max-tokens-per-rank", "2048",
                 "--global-batch-size", str(len(lengths)), "-o", str(out), "--quiet",
                 *extra]) == 0
    return out


def test_pad_to_multiple_seed_case_fits_one_microbatch(tmp_path: Path) -> None:
    # The seed's case: twelve 1024-token rows on pool 6 (dp 3 x cp 2), C = 2048. Megatron pads
    # to 2N = 12 (1032 tokens, two no longer fit a rank); padded to multiples of 32 they stay
    # 1024, and every group of every microbatch fits its k x C after padding.
    plan = read_plan(_pad_plan(tmp_path, [1024] * 12, "--pad-to-multiple", "32"))
    assert plan.header.pad_to_multiple == 32
    step = plan.step(0).to_pydict()
    assert all(p % 32 == 0 for p in step["padded_tokens"])
    load: dict[tuple[int, int, int], int] = {}
    for m, r, k, p in zip(step["microbatch"], step["rank_start"], step["cp_size"],
                          step["padded_tokens"], strict=True):
        load[(m, r, k)] = load.get((m, r, k), 0) + p
    assert all(total <= k * 2048 for (_, _, k), total in load.items())
    assert sum(p for p, s in zip(step["padded_tokens"], step["sample_index"], strict=True)
               if s >= 0) == 12 * 1024
    # ... and, unlike Megatron's two, they take one microbatch: two rows on each rank.
    assert set(step["microbatch"]) == {0}


def test_pad_to_multiple_counts_in_capacity(tmp_path: Path) -> None:
    # 1000-token rows pad to 1024 with N = 32: still two per rank. 1030-token rows pad to 1056:
    # two no longer fit 2048, so the plan needs more room than the same rows without the option.
    plan = read_plan(_pad_plan(tmp_path, [1000] * 12, "--pad-to-multiple", "32"))
    step = plan.step(0).to_pydict()
    assert {p for p, s in zip(step["padded_tokens"], step["sample_index"], strict=True)
            if s >= 0} == {1024}
    tight = read_plan(_pad_plan(tmp_path, [1030] * 12, "--pad-to-multiple", "32")).step(0)
    loose = read_plan(_pad_plan(tmp_path, [1030] * 12)).step(0)
    rows = tight.to_pydict()
    for p, k, s in zip(rows["padded_tokens"], rows["cp_size"], rows["sample_index"], strict=True):
        assert p % 32 == 0
        assert p % (2 * k if k > 1 else 1) == 0
        if s >= 0:
            assert p >= 1056
    total = lambda b: sum(b.to_pydict()["padded_tokens"])  # noqa: E731
    assert total(tight) > total(loose)


def test_pad_to_multiple_default_leaves_the_header_alone(tmp_path: Path) -> None:
    plan = _pad_plan(tmp_path, [1024] * 12)
    again = _pad_plan(tmp_path, [1024] * 12, "--pad-to-multiple", "1")
    assert hashlib.sha256(plan.read_bytes()).digest() == hashlib.sha256(again.read_bytes()).digest()
    assert "pad_to_multiple" not in json.loads(read_plan(plan).header.to_json())
    assert read_plan(plan).header.pad_to_multiple == 1


def test_pad_to_multiple_below_one_is_a_clear_error(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "lengths.txt"
    data.write_text("10\n")
    with pytest.raises(SystemExit) as e:
        main([str(data), "--dp", "1", "--cp", "1", "--max-tokens-per-rank", "64",
              "--global-batch-size", "1", "--pad-to-multiple", "0", "-o", str(tmp_path / "x")])
    assert e.value.code == 2
    assert "argument --pad-to-multiple: expected a positive integer, got 0" in \
        capsys.readouterr().err
    assert not (tmp_path / "x").exists()
