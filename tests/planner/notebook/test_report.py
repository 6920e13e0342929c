"""`dcp-plan report`: one self-contained HTML page, rendered by a real headless Chromium.

The page is checked for content, not pixels: Chromium's DOM (``--dump-dom``) must hold every
section and figure title and the plan's gain numbers, the screenshot must not be blank, and
the file must reach for nothing outside itself. Chromium comes from Debian's packages:
``scripts/dev.sh test`` installs it where it can (root with apt-get, as in CI); elsewhere these
tests skip and say why, except under CI, where a missing browser fails them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from planner import read_plan
from planner.cli import main
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.notebook.report import FIGURES
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import LengthTable

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "data" / "sample.jsonl"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("chromium is missing in CI: scripts/dev.sh test installs it (apt-get "
                    "install chromium); the report must be rendered there")
    pytest.skip("no chromium here (Debian: apt-get install chromium; scripts/dev.sh test "
                "installs it when run as root with apt-get)")


def _render(chromium: str, page: Path, tmp: Path) -> tuple[str, np.ndarray]:
    """(the DOM Chromium built, the screenshot's pixels) of ``page``."""
    shot = tmp / "shot.png"
    runs = []
    for extra in (["--dump-dom"], [f"--screenshot={shot}", "--window-size=1200,2400"]):
        profile = tmp / f"profile-{len(runs)}"
        profile.mkdir()
        runs.append(subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *extra,
                                    page.as_uri()], capture_output=True, text=True,
                                   timeout=180, env={**os.environ, "HOME": str(tmp)}))
        assert runs[-1].returncode == 0, runs[-1].stderr[-2000:]
    import matplotlib.image

    return runs[0].stdout, matplotlib.image.imread(shot)


def _check_page(page: Path, dom: str, pixels: np.ndarray, stats: dict) -> None:  # type: ignore[type-arg]
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
    for _, title, _ in FIGURES:
        assert title in text, title
    for section in ("Predicted gain", "Summary"):
        assert section in text
    # The gain's parts and the cost model's mark (issue 33), as rendered.
    for label in ("ring traffic avoided", "load balance across ranks", "fewer microbatches",
                  "less padding", "Cost model dense-7b-h200: preset (estimate)"):
        assert label in text, label
    for key, label in (("vs_static_cp", "static CP"), ("vs_megatron", "Megatron's greedy")):
        if stats[key] is not None:
            assert f"{stats[key]:.3f}x" in text, key
            assert f"{stats[key]:.3f}x over {label}" in text
    # Not blank: the figures put many colours on a white page.
    rgb = pixels[..., :3]
    assert rgb.std() > 0.05
    assert (rgb.min(axis=-1) < 0.9).mean() > 0.02          # a few % of the page is ink
    raw = page.read_text()
    assert "<script" not in raw
    assert "<link" not in raw
    assert "<img" not in raw
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", raw)
    assert "@import" not in raw
    assert not re.search(r"""url\(\s*['"]?(?!#)""", raw)   # only the SVGs' own #clip ids


def test_report_of_32_steps_renders(tmp_path: Path, chromium: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "p.arrow"
    assert main([str(SAMPLE), "--dp", "2", "--cp", "4", "--max-tokens-per-rank", "8192",
                 "--global-batch-size", "64", "-o", str(plan), "--quiet"]) == 0
    out = tmp_path / "report.html"
    assert main(["report", str(plan), "-o", str(out)]) == 0
    assert f"{out}: report of {plan}" in capsys.readouterr().out
    stats = read_plan(plan).header.stats
    assert stats["vs_static_cp"] is not None
    assert stats["vs_megatron"] is not None
    dom, pixels = _render(chromium, out, tmp_path)
    _check_page(out, dom, pixels, stats)
    assert "bins of" not in dom                               # 32 steps: one bar per step


@pytest.mark.slow
def test_report_of_20000_steps_renders_binned(tmp_path: Path, chromium: str) -> None:
    rng = np.random.default_rng(3)
    n = 20_000 * 4
    lengths = np.where(rng.random(n) < 0.05, rng.uniform(2000, 8000, n),
                       rng.lognormal(6.0, 1.0, n)).astype(np.int64).clip(1, 8000)
    table = LengthTable(path="synthetic", format="text", lengths=lengths,
                        skipped=np.zeros(0, np.int64))
    config = PlannerConfig(parallel=ParallelConfig(dp=1, cp=2), capacity_tokens_per_rank=4096,
                           global_batch_size=4, effort="fast")
    made = make_plan(table, config, load_cost_model("default"))
    plan = write_plan(tmp_path / "p.arrow", made.header, made.record_batches())
    out = tmp_path / "report.html"
    assert main(["report", str(plan), "-o", str(out)]) == 0
    assert out.stat().st_size < 2 * 2**20                    # binned: the page stays small
    dom, pixels = _render(chromium, out, tmp_path)
    _check_page(out, dom, pixels, made.header.stats)
    assert "bins of 167 steps" in dom


def test_report_output_is_guarded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "p.arrow"
    other = tmp_path / "q.arrow"
    for path in (plan, other):
        assert main([str(SAMPLE), "--dp", "2", "--cp", "2", "--max-tokens-per-rank", "8192",
                     "--global-batch-size", "200", "-o", str(path), "--quiet"]) == 0
    mine = tmp_path / "mine.html"
    mine.write_text("my notes")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for argv, message in [(["-o", str(plan)], "is the input"),
                          (["-o", str(other)], "is not an HTML report"),
                          (["-o", str(mine)], "is not an HTML report"),
                          (["-o", str(tmp_path / "r.html"), "--summary-json",
                            str(tmp_path / "r.html")], "is also this run's --summary-json")]:
        assert main(["report", str(plan), *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before   # nothing changed
    assert main(["report", str(plan)]) == 0                  # default: beside the plan
    assert (tmp_path / "p.html").read_text().startswith("<!DOCTYPE html>")
    assert main(["report", str(plan)]) == 0                  # an earlier report is replaced
