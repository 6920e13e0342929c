"""Bounded work (issue 22): memory independent of ``--epochs``.

Before: ``PlanStream`` drew every epoch's permutation and built every epoch's step jobs before
the first step was planned, so a huge ``--epochs`` grew memory without bound (a
``MemoryError`` traceback, or the OOM killer) before writing anything. Now epochs are drawn as
the steps stream (``plan.WINDOW_SEGMENTS`` segments at a time, at least one epoch), and the
plan is byte-identical to the one drawn all at once.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main as plan_main
from tests.reliability.helpers import ROOT, SAMPLE

# A billion epochs of the sample (32 steps each) in a process capped at 3 GB of address space:
# the first 100 steps must come out, equal to those of a 4-epoch plan.
_CAPPED = f"""
import itertools, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import numpy as np
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import PlanStream
from planner.sources.lengths import read_lengths
table = read_lengths({str(SAMPLE)!r})
def first_steps(epochs):
    cfg = PlannerConfig(parallel=ParallelConfig(dp=4, cp=2), capacity_tokens_per_rank=4096,
                        global_batch_size=64, epochs=epochs, seed=3, effort="fast")
    stream = PlanStream(table, cfg, load_cost_model())
    return stream.num_steps, list(itertools.islice(stream.steps(), 100))
n_huge, huge = first_steps(10**9)
n_small, small = first_steps(4)
assert n_huge == 32 * 10**9 and n_small == 128, (n_huge, n_small)
for a, b in zip(huge, small, strict=True):
    assert all(np.array_equal(a[k], b[k]) for k in a)
print("ok", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MB")
"""


def test_huge_epochs_stream_in_bounded_memory() -> None:
    proc = subprocess.run([sys.executable, "-c", _CAPPED], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")


@pytest.mark.parametrize("flags", [
    ["--global-batch-size", "64", "--epochs", "3"],
    ["--global-batch-tokens", "60000", "--epochs", "3", "--drop-last"],
    ["--global-batch-size", "100", "--epochs", "2", "--drop-last", "--workers", "2"],
])
def test_windows_of_epochs_give_the_same_bytes(tmp_path: Path, flags: list[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every epoch in a window of its own (WINDOW_SEGMENTS = 1) against all in one."""
    import planner.plan

    digests = []
    for window in (planner.plan.WINDOW_SEGMENTS, 1):
        monkeypatch.setattr(planner.plan, "WINDOW_SEGMENTS", window)
        out = tmp_path / f"w{window}.arrow"
        assert plan_main([str(SAMPLE), "-o", str(out), "--dp", "4", "--cp", "2",
                          "--max-tokens-per-rank", "4096", "--seed", "7", "--quiet",
                          *flags]) == 0
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]


@pytest.mark.slow
def test_windows_under_ray_start_ray_once(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--engine ray with every epoch a window: one Ray for all of them, the local bytes."""
    ray = pytest.importorskip("ray")
    import planner.plan

    monkeypatch.setattr(planner.plan, "WINDOW_SEGMENTS", 1)
    inits: list[object] = []
    real_init = ray.init
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append(k) or real_init(*a, **k))
    digests = []
    for engine in (["--engine", "local"], ["--engine", "ray", "--workers", "1"]):
        out = tmp_path / f"{engine[1]}.arrow"
        assert plan_main([str(SAMPLE), "-o", str(out), "--dp", "4", "--cp", "2",
                          "--max-tokens-per-rank", "4096", "--global-batch-size", "256",
                          "--epochs", "3", "--quiet", *engine]) == 0
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert len(inits) == 1
    assert not ray.is_initialized()
