"""Bad input and degenerate settings: a message naming the file (and line or sample), never a
traceback, never a huge allocation, never a silently degenerate plan.

Before: ``{"length": 1099511627776}`` with ``--long-sequences split`` allocated 22 GB and was
OOM-killed; a corrupt ``.dcpidx`` raised ``BadZipFile`` on every later run; a Megatron ``.bin``
truncated after planning raised ``IndexError``; a token id above int64 raised ``OverflowError``;
corrupt Parquet pages and a truncated Arrow stream said ``Corrupt snappy compressed data.`` with no
file; a cost-model JSON with a string where a number belongs named no file; ``--max-tokens-per-rank
3 --cp 2 --long-sequences split`` planned 415 microbatches per step; ``--drop-last`` with a global
batch larger than the dataset wrote a 0-step plan that ``dcp-train`` "trained" with exit 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from planner.cli import main
from planner.sources.lengths import write_megatron_dataset
from runtime.data.tokens import open_token_source
from tests.reliability.helpers import (
    PLAN_FLAGS,
    ROOT,
    SAMPLE,
    stderr_of,
    write_token_jsonl,
)

SPLIT = ["--dp", "1", "--cp", "2", "--max-tokens-per-rank", "64", "--global-batch-size", "2",
         "--long-sequences", "split", "--quiet"]
HUGE = 1099511627776  # 2^40 tokens


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet", "arrow"])
def test_absurd_length_is_named_before_any_allocation(
        tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / f"d.{fmt}"
    values = [5, HUGE, 7]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"length": v}) + "\n" for v in values))
        where = f"{path}:2: 'length' is {HUGE}, more than the 2147483647 tokens"
    elif fmt == "txt":
        path.write_text("".join(f"{v}\n" for v in values))
        where = f"{path}:2: length {HUGE} is more than the 2147483647 tokens"
    else:
        table = pa.table({"length": pa.array(values, pa.int64())})
        if fmt == "parquet":
            pq.write_table(table, path)
        else:
            with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
        where = f"{path}: row 1: 'length' is {HUGE}, more than the 2147483647 tokens"
    assert main([str(path), "-o", str(tmp_path / "p.arrow"), *SPLIT]) == 2
    assert where in stderr_of(capsys)
    # --skip-bad-records skips it like any other bad record
    assert main([str(path), "-o", str(tmp_path / "p.arrow"), *SPLIT, "--skip-bad-records"]) == 0


def test_absurd_length_in_a_memory_capped_process(tmp_path: Path) -> None:
    """The original case end to end, under a 2 GB address-space cap: a clean error, not OOM."""
    path = tmp_path / "big.jsonl"
    path.write_text('{"length": 5}\n{"length": 1099511627776}\n')
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30));"
            "from planner.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, str(path), "-o", str(tmp_path / "p.arrow"),
                        *SPLIT], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert f"{path}:2:" in r.stderr


def test_split_into_too_many_microbatches_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "long.txt"
    path.write_text("100\n2000000\n")  # 2M tokens in segments of 128: 15,625 microbatches
    assert main([str(path), "-o", str(tmp_path / "p.arrow"), *SPLIT]) == 2
    err = stderr_of(capsys)
    assert f"{path}: sample 1 has 2000000 tokens" in err
    assert "15625 microbatches in one step (at most 4096)" in err


def test_capacity_below_the_padding_multiple_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "p.arrow")
    assert main([str(SAMPLE), "-o", out, "--dp", "1", "--cp", "2", "--max-tokens-per-rank", "3",
                 "--global-batch-size", "64", "--long-sequences", "split", "--quiet"]) == 2
    assert ("max tokens per rank 3 is below the padding multiple 4 of group size 2"
            in stderr_of(capsys))
    # limiting the group sizes makes the same capacity legal
    assert main([str(SAMPLE), "-o", out, "--dp", "1", "--cp", "2", "--max-tokens-per-rank", "3",
                 "--global-batch-size", "64", "--long-sequences", "truncate", "--cp-sizes", "1",
                 "--quiet"]) == 0


def test_zero_step_plan_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(SAMPLE), "-o", str(tmp_path / "p.arrow"), "--dp", "2", "--cp", "2",
                 "--max-tokens-per-rank", "8192", "--global-batch-size", "5000", "--drop-last",
                 "--long-sequences", "split"]) == 2
    err = stderr_of(capsys)
    assert "the plan would have no steps: 2000 plannable samples" in err
    assert not (tmp_path / "p.arrow").exists()


def test_corrupt_dcpidx_cache_is_rebuilt(tmp_path: Path) -> None:
    data = write_token_jsonl(tmp_path / "d.jsonl")
    first = open_token_source(data)
    want = [first.read(i, 0, int(n)).tolist() for i, n in enumerate(first.lengths())]
    cache = tmp_path / "d.jsonl.dcpidx"
    assert cache.is_file()
    good = cache.read_bytes()
    mid = len(good) // 2
    damaged = {
        "garbage": b"not a zip at all",
        "truncated": good[: len(good) // 2],
        "empty": b"",
        # a flip in the arrays' bytes: zipfile's CRC-32 check refuses the member
        "flipped": good[:mid] + bytes([good[mid] ^ 0xFF]) + good[mid + 1:],
    }
    for name, content in damaged.items():
        cache.write_bytes(content)
        src = open_token_source(data)
        assert src.index_built, name  # rebuilt, not fatal
        assert [src.read(i, 0, int(n)).tolist() for i, n in enumerate(src.lengths())] == want
        assert cache.read_bytes() == good, name  # and the cache repaired for the next run
    # a cache of the right shape but wrong arrays (a foreign writer) is rebuilt too
    key = str(np.load(cache)["key"])
    with open(cache, "wb") as f:
        np.savez(f, key=np.array(key), offsets=np.zeros(3), nbytes=np.zeros(3),
                 lengths=np.zeros(3))
    assert open_token_source(data).index_built


def test_megatron_bin_truncated_after_planning(tmp_path: Path) -> None:
    prefix = tmp_path / "ds"
    write_megatron_dataset(prefix, [np.arange(100) % 50] * 20, dtype=np.uint16)
    open_token_source(prefix)  # fine
    bin_path = tmp_path / "ds.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-301])
    with pytest.raises(ValueError, match=r"ds\.bin: holds 3699 bytes, its index addresses 4000 "
                                         r"\(document 18 and later"):
        open_token_source(prefix)


def test_token_id_above_int64_names_the_sample(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 99999999999999999999, 6]}\n')
    src = open_token_source(path)
    with pytest.raises(ValueError, match=r"big\.jsonl: record of sample 1 .* not an int64 token"):
        src.read(1, 0, 3)


def _corrupt_parquet(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(50, 400, 400)]
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"input_ids": seqs}), good, compression="snappy",
                   row_group_size=100)
    b = bytearray(good.read_bytes())
    for i in range(2000, 2400):
        b[i] ^= 0x5A
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(b))
    return bad


def _truncated_stream(tmp_path: Path) -> Path:
    table = pa.table({"input_ids": [[1, 2, 3] * 50] * 400})
    path = tmp_path / "s.arrow"
    with pa.OSFile(str(path), "wb") as f, ipc.new_stream(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=100):
            w.write_batch(batch)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


@pytest.mark.parametrize("make", [_corrupt_parquet, _truncated_stream])
def test_corrupt_columnar_files_are_named(tmp_path: Path, make: object,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    bad = make(tmp_path)  # type: ignore[operator]
    assert main([str(bad), "-o", str(tmp_path / "p.arrow"), *PLAN_FLAGS]) == 2
    assert f"{bad}: unreadable" in stderr_of(capsys)
    with pytest.raises(ValueError, match=f"{bad}: .*unreadable"):
        open_token_source(bad).lengths()


def test_cost_model_with_a_string_names_file_and_parameter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preset = json.loads((ROOT / "planner" / "presets" / "small-2048-h200.json").read_text())
    preset["parameters"]["linear_s_per_token"] = "9.4e-06"
    cm = tmp_path / "cm.json"
    cm.write_text(json.dumps(preset))
    assert main([str(SAMPLE), "-o", str(tmp_path / "p.arrow"), *PLAN_FLAGS,
                 "--cost-model", str(cm)]) == 2
    assert (f"{cm}: cost-model parameter linear_s_per_token must be a finite number >= 0, got "
            "'9.4e-06'") in stderr_of(capsys)


def test_full_disk_names_the_plan_and_leaves_nothing(
        small_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = small_disk / "p.arrow"
    assert main([str(SAMPLE), "-o", str(out), *PLAN_FLAGS]) == 2
    err = stderr_of(capsys)
    assert f"{out}: cannot write the plan:" in err
    assert "No space left on device" in err
    assert list(small_disk.iterdir()) == []


def _shown_steps(out: str) -> list[int]:
    return [json.loads(line)["step"] for line in out.splitlines()]


def test_show_steps_are_python_slices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--steps=-3:`` was refused (an ``IndexError`` traceback before that); it is the last
    three steps, as Python slices a list. Other malformed values still get a clear message (a
    bare number too: test_newcomer.py)."""
    plan = tmp_path / "p.arrow"
    assert main([str(SAMPLE), "-o", str(plan), "--dp", "4", "--cp", "2",
                 "--max-tokens-per-rank", "4096", "--global-batch-size", "64", "--quiet"]) == 0
    capsys.readouterr()
    n = 32  # 2000 samples / 64 a step
    every = list(range(n))
    for given, want in [("-3:", every[-3:]), ("5:8", every[5:8]), (":2", every[:2]),
                        ("-5:-2", every[-5:-2]), ("30:99", every[30:99]), ("-1:", [n - 1]),
                        ("-2:-1", [n - 2]), ("7:8", [7]), ("-99:2", every[-99:2])]:
        for argv in (["--steps=" + given], ["--steps", given]):
            assert main(["show", str(plan), *argv, "--json"]) == 0, given
            assert _shown_steps(capsys.readouterr().out) == want, given
    assert main(["show", str(plan), "--steps=-3:"]) == 0  # the table, not only --json
    out = capsys.readouterr().out
    assert [int(line.split()[0]) for line in out.splitlines()[1:]
            if not line.startswith(("gain: ", "cost: ", "warning: "))] == every[-3:]
    for argv, message in [
            (["--steps", "40:50"], "--steps 40:50 selects no step; the plan has 32 steps "
             "(0..31, or -32..-1 from the end)"),
            (["--steps", "5:3"], "--steps 5:3 selects no step"),
            (["--step", "999"], "--step 999 is out of range; the plan has 32 steps (0..31, or "
             "-32..-1 from the end)"),
            (["--step", "-33"], "--step -33 is out of range")]:
        assert main(["show", str(plan), *argv]) == 2, argv
        assert message in stderr_of(capsys), argv
    for bad in ("abc", "1:2:3", "::", "a:", "--3"):
        with pytest.raises(SystemExit) as exc:
            main(["show", str(plan), f"--steps={bad}"])
        assert exc.value.code == 2
        err = stderr_of(capsys)
        assert "argument --steps: expected a step range A:B" in err, bad
    assert main(["show", str(plan), "--step=-1", "--json"]) == 0
    assert {json.loads(x)["step"] for x in capsys.readouterr().out.splitlines()} == {n - 1}
