"""planner.jit: kernels run as Python until compiling pays, with the same plans either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from planner import jit
from planner.cli import main as plan_main
from planner.sources.jsonl import jsonl_index

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample.jsonl"
FLAGS = [
    ["--dp", "4", "--cp", "2", "--max-tokens-per-rank", "4096", "--global-batch-size", "64"],
    ["--dp", "2", "--cp", "4", "--tp", "2", "--sequence-parallel", "--max-tokens-per-rank",
     "2048", "--global-batch-size", "32", "--long-sequences", "split", "--layout", "contiguous"],
    ["--dp", "2", "--cp", "2", "--pp", "2", "--max-tokens-per-rank", "1024",
     "--global-batch-size", "16", "--long-sequences", "truncate", "--effort", "max"],
    ["--dp", "8", "--cp", "1", "--max-tokens-per-rank", "8192", "--global-batch-tokens", "60000",
     "--long-sequences", "drop", "--pad-to-multiple", "16", "--epochs", "2"],
    ["--dp", "16", "--cp", "16", "--max-tokens-per-rank", "512", "--global-batch-size", "256",
     "--long-sequences", "split", "--cp-sizes", "1,2,4,16", "--effort", "fast"],
]


@pytest.fixture
def mode() -> Iterator[None]:
    before = jit.mode()
    yield
    jit.set_mode(before)


@pytest.mark.parametrize("flags", FLAGS, ids=range(len(FLAGS)))
@pytest.mark.usefixtures("mode")
def test_python_and_compiled_kernels_write_the_same_plan(tmp_path: Path,
                                                         flags: list[str]) -> None:
    out = {}
    for m in ("never", "always"):
        jit.set_mode(m)
        p = tmp_path / f"{m}.arrow"
        assert plan_main([str(SAMPLE), "-o", str(p), "--quiet", "--seed", "5", *flags]) == 0
        out[m] = p.read_bytes()
    assert out["never"] == out["always"]


@pytest.mark.usefixtures("mode")
def test_jsonl_reference_path_reads_what_the_scanner_reads(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"input_ids": [1, 2, 3]}\n  \t\r\n{"length": 7}\n\n{"tokens": [4]}\r\n'
                  b'\xef\xbb\xbf{"x": 1, "input_ids": [5, 6]}\n{"length": 2}')
    got = {}
    for m in ("never", "always"):
        jit.set_mode(m)
        got[m] = jsonl_index(f)
    for a, b in zip(got["never"], got["always"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got["never"][2].tolist() == [3, 7, 1, 2, 2]


@pytest.mark.usefixtures("mode")
def test_a_budget_spent_compiles_and_a_cached_kernel_loads() -> None:
    from planner.solver.batches import radix_argsort

    jit.set_mode("auto")
    keys = np.arange(10, 0, -1, dtype=np.uint64)
    radix_argsort(keys)  # cached by the suite (always mode): loads, runs compiled
    assert jit.python_seconds() == 0.0
    jit.charge(jit.BUDGET_S + 0.1)  # a large job's Python time: from now on, compile
    assert jit._STATE.compiling
    jit.set_mode("never")
    radix_argsort(keys)
    assert jit.python_seconds() > 0.0
    with pytest.raises(ValueError, match="jit mode 'sometimes'"):
        jit.set_mode("sometimes")


def test_the_first_plan_compiles_nothing_and_a_bad_mode_is_named(tmp_path: Path) -> None:
    """The Quickstart's plan in a fresh process with an empty numba cache: every kernel runs as
    Python, nothing is compiled or cached, and the plan is the compiled kernels' plan."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "DCP_PLANNER_JIT": "auto"}
    out, ref = tmp_path / "auto.arrow", tmp_path / "ref.arrow"
    flags = [*FLAGS[0], "--seed", "0", "--quiet"]
    code = ("import sys, json; from planner.cli import main; from planner import jit; "
            "rc = main(sys.argv[1:]); print(json.dumps([rc, jit.python_seconds()]))")
    r = subprocess.run([sys.executable, "-c", code, str(SAMPLE), "-o", str(out), *flags],
                       env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    rc, spent = json.loads(r.stdout.splitlines()[-1])
    assert rc == 0
    assert 0 < spent < jit.BUDGET_S
    assert list(cache.rglob("*.nbi")) == []  # nothing compiled, so nothing cached
    assert plan_main([str(SAMPLE), "-o", str(ref), *flags]) == 0  # this process: compiled
    assert out.read_bytes() == ref.read_bytes()
    bad = subprocess.run([sys.executable, "-m", "planner.cli", str(SAMPLE), "-o",
                          str(tmp_path / "b.arrow"), *flags],
                         env={**env, "DCP_PLANNER_JIT": "sometimes"}, cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2, bad.stderr
    assert "DCP_PLANNER_JIT='sometimes': expected one of auto, always, never" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_a_large_job_leaves_every_kernel_it_used_cached(tmp_path: Path) -> None:
    """A job past the budget compiles what it ran as Python before (the JSONL scanner it read
    around included), so the next run of that size runs compiled from its first call. The budget
    is cut to 0.1 s to stand for a large job. (~30 s: every kernel compiled)"""
    cache = tmp_path / "cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "DCP_PLANNER_JIT": "auto"}
    code = ("import sys, json; from planner.cli import main; from planner import jit; "
            "jit.BUDGET_S = float(sys.argv.pop(1)); rc = main(sys.argv[1:]); "
            "print(json.dumps([rc, jit.python_seconds()]))")
    spent = []
    for budget, name in (("0.1", "a"), ("2.0", "b")):
        r = subprocess.run([sys.executable, "-c", code, budget, str(SAMPLE), "-o",
                            str(tmp_path / f"{name}.arrow"), *FLAGS[0], "--quiet"],
                           env=env, cwd=ROOT, capture_output=True, text=True, check=True)
        rc, s = json.loads(r.stdout.splitlines()[-1])
        assert rc == 0
        spent.append(s)
    assert spent[0] > 0.0
    assert spent[1] == 0.0  # every kernel loaded from the cache
    assert any(p.name.startswith("jsonl_scan.scan_chunk") for p in cache.rglob("*.nbi"))
    assert (tmp_path / "a.arrow").read_bytes() == (tmp_path / "b.arrow").read_bytes()
