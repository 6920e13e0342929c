"""Datasets of many files: order of paths, directories and globs; compressed JSONL; blends; the
plan header's file list; validation naming the changed file; the runtime reading across files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import zstandard

from planner.cli import main
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import PlanFile
from planner.planfile.validate import validate
from planner.sources.dataset import blend_counts, expand_paths, parse_data_path
from planner.sources.lengths import DATASET_SUFFIXES, read_lengths
from planner.sources.megatron import write_megatron_dataset

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "data" / "sample.jsonl"
BASE = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "8192", "--global-batch-size", "100",
        "--long-sequences", "split", "--effort", "fast", "--quiet"]


def _lines() -> list[bytes]:
    return SAMPLE.read_bytes().splitlines(keepends=True)


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """data/sample.jsonl cut into a plain, a gzip and a zstd shard (names sort in that order)."""
    lines = _lines()
    d = tmp_path / "shards"
    d.mkdir()
    (d / "part-000.jsonl").write_bytes(b"".join(lines[:700]))
    (d / "part-001.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[700:1400])))
    # Two zstd frames in one file, as pzstd or concatenated shards write it.
    c = zstandard.ZstdCompressor()
    (d / "part-002.jsonl.zst").write_bytes(c.compress(b"".join(lines[1400:1700]))
                                           + c.compress(b"".join(lines[1700:])))
    (d / ".hidden.jsonl").write_text('{"length": 3}\n')
    (d / "notes.md").write_text("not data\n")
    return d


def test_expand_order_directories_globs_megatron_and_duplicates(tmp_path: Path) -> None:
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / name).write_text("3\n" if name.endswith(".txt") else '{"length": 3}\n')
    write_megatron_dataset(tmp_path / "m", [[1, 2], [3]])
    got = [Path(f).name for f, _ in expand_paths([str(tmp_path)], DATASET_SUFFIXES)]
    assert got == ["a.jsonl", "b.jsonl", "c.txt", "m"]       # sorted; the .bin/.idx pair once
    got = expand_paths([str(tmp_path / "b.jsonl"), str(tmp_path / "*.txt")], DATASET_SUFFIXES)
    assert [(Path(f).name, g) for f, g in got] == [("b.jsonl", 0), ("c.txt", 1)]
    with pytest.raises(ValueError, match="given twice"):
        expand_paths([str(tmp_path / "a.jsonl"), str(tmp_path)], DATASET_SUFFIXES)
    with pytest.raises(ValueError, match="no dataset file matches"):
        expand_paths([str(tmp_path / "*.parquet")], DATASET_SUFFIXES)


def test_parse_data_path_and_blend_counts() -> None:
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="is not a weight"):
        parse_data_path(["1", "a", "b", "c"])
    with pytest.raises(ValueError, match="positive"):
        parse_data_path(["0", "a"])
    assert blend_counts([0.3, 0.7], 64) == [19, 45]
    assert blend_counts([1, 1, 1], 10) == [4, 3, 3]           # ties go to the earlier entry
    with pytest.raises(ValueError, match="gives 0 of 10 samples"):
        blend_counts([1, 100], 10)


def test_shards_read_as_the_single_file(shards: Path) -> None:
    one = read_lengths(SAMPLE)
    many = read_lengths(shards)
    assert np.array_equal(one.lengths, many.lengths)
    assert [f.num_samples for f in many.files] == [700, 700, 600]
    assert [Path(f.path).name for f in many.files] == ["part-000.jsonl", "part-001.jsonl.gz",
                                                       "part-002.jsonl.zst"]
    glob = read_lengths([str(shards / "part-000.jsonl"), str(shards / "part-00[12]*")])
    assert np.array_equal(glob.lengths, one.lengths)


def test_bad_records_name_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"length": 3}\n')
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"length": 3}\n\n{"length": -1}\n'))
    with pytest.raises(ValueError, match=r"b\.jsonl\.gz:3: 'length' is -1"):
        read_lengths(tmp_path)
    t = read_lengths(tmp_path, skip_bad_records=True)
    assert t.skipped.tolist() == [2]                         # a global sample index
    (tmp_path / "c.jsonl").write_text('{"text": "hello world"}\n')
    with pytest.raises(ValueError, match="holds text .'text'., not token ids: plan it with --tok"):
        read_lengths(tmp_path / "c.jsonl")


@pytest.mark.parametrize("codec", ["gz", "zst"])
def test_truncated_streams_are_errors(tmp_path: Path, codec: str) -> None:
    data = b"".join(_lines()[:200])
    packed = gzip.compress(data) if codec == "gz" else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"x.jsonl.{codec}"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(ValueError, match=rf"x\.jsonl\.{codec}: .*truncated"):
        read_lengths(path)


def test_plan_of_shards_lists_files_and_equals_the_single_file_plan(
        shards: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.arrow", tmp_path / "b.arrow"
    assert main([str(SAMPLE), "-o", str(a), *BASE]) == 0
    assert main([str(shards), "-o", str(b), *BASE]) == 0
    with PlanFile(a) as fa, PlanFile(b) as fb:
        assert fb.header.format_version == 2
        files = fb.header.dataset.files
        assert [f["num_samples"] for f in files] == [700, 700, 600]
        assert all(f["fingerprint"].startswith("sha256:") for f in files)
        assert fa.header.dataset.fingerprint == fb.header.dataset.fingerprint
        assert all(fa.step(i).equals(fb.step(i)) for i in range(fa.num_steps))
    assert main(["validate", str(b), str(shards)]) == 0
    # A shard that changed is named; the plain dataset order matters too.
    (shards / "part-000.jsonl").write_bytes(b"".join(_lines()[1:701]))
    with PlanFile(b) as fb, pytest.raises(ValueError, match=r"part-000\.jsonl \(samples 0\.\.699"):
        validate(fb.header, fb, read_lengths(shards).lengths)


def test_blend_draws_fixed_counts_per_step(shards: Path) -> None:
    table = read_lengths([str(shards / "part-000.jsonl"), str(shards / "part-00[12]*")])
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=2), capacity_tokens_per_rank=8192,
                           global_batch_size=64, long_sequences="split", effort="fast",
                           blend=(0.3, 0.7))
    plan = make_plan(table, config, load_cost_model())
    blend = plan.header.global_batch["blend"]
    assert blend["samples_per_step"] == [19, 45]
    # Entry 1 (1,300 samples) gives 45 a step: 28 steps; entry 0 then gave 28 x 19 = 532 of 700.
    assert plan.header.num_steps == 1300 // 45
    assert blend["drawn_per_epoch"] == [[28 * 19, 28 * 45]]
    for cols in plan.steps:
        s = np.unique(cols["sample_index"][cols["sample_index"] >= 0])
        assert [(s < 700).sum(), (s >= 700).sum()] == [19, 45]
    again = make_plan(table, config, load_cost_model())
    assert all(np.array_equal(x["sample_index"], y["sample_index"])
               for x, y in zip(plan.steps, again.steps, strict=True))
    batches = list(plan.record_batches())
    validate(plan.header, batches, table.lengths)
    # A step that draws other counts than the header says fails validation.
    bad = dict(plan.header.global_batch, blend=dict(blend, samples_per_step=[20, 44]))
    from dataclasses import replace

    with pytest.raises(ValueError, match="samples_per_step is"):
        validate(replace(plan.header, global_batch=bad), batches, table.lengths)


def test_blend_flag_errors(shards: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--data-path", "1", str(shards), *BASE[:6], "--global-batch-tokens", "9000"])
    assert "use --global-batch-size" in capsys.readouterr().err


def test_runtime_reads_across_files(shards: Path) -> None:
    pytest.importorskip("torch")
    from runtime.data.tokens import ConcatTokens, open_token_source, read_segments

    one = open_token_source(SAMPLE)
    many = open_token_source(shards)
    assert isinstance(many, ConcatTokens)
    assert np.array_equal(one.lengths(), many.lengths())
    rng = np.random.default_rng(0)
    sample = rng.integers(0, 2000, 300)
    offset = np.minimum(rng.integers(0, 50, 300), one.lengths()[sample] - 1)
    length = np.minimum(one.lengths()[sample] - offset, 40)
    assert np.array_equal(read_segments(one, sample, offset, length),
                          read_segments(many, sample, offset, length))
    for s in (0, 699, 700, 1399, 1400, 1999):
        want = json.loads(_lines()[s])["input_ids"]
        assert many.read(s, 0, len(want)).tolist() == want
    with pytest.raises(ValueError, match="sample 2000 out of range"):
        many.read(2000, 0, 1)
    many.close()  # type: ignore[attr-defined]
