"""Nothing a user owns is overwritten by accident.

Before: ``dcp-plan plans/data.arrow ...`` (default output ``plans/<stem>.arrow``) and ``dcp-plan
data.jsonl -o data.jsonl ...`` replaced the dataset with the plan and exited 0.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from planner.cli import main
from planner.notebook.view import read_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import write_megatron_dataset
from tests.reliability.helpers import PLAN_FLAGS, SAMPLE


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_output_that_is_the_input_is_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    data = shutil.copy(SAMPLE, tmp_path / "data.jsonl")
    before = _sha(Path(data))
    assert main([str(data), "-o", str(data), *PLAN_FLAGS]) == 2
    assert "the output is the input" in capsys.readouterr().err
    # the same file under another spelling, a symlink and a hard link
    os.symlink(data, tmp_path / "link.arrow")
    os.link(data, tmp_path / "hard.arrow")
    for out in (tmp_path / "." / "data.jsonl", tmp_path / "link.arrow", tmp_path / "hard.arrow"):
        assert main([str(data), "-o", str(out), *PLAN_FLAGS, "--overwrite"]) == 2
        assert "the output is the input" in capsys.readouterr().err
    assert _sha(Path(data)) == before


def test_default_output_that_is_the_input_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An Arrow dataset under plans/: the default output plans/<stem>.arrow is the dataset."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plans").mkdir()
    assert main([str(SAMPLE), "-o", "plans/data.arrow", *PLAN_FLAGS]) == 0
    import pyarrow as pa
    import pyarrow.ipc as ipc

    # A token dataset in Arrow format that happens to live at plans/data.arrow.
    table = pa.table({"length": pa.array([100, 200, 300] * 40, pa.int64())})
    with pa.OSFile("plans/data.arrow", "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    before = _sha(Path("plans/data.arrow"))
    assert main(["plans/data.arrow", *PLAN_FLAGS]) == 2
    assert "plans/data.arrow: the output is the input" in capsys.readouterr().err
    assert _sha(Path("plans/data.arrow")) == before


def test_megatron_pair_is_an_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = tmp_path / "ds"
    write_megatron_dataset(prefix, [list(range(50))] * 30)
    for out in ("ds.bin", "ds.idx"):
        assert main([str(prefix), "-o", str(tmp_path / out), *PLAN_FLAGS, "--overwrite"]) == 2
        assert "the output is the input" in capsys.readouterr().err


def test_existing_file_that_is_not_a_plan_needs_overwrite(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.arrow"
    notes.write_text("my notes\n")
    assert main([str(SAMPLE), "-o", str(notes), *PLAN_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a dcp plan; refusing to overwrite it" in err
    assert notes.read_text() == "my notes\n"
    assert main([str(SAMPLE), "-o", str(notes), *PLAN_FLAGS, "--overwrite"]) == 0
    assert read_plan(notes).num_steps == 20
    # an existing plan is replaced without --overwrite (re-planning is the normal workflow)
    assert main([str(SAMPLE), "-o", str(notes), *PLAN_FLAGS, "--seed", "1"]) == 0
    assert read_plan(notes).header.seed == 1


def test_library_writer_refuses_too(tmp_path: Path) -> None:
    from tests.planner.planfile import handmade
    from tests.planner.planfile.test_schema import batches

    target = tmp_path / "keep.txt"
    target.write_text("precious")
    h = handmade.header()
    with pytest.raises(ValueError, match="exists and is not a dcp plan"):
        write_plan(target, h, batches(h))
    assert target.read_text() == "precious"
    with pytest.raises(ValueError, match="is a directory"):
        write_plan(tmp_path, h, batches(h))
