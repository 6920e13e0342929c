"""Fingerprints: the default lengths fingerprint, and ``dcp-plan --fingerprint content``.

Before: a dataset whose tokens were edited but whose lengths did not change trained silently on
other data (the fingerprint covers lengths only). Now ``--fingerprint content`` records a sha256
of every token per file; ``dcp-train`` (every framework, and each one's ``--reference``) and
``dcp-plan validate PLAN DATASET`` refuse a dataset whose tokens changed, naming the file.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import zstandard

import planner.sources.content as content
import runtime.data.plan_source as plan_source
from planner.cli import main as plan_main
from planner.planfile.io import PlanFile
from planner.sources.lengths import write_megatron_dataset
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.train.cli import main as train_main
from tests.dist import run_distributed
from tests.reliability.helpers import (
    TRAIN_FLAGS,
    no_traceback,
    pool1_plan,
    write_token_jsonl,
)

FORMATS = ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "stream.arrow", "megatron"]
PLAN = ["--dp", "1", "--cp", "1", "--max-tokens-per-rank", "512", "--global-batch-size", "16",
        "--quiet", "--skip-bad-records"]


def _seqs(edit: bool = False) -> list[list[int]]:
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 50_000, size=int(n)).tolist() for n in rng.integers(1, 300, 120)]
    seqs[7] = []  # a bad record (empty): skipped, length 0
    if edit:
        seqs[50][3] = (seqs[50][3] + 1) % 50_000  # same lengths, one other token
    return seqs


def _write(fmt: str, d: Path, seqs: list[list[int]]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    lines = b"".join(json.dumps({"input_ids": s}).encode() + b"\n" for s in seqs)
    table = pa.table({"input_ids": pa.array(seqs, pa.list_(pa.int32()))})
    if fmt == "jsonl":
        (path := d / "d.jsonl").write_bytes(lines)
    elif fmt == "jsonl.gz":
        (path := d / "d.jsonl.gz").write_bytes(gzip.compress(lines))
    elif fmt == "jsonl.zst":
        (path := d / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    elif fmt == "parquet":
        pq.write_table(table, path := d / "d.parquet", row_group_size=32)
    elif fmt in ("arrow", "stream.arrow"):
        path = d / f"d.{fmt}"
        with pa.OSFile(str(path), "wb") as sink:
            new = ipc.new_file if fmt == "arrow" else ipc.new_stream
            with new(sink, table.schema) as w:
                w.write_table(table, max_chunksize=40)
    else:
        write_megatron_dataset(d / "m", seqs, dtype=np.uint16)
        path = d / "m"
    return path


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of ~500 tokens, read 200 at a time: a 17K-token file spans many of both."""
    monkeypatch.setattr(content, "BLOCK_TOKENS", 500)
    monkeypatch.setattr(content, "CHUNK_TOKENS", 200)
    monkeypatch.setattr(plan_source, "CHUNK_TOKENS", 200)


@pytest.mark.usefixtures("small_blocks")
def test_planner_and_runtime_agree_on_every_format(tmp_path: Path) -> None:
    digests = set()
    for fmt in FORMATS:
        path = _write(fmt, tmp_path / fmt, _seqs())
        plan = tmp_path / f"{fmt}.arrow"
        assert plan_main([str(path), "-o", str(plan), *PLAN, "--fingerprint", "content"]) == 0
        with PlanReader(plan) as reader:
            (f,) = reader.header.dataset.files
            digests.add(f["content_fingerprint"])
            open_plan_source(reader, str(path))  # the runtime's readers hash the same
            edited = _write(fmt, tmp_path / f"{fmt}-edited", _seqs(edit=True))
            with pytest.raises(ValueError, match=r"the tokens of .*(d\.|/m ).* changed since "
                                                 r"planning \(the lengths did not\)"):
                open_plan_source(reader, str(edited))
    assert len(digests) == 1  # the same tokens in seven containers: one fingerprint


def test_blocks_are_cut_from_the_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(content, "BLOCK_TOKENS", 10)
    # tokens before each sample: 0, 4, 4 (empty), 9, 15, 40 -> blocks 0, 0, -, 0, 1, 4
    assert content.block_starts(np.array([4, 0, 5, 6, 25, 3])).tolist() == [0, 4, 5, 6]
    h = content.StreamHasher(np.array([4, 0, 5, 6, 25, 3]))
    for piece in np.array_split(np.arange(43), 7):  # pieces cut anywhere
        h.update(piece)
    assert len(h.blocks) == 3
    with pytest.raises(ValueError, match="holds 0 tokens, its lengths say 43"):
        content.StreamHasher(np.array([4, 0, 5, 6, 25, 3])).hexdigest("f")


def _multi(tmp_path: Path, edit: bool) -> list[str]:
    seqs = _seqs(edit)
    d = tmp_path / ("edited" if edit else "orig")
    a = _write("jsonl", d / "a", seqs[:60])
    b = _write("megatron", d / "b", seqs[60:])
    return [str(a), str(b)]


def _verify_on_ranks(rank: int, world: int, store: str, plan: str, paths: list[str]) -> str:
    content.BLOCK_TOKENS = 500  # forkserver children: the small blocks here too
    with PlanReader(plan) as reader:
        try:
            open_plan_source(reader, paths)
        except ValueError as e:
            return str(e)
    return ""


@pytest.mark.dist
@pytest.mark.usefixtures("small_blocks")
def test_ranks_share_the_hashing_and_agree(tmp_path: Path) -> None:
    """Two gloo ranks hash alternate blocks and reach the same verdict, naming the same file;
    the blend (a jsonl and a Megatron file) is checked file by file."""
    good, bad = _multi(tmp_path, False), _multi(tmp_path, True)
    plan = tmp_path / "p.arrow"
    assert plan_main(["--data-path", "0.5", good[0], "0.5", good[1], "-o", str(plan), *PLAN,
                      "--fingerprint", "content"]) == 0
    with PlanFile(plan) as f:
        assert len(f.header.dataset.files) == 2
        assert all(x["content_fingerprint"] for x in f.header.dataset.files)
    assert run_distributed(_verify_on_ranks, 2, str(plan), good) == ["", ""]
    got = run_distributed(_verify_on_ranks, 2, str(plan), bad)
    assert got[0] == got[1]
    assert f"the tokens of {bad[0]} (content fingerprint" in got[0]  # sample 50: file a
    assert bad[1] not in got[0]


def test_dcp_train_and_validate_refuse_edited_tokens(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data = write_token_jsonl(tmp_path / "d.jsonl")
    lengths_plan = pool1_plan(plan_main, data, tmp_path / "lengths.arrow")
    content_plan = pool1_plan(plan_main, data, tmp_path / "content.arrow",
                              "--fingerprint", "content")
    with PlanFile(lengths_plan) as f:
        assert "content_fingerprint" not in f.header.to_json()  # default plans keep their bytes
        assert all("content_fingerprint" not in x for x in f.header.dataset.files)
    common = [*TRAIN_FLAGS, "--dataset", str(data), "--steps", "1"]
    assert train_main(["--plan", str(content_plan), *common]) == 0
    assert plan_main(["validate", str(content_plan), str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["content_checked"] is True
    lines = data.read_text().splitlines()
    rec = json.loads(lines[2])
    rec["input_ids"][0] = (rec["input_ids"][0] + 1) % 64
    lines[2] = json.dumps(rec)
    data.write_text("\n".join(lines) + "\n")
    # What the lengths fingerprint cannot see: this run trains on other data, exit 0.
    assert train_main(["--plan", str(lengths_plan), *common]) == 0
    assert plan_main(["validate", str(lengths_plan), str(data)]) == 0
    capsys.readouterr()
    for extra in ([], ["--reference"]):
        assert train_main(["--plan", str(content_plan), *common, *extra]) == 2
        err = capsys.readouterr().err
        assert f"the tokens of {data} (content fingerprint" in err
        assert no_traceback(err)
    assert plan_main(["validate", str(content_plan), str(data)]) == 2
    err = capsys.readouterr().err
    assert f"{data}: its tokens changed since {content_plan} was planned" in err
    assert no_traceback(err)


def test_content_fingerprint_needs_tokens(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "l.txt"
    path.write_text("5\n7\n")
    assert plan_main([str(path), "-o", str(tmp_path / "p.arrow"), "--dp", "1",
                      "--max-tokens-per-rank", "64", "--global-batch-size", "2", "--quiet",
                      "--fingerprint", "content"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: --fingerprint content needs token data; a text file holds lengths" in err
    assert not (tmp_path / "p.arrow").exists()


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_framework_adapters_refuse_edited_tokens(tmp_path: Path, framework: str) -> None:
    """``dcp-train --framework megatron|torchtitan`` (and each ``--reference``) read the dataset
    through the same check: edited tokens stop them before the first step, naming the file."""
    pytest.importorskip("megatron.core" if framework == "megatron" else "torchtitan")
    data = write_token_jsonl(tmp_path / "d.jsonl")
    plan = pool1_plan(plan_main, data, tmp_path / "content.arrow", "--fingerprint", "content")
    rec = json.loads(data.read_text().splitlines()[5])
    rec["input_ids"][-1] = (rec["input_ids"][-1] + 7) % 64
    lines = data.read_text().splitlines()
    lines[5] = json.dumps(rec)
    data.write_text("\n".join(lines) + "\n")
    for extra in ([], ["--reference"]):
        # dcp-train in a fresh process of its own (tests.dist's, whose server has imported the
        # frameworks once), as a user's launch would run it.
        ((code, err),) = run_distributed(
            _train_cli, 1, ["--framework", framework, "--plan", str(plan), "--dataset",
                            str(data), *TRAIN_FLAGS, "--steps", "1", *extra],
            backend=None, timeout=300)
        assert code == 2, err[-2000:]
        assert f"the tokens of {data} (content fingerprint" in err
        assert no_traceback(err)


def _train_cli(rank: int, world_size: int, store: str, argv: list[str]) -> tuple[int, str]:
    """``dcp-train ARGV``: its exit status and what it printed to stderr."""
    del rank, world_size, store
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train_main(argv)
    return code, err.getvalue()


def _verify_own_copy(rank: int, world: int, store: str, plan: str,
                     copies: list[list[str]]) -> str:
    content.BLOCK_TOKENS = 500
    with PlanReader(plan) as reader:
        try:
            open_plan_source(reader, copies[rank])
        except ValueError as e:
            return str(e)
    return ""


@pytest.mark.dist
@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("edited", [0, 1])
def test_every_copy_read_is_hashed_whole(tmp_path: Path, edited: int) -> None:
    """Nodes with their own copies (here: each rank its own files): each rank hashed 1/W of
    the blocks from its copy, so an edited copy trained when its edited block fell to a rank
    of another copy (issue 32). Now the ranks of each copy hash all of it; every rank fails."""
    good, bad = _multi(tmp_path / "good", False), _multi(tmp_path / "bad", True)
    plan = tmp_path / "p.arrow"
    assert plan_main(["--data-path", "0.5", good[0], "0.5", good[1], "-o", str(plan), *PLAN,
                      "--fingerprint", "content"]) == 0
    copies = [bad if r == edited else good for r in range(2)]
    got = run_distributed(_verify_own_copy, 2, str(plan), copies)
    assert f"the tokens of {bad[0]} (content fingerprint" in got[edited]
    assert "in the copy another rank reads" in got[1 - edited]
    assert run_distributed(_verify_own_copy, 2, str(plan), [good, good]) == ["", ""]
