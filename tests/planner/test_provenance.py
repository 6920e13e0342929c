"""Issue 33 items 3-4 through the real CLI: every plan says where its cost model comes from and
warns in one line when a deciding term is assumed (planner/provenance.py); the predicted gain's
parts (planfile/gain.py) add up to the whole on real plans of the bundled sample."""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from planner import read_plan
from planner.cli import main
from planner.cost import CostModel
from planner.planfile.gain import PARTS
from planner.planfile.io import write_plan

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample.jsonl"
GOLDEN = ROOT / "plans" / "golden" / "v1-sample-dp2-cp2-zigzag.arrow"
# The README's first five minutes and docs/planning.md's "Making a plan".
README = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "2048", "--global-batch-size", "8",
          "--long-sequences", "split"]
PLANNING = ["--dp", "4", "--cp", "2", "--max-tokens-per-rank", "4096", "--global-batch-size",
            "64"]


@pytest.fixture(scope="module")
def one_process_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cost model as ``dcp-calibrate`` writes it on one process (a tiny model, seconds of
    CPU): its ring terms are not measured and written as 0."""
    from runtime.calibrate.cli import main as calibrate

    out = tmp_path_factory.mktemp("cm") / "one-proc.json"
    assert calibrate(["--device", "cpu", "--attention", "reference", "--dtype", "fp32",
                      "--quick", "--layers", "1", "--hidden-size", "32", "--heads", "2",
                      "--query-groups", "1", "--vocab-size", "64", "--max-tokens", "256",
                      "--min-length", "32", "--max-length", "128", "--warmup", "0",
                      "--output", str(out)]) == 0
    return out


def _lines(text: str, head: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(head)]


def test_default_preset_is_marked_an_estimate(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.arrow"
    assert main([str(SAMPLE), "-o", str(out), *PLANNING]) == 0
    text = capsys.readouterr().out
    assert _lines(text, "cost ") == ["cost      dense-7b-h200: preset (estimate); all 5 terms "
                                     "assumed"]
    [warning] = _lines(text, "warning")
    assert "an estimate (a preset; no term measured)" in warning
    prov = read_plan(out).header.cost_model["provenance"]
    assert prov["kind"] == "preset"
    assert prov["source"] == "dense-7b-h200"
    assert set(prov["terms"].values()) == {"assumed"}
    # The measured presets are calibrations: every term measured, the ring at cp 2, no warning.
    assert main([str(SAMPLE), "-o", str(out), *PLANNING, "--cost-model", "h200-8x2048-te"]) == 0
    text = capsys.readouterr().out
    assert _lines(text, "cost ") == [
        "cost      h200-8x2048-te: calibrated on 2 x NVIDIA H200 (date not recorded); all 5 "
        "terms measured (ring at cp 2)"]
    assert _lines(text, "warning") == []


def test_one_process_calibration_warns_in_one_line(one_process_model: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out, again = tmp_path / "p.arrow", tmp_path / "q.arrow"
    model = ["--cost-model", str(one_process_model)]
    assert main([str(SAMPLE), "-o", str(out), *PLANNING, *model]) == 0
    text = capsys.readouterr().out
    header = read_plan(out).header
    assert header.cost_model["parameters"]["cp_fixed_s"] == 0.0
    assert header.cost_model["parameters"]["cp_token_s"] == 0.0
    prov = header.cost_model["provenance"]
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert prov["kind"] == "calibrated"
    assert prov["date"] == today
    assert prov["terms"]["cp_fixed_s"] == prov["terms"]["cp_token_s"] == "assumed"
    assert prov["terms"]["linear_s_per_token"] == "measured"
    [cost] = _lines(text, "cost ")
    assert cost.startswith("cost      one-proc: calibrated on 1 x ")
    assert f"(cpu) {today}; measured linear_s_per_token" in cost
    assert cost.endswith("; assumed cp_fixed_s, cp_token_s")
    # CP > 1 groups in use (the plan's cp2 groups and static CP 2): exactly one warning line.
    [warning] = _lines(text, "warning")
    assert "cp_fixed_s = 0, cp_token_s = 0 (one process" in warning
    assert "while CP > 1 groups are in use (cp2: " in warning
    assert "static CP 2 baseline" in warning
    assert "CP is priced as free" in warning
    # The provenance comes from the file alone: the same inputs give the same bytes.
    assert main([str(SAMPLE), "-o", str(again), *PLANNING, *model, "--quiet"]) == 0
    sha = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (out, again)]
    assert sha[0] == sha[1]
    # show, compare and the report carry the same mark and warning.
    assert main(["show", str(out), "--steps", "0:1"]) == 0
    shown = capsys.readouterr().out
    assert f"cost: {cost.split(None, 1)[1]}" in shown.splitlines()
    assert f"warning: {warning.split(None, 1)[1]}" in shown.splitlines()
    assert main(["compare", str(SAMPLE), "--pools", "4", "--cp", "2", "--max-tokens-per-rank",
                 "8192", "--global-batch-size", "64", *model, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cost_model_mark"] == cost.split(None, 1)[1]
    assert "cp_fixed_s = 0, cp_token_s = 0" in doc["cost_model_warning"]
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "id='cost-warning'" in page
    assert "cp_fixed_s = 0, cp_token_s = 0" in page
    shown_html = read_plan(out)._repr_html_()   # the notebook's table of the plan
    assert html.escape(cost.split(None, 1)[1]) in shown_html
    assert "cp_fixed_s = 0, cp_token_s = 0" in shown_html
    # With no CP > 1 group anywhere (a pool of one rank), the ring decides nothing: no warning.
    assert main([str(SAMPLE), "-o", str(again), "--dp", "1", "--cp", "1",
                 "--max-tokens-per-rank", "65536", "--global-batch-size", "64", *model]) == 0
    assert _lines(capsys.readouterr().out, "warning") == []


@pytest.mark.parametrize("flags", [README, PLANNING], ids=["readme", "planning"])
def test_gain_parts_sum_to_the_gain(flags: list[str], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.arrow"
    assert main([str(SAMPLE), "-o", str(out), *flags, "--quiet"]) == 0
    stats = read_plan(out).header.stats
    checked = 0
    for name, info in stats["baselines"].items():
        parts, basis = info["parts"], info["parts_of"]
        assert set(parts) == set(PARTS)
        whole = basis["baseline_seconds"] - basis["plan_seconds"]
        assert sum(parts.values()) == pytest.approx(whole, rel=1e-9, abs=1e-12), name
        assert whole > 0
        if info["infeasible_steps"] == 0:   # the whole plan: the header's own totals
            assert basis["steps"] == stats["num_steps"]
            assert basis["plan_seconds"] == pytest.approx(stats["simulated_seconds"], rel=1e-12)
            assert basis["baseline_seconds"] == info["seconds"]
            key = "vs_static_cp" if name == "static-cp" else "vs_megatron"
            assert 1 + sum(parts.values()) / basis["plan_seconds"] == pytest.approx(
                stats[key], rel=1e-9)
            checked += 1
        else:   # only the steps it can run
            assert basis["steps"] == stats["num_steps"] - info["infeasible_steps"]
    assert checked >= 1
    # show --gain prints them, and its shares add up to the ratio less 1.
    assert main(["show", str(out), "--gain", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    for d in shown["gain"].values():
        shares = sum(p["share"] for p in d["parts"].values())
        assert shares == pytest.approx(d["ratio"] - 1, rel=1e-9, abs=1e-12)
    assert main(["show", str(out), "--gain"]) == 0
    text = capsys.readouterr().out
    for label in PARTS.values():
        assert text.count(f"  {label} ") == 2
    assert "Megatron's greedy: " in text
    assert "(= " in text
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "id='gain-parts'" in page
    assert "id='parts-megatron-greedy'" in page


def test_parts_attribute_the_term_that_differs(tmp_path: Path) -> None:
    # A model with only the per-token and microbatch terms: no ring cost, so no ring part.
    from planner.config import ParallelConfig, PlannerConfig
    from planner.plan import make_plan
    from planner.sources.lengths import read_lengths

    table = read_lengths([str(SAMPLE)])
    config = PlannerConfig(parallel=ParallelConfig(dp=4, cp=2), capacity_tokens_per_rank=4096,
                           global_batch_size=64)
    cost = CostModel(name="no-ring", linear_s_per_token=5e-5, attention_s_per_token2=3e-9,
                     microbatch_s=0.003)
    stats = make_plan(table, config, cost).header.stats
    for info in stats["baselines"].values():
        assert info["parts"]["ring"] == 0.0
    # A ring this costly makes static CP 2's ring the largest part.
    costly = dataclasses.replace(cost, name="ring", cp_fixed_s=0.05, cp_token_s=1e-4)
    parts = make_plan(table, config, costly).header.stats["baselines"]["static-cp"]["parts"]
    assert max(parts, key=lambda k: parts[k]) == "ring"


def test_old_plans_without_provenance_or_parts_still_show(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A format-1 golden plan: no gain, no parts, no provenance.
    assert main(["show", str(GOLDEN), "--gain"]) == 0
    text = capsys.readouterr().out
    assert "cost: dense-7b-h200: provenance not recorded" in text
    assert "warning" not in text
    assert main(["show", str(GOLDEN), "--steps", "0:2"]) == 0
    assert "provenance not recorded" in capsys.readouterr().out
    assert main(["report", str(GOLDEN), "-o", str(tmp_path / "g.html")]) == 0
    assert "provenance not recorded" in (tmp_path / "g.html").read_text()
    # A format-2 plan written before the keys: the header without them, rewritten and valid.
    new = tmp_path / "new.arrow"
    assert main([str(SAMPLE), "-o", str(new), *PLANNING, "--quiet"]) == 0
    view = read_plan(new)
    header = view.header
    cost_model = {k: v for k, v in header.cost_model.items() if k != "provenance"}
    stats = json.loads(json.dumps(header.stats))
    for info in stats["baselines"].values():
        info.pop("parts")
        info.pop("parts_of")
    older = dataclasses.replace(header, cost_model=cost_model, stats=stats)
    reader = pa.ipc.open_file(pa.memory_map(str(new)))
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    view.close()
    old = write_plan(tmp_path / "old.arrow", older, batches)
    assert main(["show", str(old), "--gain"]) == 0
    text = capsys.readouterr().out
    assert text.count("parts not recorded: the plan was made before") == 2
    assert "provenance not recorded" in text
    assert main(["report", str(old), "-o", str(tmp_path / "o.html")]) == 0


def test_a_hand_written_file_is_an_estimate_and_fitted_is_reserved(tmp_path: Path) -> None:
    from planner import provenance
    from planner.cost import load_cost_model

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "parameters": {
        "linear_s_per_token": 1e-5, "attention_s_per_token2": 1e-9, "cp_fixed_s": 1e-3}}))
    prov = load_cost_model(str(path)).provenance
    assert prov["kind"] == "file"
    assert prov["source"] == str(path)
    assert provenance.mark("mine", prov) == ("mine: file (estimate: no measurement recorded); "
                                            "all 5 terms assumed")
    # What a model fitted from a run's log will carry (item 2 of issue 33 writes it).
    parameters = {"linear_s_per_token": 1e-5, "attention_s_per_token2": 1e-9}
    fitted = {"log": "train.jsonl", "date": "2026-12-02",
              "terms": ["linear_s_per_token", "attention_s_per_token2", "cp_fixed_s",
                        "cp_token_s"]}
    doc = {"name": "fit", "parameters": parameters, "fitted": fitted}
    prov = provenance.of_document(doc, source="fit.json", preset=False)
    assert provenance.label(prov) == "fitted from train.jsonl 2026-12-02"
    assert prov["terms"]["microbatch_s"] == "assumed"
    warning = provenance.warning(prov, parameters, ring_used="cp2: 3")
    assert warning is not None
    assert warning.startswith("assumed, not measured: microbatch_s:")
    every = provenance.of_document(
        {**doc, "fitted": {**fitted, "terms": list(provenance.TERMS)}},
        source="fit.json", preset=False)
    assert provenance.warning(every, parameters, ring_used="cp2: 3") is None
