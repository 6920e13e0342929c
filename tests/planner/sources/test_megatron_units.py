"""A Megatron dataset plans documents by default and sequences on request (``--megatron-unit``).

The datasets are written by Megatron-core's own ``IndexedDatasetBuilder`` with several sequences
per document (``tests/megatron_docs.py``), and the counts are checked against Megatron-core's
own reader (``IndexedDataset``), so this reader and Megatron's agree on what a document is.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main as plan_main
from planner.planfile.io import PlanFile
from planner.planfile.validate import validate
from planner.sources.lengths import read_lengths
from planner.sources.megatron import read_megatron_samples
from tests.megatron_docs import concatenated, megatron_reader, random_documents, write_documents

PLAN = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "64", "--global-batch-size", "8"]


@pytest.fixture
def fifty(tmp_path: Path) -> Path:
    """50 documents of 3 sequences each: 150 sequences."""
    return write_documents(tmp_path / "fifty", random_documents(50))


def test_documents_by_default_sequences_on_request(fifty: Path) -> None:
    ds = megatron_reader(fifty)
    seq = ds.sequence_lengths.astype(np.int64)
    doc_index = ds.document_indices
    by_doc = np.add.reduceat(seq, doc_index[:-1])
    docs = read_lengths(fifty)
    assert (docs.num_samples, docs.megatron_unit) == (50, "document")
    assert docs.lengths.tolist() == by_doc.tolist()
    f = docs.files[0]
    assert (f.num_samples, f.num_sequences, f.num_documents) == (50, 150, 50)
    seqs = read_lengths(f"{fifty}.idx", megatron_unit="sequence")
    assert (seqs.num_samples, seqs.megatron_unit) == (150, "sequence")
    assert seqs.lengths.tolist() == seq.tolist()
    assert docs.num_tokens == seqs.num_tokens
    # A document's tokens are one slice of the .bin: where its first sequence starts.
    samples = read_megatron_samples(fifty)
    assert samples.starts.tolist() == (ds.index.sequence_pointers[doc_index[:-1]] // 4).tolist()
    # A dataset without Megatron files records no unit.
    other = fifty.parent / "x.txt"
    other.write_text("3\n4\n")
    assert read_lengths(other).megatron_unit == ""
    with pytest.raises(ValueError, match="Megatron unit 'sentence' is not one of document, seq"):
        read_lengths(fifty, megatron_unit="sentence")


def test_the_plan_records_the_unit_and_the_summary_says_it(
        fifty: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for unit, samples in (("document", 50), ("sequence", 150)):
        out = tmp_path / f"{unit}.arrow"
        argv = [f"{fifty}.idx", *PLAN, "-o", str(out)]
        assert plan_main(argv + (["--megatron-unit", unit] if unit == "sequence" else [])) == 0
        text = capsys.readouterr().out
        with PlanFile(out) as f:
            d = f.header.dataset
            assert (d.num_samples, d.megatron_unit) == (samples, unit)
            assert json.loads(f.header.to_json())["dataset"]["megatron_unit"] == unit
            assert (d.files[0]["num_sequences"], d.files[0]["num_documents"]) == (150, 50)
            drawn = np.unique(np.concatenate([f.step(i).column("sample_index").to_numpy()
                                              for i in range(f.num_steps)]))
            assert drawn[drawn >= 0].tolist() == list(range(samples))  # -1: padding rows
        counts = ("50 documents (150 sequences)" if unit == "document"
                  else "150 sequences (50 documents)")
        assert f"data      {counts} of {fifty}.idx, planned as {unit}s\n" in text
        assert plan_main(["validate", str(out), f"{fifty}.idx"]) == 0  # reads the plan's unit
        capsys.readouterr()
    assert plan_main([f"{fifty}.idx", *PLAN, "-o", str(tmp_path / "j.arrow"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["dataset"]
    assert summary["megatron"] == {"unit": "document", "files": 1, "path": f"{fifty}.idx",
                                   "num_documents": 50, "num_sequences": 150}
    assert summary["num_samples"] == 50


def test_compare_plans_the_unit_it_is_given(fifty: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``dcp-plan compare`` reads a Megatron dataset as ``dcp-plan`` does: documents by default,
    sequences with ``--megatron-unit sequence``, and says which."""
    argv = ["compare", f"{fifty}.idx", "--pools", "4", "--max-tokens-per-rank", "64",
            "--global-batch-size", "8", "--sample-steps", "0"]
    for unit, samples in (("document", 50), ("sequence", 150)):
        assert plan_main([*argv, "--megatron-unit", unit, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)["dataset"]
        assert (d["num_samples"], d["megatron_unit"]) == (samples, unit)
    assert plan_main(argv) == 0
    assert ": 50 samples (documents of Megatron files), " in capsys.readouterr().out


def test_a_plan_without_megatron_files_keeps_its_header(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(n))}) + "\n" for n in (5, 9, 30)))
    assert plan_main([str(data), *PLAN, "-o", str(tmp_path / "p.arrow"), "--quiet"]) == 0
    with PlanFile(tmp_path / "p.arrow") as f:
        d = json.loads(f.header.to_json())["dataset"]
        assert "megatron_unit" not in d
        assert not {"num_sequences", "num_documents"} & set(d["files"][0])


def test_bad_documents_are_named(tmp_path: Path) -> None:
    docs = random_documents(5, seed=0)
    docs[2] = []  # end_document with no sequence: an empty document
    prefix = write_documents(tmp_path / "ds", docs)
    with pytest.raises(ValueError, match=r"ds\.idx: document 2: length 0; lengths must be"):
        read_lengths(prefix)
    table = read_lengths(prefix, skip_bad_records=True)
    assert table.skipped.tolist() == [2]
    assert table.lengths.tolist() == [len(t) for t in concatenated(docs)]
    assert read_lengths(prefix, megatron_unit="sequence").num_samples == 12


def _rewrite_documents(prefix: Path, documents: list[int]) -> None:
    """Replace the index's document indices (same count) with ``documents``."""
    idx = Path(f"{prefix}.idx")
    data = bytearray(idx.read_bytes())
    count, doc_count = struct.unpack_from("<QQ", data, 18)
    assert doc_count == len(documents)
    struct.pack_into(f"<{doc_count}q", data, 34 + 12 * count, *documents)
    idx.write_bytes(bytes(data))


@pytest.mark.parametrize(("documents", "message"), [
    ([0, 3, 6, 8], r"document indices run from 0 to 8, not from 0 to the 9 sequences"),
    ([0, 6, 3, 9], r"document 2 starts at sequence 3, before document 1 \(sequence 6\)"),
])
def test_damaged_document_indices_are_refused(tmp_path: Path, documents: list[int],
                                              message: str) -> None:
    prefix = write_documents(tmp_path / "ds", random_documents(3))
    _rewrite_documents(prefix, documents)
    with pytest.raises(ValueError, match=message + r".*plan its sequences with --megatron-unit"):
        read_lengths(prefix)
    assert read_lengths(prefix, megatron_unit="sequence").num_samples == 9


def test_a_gap_inside_a_document_is_refused(tmp_path: Path) -> None:
    prefix = write_documents(tmp_path / "ds", random_documents(2, longest=5))
    idx = Path(f"{prefix}.idx")
    data = bytearray(idx.read_bytes())
    count = struct.unpack_from("<Q", data, 18)[0]
    pointers = list(struct.unpack_from(f"<{count}q", data, 34 + 4 * count))
    pointers[1:] = [p + 4 for p in pointers[1:]]  # sequence 1 moves one token on: a gap
    struct.pack_into(f"<{count}q", data, 34 + 4 * count, *pointers)
    idx.write_bytes(bytes(data))
    Path(f"{prefix}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes() + b"\0" * 4)
    with pytest.raises(ValueError, match=r"document 0: sequence 1 starts at byte \d+, not where "
                                         "sequence 0 ends"):
        read_lengths(prefix)
    assert read_lengths(prefix, megatron_unit="sequence").num_samples == 6


def test_validate_refuses_an_unknown_unit(fifty: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.arrow"
    assert plan_main([str(fifty), *PLAN, "-o", str(out), "--quiet"]) == 0
    with PlanFile(out) as f:
        validate(f.header, f, read_lengths(fifty).lengths, source=str(out))
        bad = replace(f.header, dataset=replace(f.header.dataset, megatron_unit="sentence"))
        with pytest.raises(ValueError, match="header: dataset megatron_unit 'sentence' is not "
                                             "one of document, sequence"):
            validate(bad, f, source=str(out))
