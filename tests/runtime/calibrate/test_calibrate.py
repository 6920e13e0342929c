"""dcp-calibrate: the fit recovers known parameters; the grids; CPU runs of 1 and 2 processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import CostModel, load_cost_model
from runtime.calibrate.cli import main
from runtime.calibrate.fit import Sample, fit_compute, fit_cost_model, format_table, nnls
from runtime.calibrate.memory import (
    MemoryProbe,
    fit_memory,
    fit_tmax,
    peak_rss,
    predicted_peak,
    probe_max_tokens,
    reset_peak_rss,
)
from runtime.calibrate.run import (
    CalibrateConfig,
    calibrate,
    grid_defaults,
    resolve_attention,
    to_json,
)
from runtime.calibrate.timing import MicrobatchTimer, ring_grid, single_grid
from runtime.train.model import GPTConfig
from tests.dist import run_distributed

TRUE = CostModel(name="true", linear_s_per_token=9.4e-6, attention_s_per_token2=1.06e-9,
                 cp_fixed_s=1.2e-3, cp_token_s=4.3e-6, microbatch_s=2e-3)
TINY = GPTConfig(vocab_size=64, num_layers=1, hidden_size=32, num_heads=2, num_query_groups=1)
TINY_FLAGS = ["--device", "cpu", "--attention", "reference", "--dtype", "fp32", "--quick",
              "--layers", "1", "--hidden-size", "32", "--heads", "2", "--query-groups", "1",
              "--vocab-size", "64", "--max-tokens", "256", "--min-length", "32",
              "--max-length", "128", "--warmup", "0"]


def _synthetic(model: CostModel, noise: float = 0.0, seed: int = 0,
               sizes: tuple[int, ...] = (2, 4, 8)) -> list[Sample]:
    """The default grids (Tmax 64K, 512..32K) timed by ``model``, times noise e^N(0, noise)."""
    rng = np.random.default_rng(seed)
    buffers = [(1, b) for b in single_grid(65536, 512, 32768)]
    buffers += ring_grid(65536, 512, 32768, sizes)
    return [Sample(cp_size=k, lengths=b,
                   seconds=model.group_time(k, list(b)) * float(np.exp(rng.normal(0, noise))))
            for k, b in buffers]


# ---------------------------------------------------------------------------------------------
# Fitting (pure).


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cols=st.integers(1, 3))
def test_nnls_satisfies_kkt(seed: int, cols: int) -> None:
    """x >= 0; the gradient vanishes where x > 0 and is >= 0 where x == 0 (optimality)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(12, cols))
    y = rng.normal(size=12)
    x = nnls(a, y)
    grad = a.T @ (a @ x - y)
    scale = np.abs(a).sum() * (np.abs(y).sum() + 1)
    assert np.all(x >= 0)
    assert np.all(np.abs(grad[x > 0]) <= 1e-9 * scale)
    assert np.all(grad[x == 0] >= -1e-9 * scale)


def test_nnls_clips_a_negative_unconstrained_solution() -> None:
    # y = 2 - x exactly: the unconstrained slope is -1; the best non-negative fit is flat.
    a = np.column_stack([np.ones(5), np.arange(5.0)])
    y = 2 - np.arange(5.0)
    x = nnls(a, y)
    assert x[1] == 0.0
    assert x[0] == pytest.approx(np.mean(y))


def test_fit_recovers_exact_parameters() -> None:
    fit = fit_cost_model(_synthetic(TRUE), name="fit")
    for key, value in TRUE.parameters.items():
        assert fit.model.parameters[key] == pytest.approx(value, rel=1e-6), key
    assert fit.ring_measured
    assert np.abs(fit.relative_errors()).max() < 1e-9


def test_fit_recovers_zero_terms_as_zero() -> None:
    true = CostModel(name="t", linear_s_per_token=1e-5, attention_s_per_token2=0.0,
                     cp_fixed_s=0.0, cp_token_s=2e-6, microbatch_s=0.0)
    params = fit_cost_model(_synthetic(true), name="fit").model.parameters
    for key, value in true.parameters.items():
        assert params[key] == pytest.approx(value, rel=1e-6, abs=1e-15), key


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_tolerates_noise(seed: int) -> None:
    """3% timing noise: per-token terms within 8%, the ring's per-token term within 15%, and the
    fitted model predicts the true (noise-free) times within 6% (over 200 seeds the worst were
    4.3%, 6.9%, 7.6% and 5.9%)."""
    samples = _synthetic(TRUE, noise=0.03, seed=seed)
    fit = fit_cost_model(samples, name="fit")
    got = fit.model.parameters
    assert got["linear_s_per_token"] == pytest.approx(TRUE.linear_s_per_token, rel=0.08)
    assert got["attention_s_per_token2"] == pytest.approx(TRUE.attention_s_per_token2, rel=0.08)
    assert got["cp_token_s"] == pytest.approx(TRUE.cp_token_s, rel=0.15)
    truth = np.array([TRUE.group_time(s.cp_size, list(s.lengths)) for s in samples])
    assert np.abs(np.asarray(fit.predicted) / truth - 1).max() < 0.06
    assert fit.summary()["cp1_rms_rel_error"] < 0.05


def test_fit_without_ring_samples_prices_no_ring() -> None:
    fit = fit_cost_model(_synthetic(TRUE, sizes=()), name="fit")
    assert not fit.ring_measured
    assert fit.model.cp_fixed_s == fit.model.cp_token_s == 0.0
    assert fit.model.linear_s_per_token == pytest.approx(TRUE.linear_s_per_token, rel=1e-6)
    assert "cp_rms_rel_error" not in fit.summary()


def test_fit_needs_varied_samples() -> None:
    same = [Sample(cp_size=1, lengths=(512,) * 8, seconds=1.0)] * 4
    with pytest.raises(ValueError, match="vary"):
        fit_compute(same)
    with pytest.raises(ValueError, match="at least 3"):
        fit_compute(same[:2])


def test_table_lists_every_sample() -> None:
    fit = fit_cost_model(_synthetic(TRUE, sizes=(2,)), name="fit")
    lines = format_table(fit).splitlines()
    assert len(lines) == 1 + len(fit.samples) + 4
    assert "1x32768+64x512" in format_table(fit)


# ---------------------------------------------------------------------------------------------
# Grids (pure).


def test_single_grid_example() -> None:
    assert single_grid(4096, 512, 2048, quick=True) == [
        (2048, 2048), (512,) * 8, (2048, 512, 512, 512, 512), (1024,), (512, 512)]


@pytest.mark.parametrize("quick", [False, True])
def test_grids_stay_in_bounds(quick: bool) -> None:
    single = single_grid(65536, 512, 32768, quick=quick)
    assert max(sum(b) for b in single) == 65536
    assert all(sum(b) <= 65536 and min(b) >= 512 and max(b) <= 32768 for b in single)
    assert {32768, 512} <= {n for b in single for n in b}
    ring = ring_grid(65536, 512, 32768, (2, 4, 8), quick=quick)
    assert {k for k, _ in ring} == {2, 4, 8}
    for k, b in ring:
        assert all(n % (2 * k) == 0 for n in b)
        assert sum(b) // k <= 65536 // 2  # per-rank share


def test_default_grid_size_fits_the_budget() -> None:
    """20 CP=1 buffers plus 6 per CP size: with 3 + 7 runs each, about 260 runs at 2 CP sizes,
    which keeps 8 x 2048 on an H200 (well under a second per run) within the ~2 minutes the
    module docstring promises."""
    assert len(single_grid(65536, 512, 32768)) == 20
    assert len(ring_grid(65536, 512, 32768, (2,))) == 6


def test_defaults_fill_the_grid_bounds() -> None:
    def defaults(**kw: Any) -> tuple[int, int]:
        return grid_defaults(**{"quick": False, "device": "cuda", "max_tokens": None,
                                "max_length": None, "min_length": 512, **kw})

    assert defaults() == (65536, 32768)
    assert defaults(device="cpu") == (8192, 4096)
    assert defaults(quick=True) == defaults(quick=True, device="cpu") == (4096, 2048)
    # A cap given alone sets the longest document (it used to be an error: 32768 > 8192).
    assert defaults(max_tokens=8192) == (8192, 4096)
    assert defaults(quick=True, max_tokens=1024) == (1024, 512)
    assert defaults(quick=True, max_length=4096) == (4096, 4096)


# ---------------------------------------------------------------------------------------------
# Memory: the probe's model and the bound it puts on Tmax.


def test_memory_fit_recovers_an_exact_peak_model() -> None:
    def peak(lengths: tuple[int, ...]) -> int:
        return 500_000_000 + 9000 * sum(lengths) + 60 * sum(n * n for n in lengths)

    assert fit_memory(peak, 1024) == (500_000_000, 9000, 60.0)


def test_tmax_is_the_largest_power_of_two_under_the_budget() -> None:
    probe = MemoryProbe(max_tokens=65536, fixed_bytes=500 << 20, bytes_per_token=9000,
                        bytes_per_token2=60.0, total_bytes=8 << 30, budget_bytes=4 << 30)
    got = fit_tmax(probe, max_tokens=65536, min_length=512, max_length=32768)
    assert got.max_tokens == 4096  # 8192 x 8192 x 60 bytes of scores alone are 3.75 GiB
    assert got.predicted_peak_bytes == int(predicted_peak(probe, 4096, 32768))
    assert got.predicted_peak_bytes <= probe.budget_bytes
    assert predicted_peak(probe, 8192, 32768) > probe.budget_bytes
    small = MemoryProbe(max_tokens=65536, fixed_bytes=500 << 20, bytes_per_token=9000,
                        bytes_per_token2=60.0, total_bytes=1 << 30, budget_bytes=520 << 20,
                        ranks_on_host=2)
    with pytest.raises(ValueError, match=r"this host \(1.0 GiB available, 2 rank\(s\) on it\) "
                       r"holds only about 512 tokens.*lower --min-length"):
        fit_tmax(small, max_tokens=65536, min_length=512, max_length=32768)


def _probe_and_run_biggest(rank: int, world_size: int, store_path: str,
                           available: int) -> dict[str, int]:
    """The CPU probe with ``available`` bytes on the host, then the grid's largest buffer run
    for real: its measured peak against what the host had."""
    del rank, world_size, store_path
    model = GPTConfig(vocab_size=256, num_layers=2, hidden_size=64, num_heads=4,
                      num_query_groups=4)
    # The reference attention holds every document's L x L scores: memory grows as sum L^2.
    timer = MicrobatchTimer(model, attention="reference", dtype="fp32",
                            device=torch.device("cpu"), seed=0)
    reset_peak_rss()
    start = peak_rss()
    probe = probe_max_tokens(timer, max_tokens=65536, min_length=256, max_length=32768,
                             memory_fraction=0.7, available_bytes=available)
    biggest = single_grid(probe.max_tokens, 256, 32768)[0]
    reset_peak_rss()
    timer.run(timer.inputs(biggest, 1, 0, 0), None, [0])
    return {"start": start, "tmax": probe.max_tokens, "budget": probe.budget_bytes,
            "predicted": probe.predicted_peak_bytes, "peak": peak_rss(),
            "twice": int(predicted_peak(probe, 2 * probe.max_tokens, 32768))}


@pytest.mark.dist
def test_cpu_probe_keeps_the_largest_buffer_within_the_host() -> None:
    # A host with 1.5 GiB available: the probe's Tmax fits with the default 0.7 margin, the
    # measured peak of its largest buffer stays within what the host has, and twice that Tmax
    # would not have fitted (so the bound is the memory's, not the cap's).
    available = 3 << 29
    (r,) = run_distributed(_probe_and_run_biggest, 1, available, timeout=240)
    assert 512 <= r["tmax"] < 65536
    assert r["predicted"] <= r["budget"] < r["twice"]
    assert r["peak"] <= r["start"] + available, r


# ---------------------------------------------------------------------------------------------
# Real runs on CPU.


def test_the_quick_default_runs_quickly_within_memory(tmp_path: Path) -> None:
    """``dcp-calibrate -o cm.json --quick`` as a newcomer types it (it allocated until the
    kernel killed it at 24 GB): Tmax 4,096, five buffers, a peak inside the probe's budget."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "runtime.calibrate", "-o", "cm.json", "--quick"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    m = json.loads((tmp_path / "cm.json").read_text())["measured"]
    assert m["max_tokens"] == 4096
    assert (m["warmup"], m["repeats"]) == (1, 3)
    assert [s["documents"] for s in m["samples"]] == ["2x2048", "8x512", "1x2048+4x512",
                                                      "1x1024", "2x512"]
    memory = m["memory"]
    assert 0 < memory["predicted_peak_bytes"] <= memory["budget_bytes"]
    assert memory["peak_bytes"] <= memory["budget_bytes"]
    assert memory["peak_bytes"] < 2 << 30  # (the old default's first buffer held over 24 GB)


def test_te_falls_back_to_torch_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = CalibrateConfig(output="x.json", device="cpu", attention="te")
    assert resolve_attention(cfg) == "torch"
    assert "measuring --attention torch instead" in capsys.readouterr().err


def test_bad_flags_exit_with_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main([*TINY_FLAGS, "--min-length", "256", "--output", str(tmp_path / "x.json")])
    assert e.value.code == 2


def test_one_process_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "tiny-cpu.json"
    assert main([*TINY_FLAGS, "--output", str(out)]) == 0
    model = load_cost_model(str(out))
    assert model.name == "tiny-cpu"
    # Times are positive, so the non-negative fit puts weight on some term; which one depends on
    # the machine's noise (a loaded CPU can make the 2-parameter split degenerate).
    terms = (model.linear_s_per_token, model.attention_s_per_token2, model.microbatch_s)
    assert min(terms) >= 0
    assert sum(terms) > 0
    assert model.cp_fixed_s == model.cp_token_s == 0.0
    data = json.loads(out.read_text())
    m = data["measured"]
    assert m["attention"] == "reference"
    assert m["world_size"] == 1
    assert not m["ring_measured"]
    assert m["model"]["hidden_size"] == 32
    assert m["dtype"] == "fp32"
    assert len(m["samples"]) == len(single_grid(256, 32, 128, quick=True))
    assert all(s["seconds"] > 0 and len(s["repeats"]) == 3 for s in m["samples"])
    captured = capsys.readouterr()
    assert "ring terms were not measured" in captured.err
    assert captured.out.rstrip().endswith(f"wrote {out}")
    assert "measured ms" in captured.out


def _calibrate_rank(rank: int, world_size: int, store_path: str, cfg: CalibrateConfig,
                    model_config: GPTConfig) -> dict[str, Any]:
    del rank, world_size, store_path
    return to_json(calibrate(cfg, model_config))


@pytest.mark.dist
def test_two_process_ring_measurement(tmp_path: Path) -> None:
    cfg = CalibrateConfig(output=str(tmp_path / "two.json"), device="cpu",
                          attention="reference", dtype="fp32", max_tokens=256, min_length=32,
                          max_length=128, warmup=0, repeats=2, quick=True)
    results = run_distributed(_calibrate_rank, 2, cfg, TINY, timeout=180)
    # Every rank saw the same slowest-rank times, so every rank fitted the same model.
    assert results[0]["parameters"] == results[1]["parameters"]
    m = results[0]["measured"]
    assert m["ring_measured"]
    assert m["world_size"] == 2
    ring = [s for s in m["samples"] if s["cp_size"] == 2]
    # Per-rank shares 128 and 32 tokens: buffers of 256 and 64 tokens, documents up to 128.
    assert [s["documents"] for s in ring] == ["2x128", "1x64"]
    assert "cp_rms_rel_error" in m["fit"]
    CostModel.from_dict(results[0], source="two.json")


@pytest.mark.slow
@pytest.mark.dist
def test_nproc_spawns_a_gloo_world(tmp_path: Path) -> None:
    out = tmp_path / "spawned.json"
    assert main([*TINY_FLAGS, "--nproc", "2", "--repeats", "2", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["measured"]["world_size"] == 2
    assert data["measured"]["ring_measured"]
    load_cost_model(str(out))
