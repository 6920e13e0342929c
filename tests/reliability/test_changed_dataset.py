"""A changed dataset never trains (issue 32, item 1).

Before: the runtime's ``.dcpidx`` index cache was keyed on the file's size and mtime only. A
same-size edit copied over the file with ``cp -p`` (every sample 2 -> 3 tokens) trained with
rc 0 on the stale lengths, even under ``--fingerprint content`` (whose hash read the stale
2-token prefix of each record); two same-size, same-mtime shards swapped with ``mv`` failed
with ``record of sample 0 does not decode``. Now the cache is keyed on the device, inode,
ctime, mtime and size, and a record whose token count differs from its index is refused as a
changed file, named.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from planner.cli import main as plan_main
from runtime.train.cli import main as train_main
from tests.reliability.helpers import TRAIN_FLAGS, stderr_of

PLAN = ["--dp", "1", "--cp", "1", "--max-tokens-per-rank", "256", "--global-batch-size", "6",
        "--quiet"]
TWO = '{"input_ids": [1, 2]}\n'  # 21 bytes, 2 tokens
THREE = '{"input_ids":[1,2,3]}\n'  # 21 bytes, 3 tokens


def _train(plan: Path, data: Path, *extra: str) -> int:
    return train_main(["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS, "--steps",
                       "1", *extra])


@pytest.mark.parametrize("fingerprint", ["lengths", "content"])
@pytest.mark.parametrize("how", ["cp -p", "touch -r", "mv"])
def test_a_same_size_edit_is_not_hidden_by_the_index_cache(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, fingerprint: str) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(TWO * 24)
    plan = tmp_path / "p.arrow"
    assert plan_main([str(data), "-o", str(plan), *PLAN, "--fingerprint", fingerprint]) == 0
    assert _train(plan, data) == 0  # builds d.jsonl.dcpidx
    assert Path(str(data) + ".dcpidx").is_file()
    capsys.readouterr()
    edited = tmp_path / "edited.jsonl"
    edited.write_text(THREE * 24)
    assert edited.stat().st_size == data.stat().st_size
    old = data.stat()
    os.utime(edited, ns=(old.st_atime_ns, old.st_mtime_ns))  # the same size and mtime
    if how == "cp -p":  # copied over the file in place (the same inode)
        subprocess.run(["cp", "-p", str(edited), str(data)], check=True)
    elif how == "touch -r":  # replaced, then its old mtime put back
        ref = tmp_path / "ref"
        shutil.copy2(data, ref)
        edited.replace(data)
        subprocess.run(["touch", "-r", str(ref), str(data)], check=True)
    else:  # mv: another inode
        edited.replace(data)
    now = data.stat()
    assert (now.st_size, now.st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert _train(plan, data) == 2
    err = stderr_of(capsys)
    print(err)
    assert f"the dataset changed since planning: {data}" in err


def test_swapped_shards_say_the_dataset_changed(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Two same-size, same-mtime shards swapped with ``mv``."""
    d = tmp_path / "ds"
    d.mkdir()
    a, b = d / "a.jsonl", d / "b.jsonl"
    a.write_text(TWO * 12)
    b.write_text(THREE * 12)
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    plan = tmp_path / "p.arrow"
    assert plan_main([str(d), "-o", str(plan), *PLAN]) == 0
    assert _train(plan, d) == 0  # builds both caches
    capsys.readouterr()
    a.rename(d / "t")
    b.rename(a)
    (d / "t").rename(b)
    assert _train(plan, d) == 2
    err = stderr_of(capsys)
    assert "does not decode" not in err
    print(err)
    assert f"the dataset changed since planning: {a} (other sample lengths than planned), {b}" \
        in err


def test_a_record_that_disagrees_with_its_index_is_a_changed_file(tmp_path: Path) -> None:
    """A file edited in place while a source has it open (or on a file system whose ctimes
    do not move): the read compares the record's token count with the index's, so the stale
    index never reads a prefix of other tokens (the content hash reads through it too)."""
    from runtime.data.token_jsonl import JsonlTokens

    data = tmp_path / "d.jsonl"
    data.write_text(TWO * 4)
    source = JsonlTokens(data)
    try:
        assert source.read(1, 0, 2).tolist() == [1, 2]
        with open(data, "r+b") as f:
            f.write((THREE * 4).encode())
        with pytest.raises(ValueError, match=f"{data}: the file changed while it was read"):
            source.read(1, 0, 2)
    finally:
        source.close()
    stale = JsonlTokens(data)
    try:  # the index rebuilt from the file as it is now: 3 tokens a record
        assert stale.index_built
        assert stale.read(1, 0, 3).tolist() == [1, 2, 3]
    finally:
        stale.close()


def test_a_stored_path_is_a_file_never_a_pattern(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``star[1].jsonl`` planned, moved away, ``star1.jsonl`` (what the name matches as a glob)
    present: ``dcp-train`` without ``--dataset`` reads the plan's file, which is missing."""
    star = tmp_path / "star[1].jsonl"
    star.write_text(TWO * 24)
    plan = tmp_path / "p.arrow"
    assert plan_main([str(star), "-o", str(plan), *PLAN]) == 0
    (tmp_path / "star1.jsonl").write_text(TWO * 24)
    star.rename(tmp_path / "away.jsonl")
    assert train_main(["--plan", str(plan), *TRAIN_FLAGS, "--steps", "1"]) == 2
    err = stderr_of(capsys)
    assert f"{star}: no such file" in err
    assert "star1.jsonl" not in err
    (tmp_path / "away.jsonl").rename(star)  # back: it trains from the stored name
    assert train_main(["--plan", str(plan), *TRAIN_FLAGS, "--steps", "1"]) == 0


def test_one_dataset_named_twice_is_refused(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``dcp-plan m.idx m.bin``, ``m m.idx`` and a hard link were counted twice (rc 0)."""
    from planner.sources.lengths import write_megatron_dataset

    write_megatron_dataset(tmp_path / "m", [[1, 2, 3]] * 8)
    data = tmp_path / "d.jsonl"
    data.write_text(TWO * 8)
    os.link(data, tmp_path / "hard.jsonl")
    for pair in (("m.idx", "m.bin"), ("m", "m.idx"), ("m.bin", "m"),
                 ("d.jsonl", "hard.jsonl")):
        argv = [str(tmp_path / pair[0]), str(tmp_path / pair[1]), "-o",
                str(tmp_path / "p.arrow"), *PLAN]
        assert plan_main(argv) == 2, pair
        err = stderr_of(capsys)
        assert f"{tmp_path / pair[1]}: the same file is given twice" in err, err
