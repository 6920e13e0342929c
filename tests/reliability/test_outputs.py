"""Every output guarded (issue 22): summaries, logs, plans, cost models, special files.

Before: ``--summary-json`` and ``--log-jsonl`` wrote anywhere with no check (``--summary-json
ds.jsonl`` replaced the dataset, ``--summary-json out.arrow`` the plan just written,
``--log-jsonl ds.jsonl`` appended to the dataset, a device node or a symlink to a pipe was
replaced by a regular file: all exit 0); a FIFO as ``-o`` hung; ``--overwrite`` replaced FIFOs
and devices; a symlink loop gave a ``RuntimeError`` traceback; a read-only directory and a
250-character name reported the temporary file and the wrong problem (a ``finally: unlink``
raised over the real error, and the temporary's name passed 255 bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from planner.cli import main as plan_main
from runtime.train.cli import main as train_main
from tests.reliability.helpers import (
    PLAN_FLAGS,
    SAMPLE,
    TRAIN_FLAGS,
    no_traceback,
    pool1_plan,
    run_cli,
    stderr_of,
    write_token_jsonl,
)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return Path(shutil.copy(SAMPLE, tmp_path / "ds.jsonl"))


def _plan(data: Path, out: Path, *extra: str) -> int:
    return plan_main([str(data), "-o", str(out), *PLAN_FLAGS, *extra])


def test_summary_json_never_replaces_an_input_the_plan_or_another_file(
        data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _sha(data)
    out = tmp_path / "out.arrow"
    # the dataset, the plan this run writes: refused before anything is read (no plan made)
    assert _plan(data, out, "--summary-json", str(data)) == 2
    assert f"{data}: the output is the input {data}" in stderr_of(capsys)
    assert _plan(data, out, "--summary-json", str(out)) == 2
    assert "is also this run's -o/--output output" in stderr_of(capsys)
    assert not out.exists()
    assert _sha(data) == before
    # an existing plan, a user's notes: refused; an earlier summary: replaced
    assert _plan(data, out) == 0
    other = tmp_path / "other.arrow"
    shutil.copy(out, other)
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    for target, why in ((other, "is not a JSON summary"), (notes, "is not a JSON summary")):
        kept = _sha(target)
        assert _plan(data, tmp_path / "p2.arrow", "--summary-json", str(target)) == 2
        assert f"{target}: exists and {why}; refusing to overwrite it" in stderr_of(capsys)
        assert _sha(target) == kept
    summary = tmp_path / "s.json"
    assert _plan(data, tmp_path / "p2.arrow", "--summary-json", str(summary)) == 0
    assert _plan(data, tmp_path / "p2.arrow", "--summary-json", str(summary), "--seed", "3") == 0
    assert json.loads(summary.read_text())["seed"] == 3


@pytest.fixture
def specials(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A FIFO, a character device node (root: a copy of /dev/full's numbers, made here), a
    symlink to the FIFO and a symlink loop."""
    d = tmp_path / "special"
    d.mkdir()
    out = {"fifo": d / "fifo.json"}
    os.mkfifo(out["fifo"])
    try:
        os.mknod(d / "full.json", stat.S_IFCHR | 0o666, os.makedev(1, 7))
        out["device"] = d / "full.json"
    except (PermissionError, OSError):
        pass
    os.symlink(out["fifo"], d / "to-fifo.json")
    out["symlink to a FIFO"] = d / "to-fifo.json"
    os.symlink(d / "loop-b.json", d / "loop-a.json")
    os.symlink(d / "loop-a.json", d / "loop-b.json")
    out["loop"] = d / "loop-a.json"
    return out


def _still_special(p: Path, name: str) -> bool:
    if name == "loop":
        return p.is_symlink()
    mode = os.stat(p).st_mode
    return stat.S_ISFIFO(mode) if "FIFO" in name or name == "fifo" else stat.S_ISCHR(mode)


def test_special_files_are_never_written_or_replaced(
        data: Path, tmp_path: Path, specials: dict[str, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    for name, target in specials.items():
        why = "a symlink loop" if name == "loop" else "not a regular file"
        # as a summary, and as the plan with --overwrite (which replaced FIFOs and devices)
        assert _plan(data, tmp_path / "p.arrow", "--summary-json", str(target)) == 2, name
        assert why in stderr_of(capsys), name
        assert _plan(data, target, "--overwrite") == 2, name
        assert why in stderr_of(capsys), name
        assert _still_special(target, name), name
    assert not (tmp_path / "p.arrow").exists()


def test_fifo_as_output_or_input_does_not_hang(data: Path, specials: dict[str, Path]) -> None:
    """Before: ``-o FIFO`` blocked forever opening it (the plan check read it)."""
    fifo = specials["fifo"]
    r = run_cli(str(data), "-o", str(fifo), *PLAN_FLAGS, timeout=60)
    assert r.returncode == 2
    assert "is a FIFO (named pipe), not a regular file" in r.stderr
    assert no_traceback(r.stderr)
    r = run_cli("validate", str(fifo), timeout=60)
    assert r.returncode == 2
    assert "is a FIFO (named pipe), not a regular file" in r.stderr


def test_symlink_loop_as_input_is_named(specials: dict[str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    loop = specials["loop"]
    assert plan_main([str(loop), "-o", str(tmp_path / "p.arrow"), *PLAN_FLAGS]) == 2
    err = stderr_of(capsys)
    assert f"{loop}: a symlink loop" in err


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_read_only_directory_is_named_before_the_work(
        data: Path, tmp_path: Path, read_only: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the temporary file's name and, from a ``finally: unlink``, another error."""
    out = read_only / "p.arrow"
    assert _plan(data, out) == 2
    err = stderr_of(capsys)
    assert f"{out}: cannot write in {read_only}: Read-only file system (EROFS)" in err
    assert ".tmp-" not in err
    assert ".spill-" not in err
    # a summary there is refused before the plan is made (the plan would be the lost work)
    plan = tmp_path / "p.arrow"
    assert _plan(data, plan, "--summary-json", str(read_only / "s.json")) == 2
    assert "Read-only file system (EROFS)" in stderr_of(capsys)
    assert not plan.exists()


def test_long_names(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """250 bytes is a legal name: the plan is written (its temporaries were 270 bytes); 300 is
    refused before the work, naming the limit."""
    out = tmp_path / ("p" * 244 + ".arrow")
    assert _plan(data, out, "--summary-json", str(tmp_path / ("s" * 245 + ".json"))) == 0
    assert out.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ds.jsonl", out.name, "s" * 245 + ".json"])
    too_long = tmp_path / ("q" * 294 + ".arrow")
    assert _plan(data, too_long) == 2
    assert "is 300 bytes, more than the 255 this file system allows" in stderr_of(capsys)
    # the temporary names stay within 255 bytes, and stale ones are still found
    from planner.fileguard import remove_stale_temps, temp_path

    for name in ("a.arrow", "p" * 250, "é" * 127):
        tmp = temp_path(tmp_path / name, "spill", pid=4194304)
        assert len(os.fsencode(tmp.name)) <= 255
        tmp.write_bytes(b"left by a killed writer")
        assert remove_stale_temps(tmp_path / name) == [tmp]


def test_full_disk_names_the_summary_and_leaves_nothing(
        data: Path, tmp_path: Path, small_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    filler = small_disk / "filler"
    with open(filler, "wb") as f, pytest.raises(OSError, match="No space left"):
        f.write(b"x" * (1 << 20))
    summary = small_disk / "s.json"
    assert _plan(data, tmp_path / "p.arrow", "--summary-json", str(summary)) == 2
    err = stderr_of(capsys)
    assert f"{summary}: cannot write the summary: No space left on device (ENOSPC)" in err
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("outputs")
    data = write_token_jsonl(d / "data.jsonl")
    return {"dir": d, "data": data, "plan": pool1_plan(plan_main, data, d / "plan.arrow")}


def _train(run: dict[str, Path], *extra: str) -> int:
    return train_main(["--plan", str(run["plan"]), "--dataset", str(run["data"]), *TRAIN_FLAGS,
                       "--steps", "1", *extra])


def test_train_outputs_are_checked_before_the_first_step(
        run: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    data, plan = run["data"], run["plan"]
    kept = {p: _sha(p) for p in (data, plan)}
    for flag, target, why in (("--log-jsonl", data, "the output is the input"),
                              ("--summary-json", data, "the output is the input"),
                              ("--summary-json", plan, "the output is the input"),
                              ("--save", plan, "is the input")):
        assert _train(run, flag, str(target)) == 2, (flag, target)
        err = stderr_of(capsys)
        assert why in err, (flag, target)
        assert '"step"' not in capsys.readouterr().out
    assert {p: _sha(p) for p in kept} == kept
    log = run["dir"] / "log.jsonl"
    assert _train(run, "--log-jsonl", str(log), "--summary-json", str(log)) == 2
    assert "is also this run's --log-jsonl output" in stderr_of(capsys)
    notes = run["dir"] / "notes.txt"
    notes.write_text("a line\n")
    assert _train(run, "--log-jsonl", str(notes)) == 2
    assert "is not a dcp-train JSON-lines log" in stderr_of(capsys)
    assert notes.read_text() == "a line\n"


def test_log_appends_only_to_a_log(run: dict[str, Path]) -> None:
    log = run["dir"] / "append.jsonl"
    assert _train(run, "--log-jsonl", str(log)) == 0
    with open(log, "a") as f:
        f.write('{"step": 1, "loss": 2.0, "microbat')  # a killed writer's torn line
    assert _train(run, "--log-jsonl", str(log)) == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 3
    assert json.loads(lines[2])["step"] == 0
    empty = run["dir"] / "empty.jsonl"
    empty.touch()
    assert _train(run, "--log-jsonl", str(empty)) == 0
    assert json.loads(empty.read_text())["step"] == 0


def test_calibrate_refuses_outputs_before_measuring(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.calibrate.cli import main as calibrate_main

    notes = tmp_path / "cm.json"
    notes.write_text("[1, 2]\n")
    args = ["--quick", "--device", "cpu", "--attention", "reference", "--max-tokens", "64",
            "--min-length", "16", "--max-length", "32"]
    assert calibrate_main(["-o", str(notes), *args]) == 2
    assert f"{notes}: exists and is not a JSON cost model" in stderr_of(capsys)
    assert calibrate_main(["-o", str(tmp_path / "new.json"), "--summary-json",
                           str(tmp_path / "new.json"), *args]) == 2
    assert "is also this run's -o/--output output" in stderr_of(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cm.json"]


def test_library_guard_kinds(tmp_path: Path) -> None:
    from planner.fileguard import check_output

    png = tmp_path / "fig.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n....")
    assert check_output(png, kind="figure") == png
    html = tmp_path / "r.html"
    html.write_text("<!DOCTYPE html><html></html>")
    assert check_output(html, kind="report") == html
    with pytest.raises(ValueError, match="is not an HTML report"):
        check_output(png, kind="report")
    with pytest.raises(ValueError, match="is not a figure"):
        check_output(html, kind="figure")


@pytest.mark.parametrize("argv", [
    ["plan", "DATA", "--dp", "4", "--cp-size", "2", "--max-tokens-per-rank", "4096",
     "--global-batch-size", "64"],
    ["plan", "DATA", "--dp", "4", "--max-tokens", "4096", "--global-batch-size", "64"],
    ["validate", "PLAN", "--skip-bad"],
    ["show", "PLAN", "--ste", "0:2"],
])
def test_abbreviated_flags_are_unknown_flags(argv: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Before: argparse took a unique prefix: ``--cp-size 2`` was ``--cp-sizes 2`` (a valid,
    wrong plan: dp 4 x cp 1 with groups of 2 only, exit 0)."""
    out = tmp_path / "p.arrow"
    argv = [str(SAMPLE) if a == "DATA" else str(out) if a == "PLAN" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        plan_main([*argv, "-o", str(out)] if argv[0] == "plan" else argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    bad = next(a for a in argv if a.startswith("--") and a not in (
        "--dp", "--max-tokens-per-rank", "--global-batch-size"))
    assert f"unknown flag: {bad}" in err
    assert not out.exists()


def test_abbreviated_flags_of_train_and_calibrate(capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.calibrate.cli import parse_args as calibrate_args
    from runtime.train.cli import parse_args as train_args

    with pytest.raises(SystemExit):
        train_args(["--plan", "p", "--dataset", "d", "--save-ev", "2"])
    assert "unknown flag: --save-ev (did you mean --save-every" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrate_args(["-o", "x.json", "--max-tok", "64"])
    assert "unknown flag: --max-tok (did you mean --max-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_args(["--plan", "p", "--dataset", "d", "--seed", str(2**64)])
    assert "expected a seed in 0..2^64-1" in capsys.readouterr().err


def test_full_disk_under_the_index_cache_is_not_a_failed_run(tmp_path: Path) -> None:
    """Before: the runtime's ``.dcpidx`` cache write raised ENOSPC out of ``open_token_source``
    (the run failed on a cache); now the index lives in memory, with a warning."""
    from runtime.data.token_jsonl import JsonlTokens

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs (a real full disk)")
    try:
        data = write_token_jsonl(mnt / "d.jsonl", num_samples=40)
        with open(mnt / "filler", "wb") as f, pytest.raises(OSError, match="No space left"):
            f.write(b"x" * (1 << 20))
        with pytest.warns(UserWarning, match="cannot write the index cache"):
            src = JsonlTokens(data)
        try:
            assert src.num_samples == 40
        finally:
            src.close()
        assert sorted(p.name for p in mnt.iterdir()) == ["d.jsonl", "filler"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
