"""Messages and defaults that say what happened (issue 32, item 5).

Before: a glob dataset with the default output wrote a file literally named ``plans/*.arrow``;
``dcp-plan compare`` hinted at ``--cp-sizes``, which it does not have.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from planner.cli import main as plan_main
from tests.reliability.helpers import write_token_jsonl


def test_a_glob_dataset_gets_a_plan_named_after_it(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ds = tmp_path / "ds"
    ds.mkdir()
    write_token_jsonl(ds / "shard-0.jsonl")
    write_token_jsonl(ds / "shard-1.jsonl", seed=1)
    monkeypatch.chdir(tmp_path)
    flags = ["--dp", "1", "--cp", "1", "--max-tokens-per-rank", "256", "--global-batch-size",
             "6", "--quiet"]
    assert plan_main([os.path.join("ds", "*.jsonl"), *flags]) == 0
    assert plan_main([os.path.join("ds", "shard-*.jsonl"), *flags]) == 0
    assert sorted(p.name for p in (tmp_path / "plans").iterdir()) == ["ds.arrow", "shard.arrow"]


def test_compare_hints_only_at_its_own_flags(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``dcp-plan compare`` hinted at ``--cp-sizes``, which it does not have."""
    data = write_token_jsonl(tmp_path / "d.jsonl")
    assert plan_main(["compare", str(data), "--pools", "4", "--max-tokens-per-rank", "1",
                      "--global-batch-size", "6"]) == 2
    err = capsys.readouterr().err
    assert "raise --max-tokens-per-rank to at least 8 or compare smaller --pools" in err
    assert "--cp-sizes" not in err


def test_a_deleted_working_directory_is_named(tmp_path: Path) -> None:
    """``dcp-plan /abs/d.jsonl`` (default output ``plans/d.arrow``, relative) from a working
    directory deleted under the shell: ``[Errno 2] No such file or directory``, no path."""
    import subprocess
    import sys

    from tests.reliability.helpers import ROOT, no_traceback

    data = write_token_jsonl(tmp_path / "d.jsonl")
    gone = tmp_path / "gone"
    gone.mkdir()
    script = (f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
              "from planner.cli import dispatch; sys.exit(dispatch.main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, str(data), "--dp", "1", "--cp", "1",
                           "--max-tokens-per-rank", "256", "--global-batch-size", "6",
                           "--quiet"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert done.returncode == 2
    assert no_traceback(done.stderr)
    assert "the working directory no longer exists" in done.stderr
    assert "[Errno 2]" not in done.stderr


def test_an_upper_case_suffix_trains_as_it_plans(tmp_path: Path) -> None:
    """``UP.PARQUET`` planned, then training said ``not an Arrow IPC file`` (item 4)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runtime.train.cli import main as train_main
    from tests.reliability.helpers import TRAIN_FLAGS

    data = tmp_path / "UP.PARQUET"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2, 3, 4]] * 12, pa.list_(pa.int32()))}),
                   data)
    plan = tmp_path / "p.arrow"
    assert plan_main([str(data), "-o", str(plan), "--dp", "1", "--cp", "1",
                      "--max-tokens-per-rank", "64", "--global-batch-size", "4", "--quiet"]) == 0
    assert train_main(["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS, "--steps",
                       "1"]) == 0


def test_a_uint64_id_past_int64_is_named_not_negative(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A ``list<uint64>`` id above 2^63 was reported as a negative id (item 4)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runtime.train.cli import main as train_main
    from tests.reliability.helpers import TRAIN_FLAGS

    rows = [[1, 2, 3, 4]] * 12
    rows[5] = [1, 2**63 + 5, 3, 4]
    data = tmp_path / "u.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.uint64()))}), data)
    plan = tmp_path / "p.arrow"
    assert plan_main([str(data), "-o", str(plan), "--dp", "1", "--cp", "1",
                      "--max-tokens-per-rank", "64", "--global-batch-size", "12",
                      "--quiet"]) == 0
    capsys.readouterr()
    assert train_main(["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS, "--steps",
                       "1"]) == 2
    err = capsys.readouterr().err
    assert f"{data}: sample 5 holds token id {2**63 + 5}, past the int64 range" in err
    assert "negative" not in err


def test_a_refusal_every_rank_reaches_prints_once(tmp_path: Path) -> None:
    """A pool-1 plan launched on 2 ranks: the world-size refusal printed once per rank."""
    import subprocess
    import sys

    from tests.reliability.helpers import ROOT, TRAIN_FLAGS, pool1_plan

    data = write_token_jsonl(tmp_path / "d.jsonl")
    plan = pool1_plan(plan_main, data, tmp_path / "p.arrow")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "-m", "runtime.train", "--plan", str(plan), "--dataset",
                           str(data), *TRAIN_FLAGS, "--steps", "1"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode != 0
    lines = [x for x in done.stderr.splitlines() if x.startswith("dcp-train: error:")]
    assert len(lines) == 1, done.stderr
    assert "plan built for world_size=1" in lines[0]
    assert "--nproc-per-node 1 -m runtime.train ARGS" in lines[0]


@pytest.mark.parametrize("layout", ["fixed_size_list", "list_view", "large_list_view"])
def test_every_list_layout_trains_as_it_plans(tmp_path: Path, layout: str) -> None:
    """``fixed_size_list`` and ``list_view`` token columns planned, then training found no
    token column (item 4)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from runtime.data.plan_reader import PlanReader
    from runtime.data.plan_source import open_plan_source
    from runtime.train.cli import main as train_main
    from tests.reliability.helpers import TRAIN_FLAGS

    rows = [[i % 50, 1, 2, 3] for i in range(12)]
    kind = {"fixed_size_list": pa.list_(pa.int32(), 4), "list_view": pa.list_view(pa.int32()),
            "large_list_view": pa.large_list_view(pa.int64())}[layout]
    data = tmp_path / "d.arrow"
    table = pa.table({"input_ids": pa.array(rows, kind)})
    with pa.OSFile(str(data), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    plan = tmp_path / "p.arrow"
    assert plan_main([str(data), "-o", str(plan), "--dp", "1", "--cp", "1",
                      "--max-tokens-per-rank", "64", "--global-batch-size", "4", "--quiet",
                      "--fingerprint", "content"]) == 0
    with PlanReader(plan) as reader:  # the content fingerprint: every token as planned
        source = open_plan_source(reader, [str(data)])
        assert source.read(5, 0, 4).tolist() == rows[5]
        getattr(source, "close", lambda: None)()
    assert train_main(["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS, "--steps",
                       "1"]) == 0


def test_the_only_list_column_is_the_default(tmp_path: Path) -> None:
    """A Parquet file whose only list column is ``ids`` was refused, though PLAN_FORMAT.md
    says that column is the default (item 4)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runtime.train.cli import main as train_main
    from tests.reliability.helpers import TRAIN_FLAGS

    data = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1, 2, 3, 4]] * 12, pa.list_(pa.int32())),
                             "name": ["x"] * 12}), data)
    plan = tmp_path / "p.arrow"
    assert plan_main([str(data), "-o", str(plan), "--dp", "1", "--cp", "1",
                      "--max-tokens-per-rank", "64", "--global-batch-size", "4", "--quiet",
                      "--fingerprint", "content"]) == 0
    assert train_main(["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS, "--steps",
                       "1"]) == 0


def test_calibrate_blames_the_flag_not_memory(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``dcp-calibrate --max-tokens 2`` said the host holds only about 2 tokens of the model
    (lower --min-length, or free memory) on a host with gigabytes free."""
    from runtime.calibrate.cli import main as calibrate_main

    try:
        code = calibrate_main(["--max-tokens", "2", "--min-length", "2", "--max-length", "2",
                               "--quick", "-o", str(tmp_path / "cm.json")])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "--max-tokens 2 holds fewer than two sequences of --min-length 2" in err
    assert "raise --max-tokens to at least 4" in err
    assert "memory" not in err.split("error:")[-1]
    assert not (tmp_path / "cm.json").exists()


# dcp-plan in a process where no optional package can be imported (``pip install .``).
_NO_EXTRAS = """
import sys
BLOCK = {"pandas", "polars", "matplotlib", "torch", "ray", "megatron", "torchtitan",
         "transformer_engine"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
from planner.cli import dispatch
sys.exit(dispatch.main(sys.argv[1:]))
"""


def test_a_base_install_runs_the_planner_or_names_the_extra(tmp_path: Path) -> None:
    """``pip install .`` without extras: ``dcp-plan report`` was a ModuleNotFoundError
    traceback (item 6). Planning, validate and show run; report and figures name the extra."""
    import subprocess
    import sys

    from tests.reliability.helpers import ROOT, no_traceback

    data = write_token_jsonl(tmp_path / "d.jsonl")
    plan = tmp_path / "p.arrow"
    flags = ["--dp", "1", "--cp", "1", "--max-tokens-per-rank", "256", "--global-batch-size",
             "6", "--quiet"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _NO_EXTRAS, *args], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    for args in ([str(data), "-o", str(plan), *flags], ["validate", str(plan), str(data)],
                 ["show", str(plan)]):
        done = run(*args)
        assert done.returncode == 0, (args, done.stderr)
    for args in (["report", str(plan), "-o", str(tmp_path / "r.html")],
                 ["compare", str(data), "--pools", "1", "--max-tokens-per-rank", "256",
                  "--global-batch-size", "6", "--figure", str(tmp_path / "f.png")]):
        done = run(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert no_traceback(done.stderr), done.stderr
        assert "needs matplotlib, which is not installed: pip install " \
            "'dcp-planner[notebook]'" in done.stderr


@pytest.mark.parametrize("program", ["dcp-plan", "dcp-train"])
def test_memory_that_runs_out_is_one_line(tmp_path: Path, program: str) -> None:
    """``ulimit -v`` 400-700 MB: tracebacks from pyarrow, OR-Tools, pandas or llvmlite (item 5).
    Now one line: out of memory, which library (or planner function) asked, the limit; exit 2
    and no file left. The limits put the failure at different imports (the same for any run of
    the program: they come before its work). Below some limit the C runtime itself gives up
    before Python can say anything (glibc's `cannot allocate memory for thread-local data:
    ABORT`, OpenBLAS's `Memory allocation still failed`): such a death is let pass, a Python
    traceback never."""
    import resource
    import subprocess
    import sys

    from tests.reliability.helpers import ROOT, no_traceback

    data = write_token_jsonl(tmp_path / "d.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    plan = ["planner.cli", str(data), "-o", str(out / "p.arrow"), "--dp", "1", "--cp", "1",
            "--max-tokens-per-rank", "256", "--global-batch-size", "6", "--quiet"]
    train = ["runtime.train", "--plan", str(out / "none.arrow"), "--dataset", str(data)]
    said = []
    for mib in (400, 500, 600, 700) if program == "dcp-plan" else (600, 680, 800, 900):
        def limit(mib: int = mib) -> None:
            resource.setrlimit(resource.RLIMIT_AS, (mib * 2**20, mib * 2**20))

        done = subprocess.run(
            [sys.executable, "-m", *(plan if program == "dcp-plan" else train)],
            capture_output=True, text=True, timeout=300, cwd=ROOT, preexec_fn=limit,
            env={**os.environ, "DCP_PLANNER_JIT": "never"})
        lines = done.stderr.strip().splitlines()
        if done.returncode == 0 or (lines and "no such plan file" in lines[-1]):
            (out / "p.arrow").unlink(missing_ok=True)  # this host's libraries fit the limit
            continue
        assert no_traceback(done.stderr), done.stderr
        if not any(x.startswith(f"{program}:") for x in lines):
            continue  # died in C, before Python had control (the docstring)
        assert done.returncode == 2, done.stderr
        # pyarrow's allocator may say a word of its own from C (`<jemalloc>: arena 0 ...`).
        assert all(x.startswith("<jemalloc>:") for x in lines[:-1]), done.stderr
        line = lines[-1]
        assert line.startswith(f"{program}: error: out of memory "), line
        assert f"(this process may map {mib / 1024:.2f} GiB: ulimit -v {mib * 1024})" in line
        said.append(line)
        assert list(out.iterdir()) == []
    assert said, "no limit ran out of memory"
