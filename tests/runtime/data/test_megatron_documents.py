"""The runtime reads a Megatron dataset in the plan's unit: a document is its sequences' tokens.

Datasets are written by Megatron-core's ``IndexedDatasetBuilder`` with several sequences per
document, and a document's tokens are checked against Megatron-core's own reader
(``IndexedDataset.get`` of each of its sequences, concatenated). A plan made before the unit
was recorded (no ``dataset.megatron_unit``) planned sequences and still replays them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main as plan_main
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import check_plan_source, open_plan_source
from runtime.data.tokens import MegatronTokens, open_token_source, read_segments
from runtime.train.cli import main as train_main
from tests.megatron_docs import concatenated, megatron_reader, random_documents, write_documents

VOCAB = 64
PLAN = ["--dp", "1", "--cp", "2", "--max-tokens-per-rank", "32", "--global-batch-size", "8",
        "--seed", "3", "--quiet"]
TRAIN = ["--vocab-size", str(VOCAB), "--hidden-size", "32", "--heads", "4", "--query-groups",
         "2", "--layers", "2", "--seed", "7", "--lr", "3e-3", "--steps", "2", "--quiet",
         "--reference"]


def test_a_document_is_its_sequences_concatenated(tmp_path: Path) -> None:
    docs = random_documents(20, sequences=4, seed=5)
    prefix = write_documents(tmp_path / "ds", docs, dtype=np.uint16)
    megatron = megatron_reader(prefix)
    doc_index = megatron.document_indices
    want = [np.concatenate([megatron.get(j) for j in range(doc_index[d], doc_index[d + 1])])
            for d in range(len(docs))]
    assert [w.tolist() for w in want] == [t.tolist() for t in concatenated(docs)]
    source = open_token_source(f"{prefix}.bin")
    assert isinstance(source, MegatronTokens)
    assert source.unit == "document"
    assert source.lengths().tolist() == [len(w) for w in want]
    for d, w in enumerate(want):
        assert source.read(d, 0, len(w)).tolist() == w.tolist()
    # Segments that cross sequence boundaries, in one vectorised gather.
    rng = np.random.default_rng(1)
    sample = rng.integers(0, len(docs), 64)
    offset = np.array([rng.integers(0, len(want[s])) for s in sample], np.int64)
    length = np.array([rng.integers(0, len(want[s]) - o + 1) for s, o in
                       zip(sample, offset, strict=True)], np.int64)
    got = read_segments(source, sample, offset, length)
    expect = np.concatenate([want[s][o:o + n] for s, o, n in
                             zip(sample, offset, length, strict=True)])
    assert got.tolist() == expect.tolist()
    with pytest.raises(ValueError, match=r"sample 3 has \d+ tokens, asked for"):
        source.read(3, 0, len(want[3]) + 1)
    sequences = open_token_source(prefix, megatron_unit="sequence")
    assert sequences.num_samples == int(doc_index[-1])
    assert sequences.read(1, 0, len(docs[0][1])).tolist() == docs[0][1].tolist()


def _old_plan(tmp: Path, prefix: Path) -> Path:
    """What a dcp-plan that did not record the unit wrote: sequences, no megatron_unit."""
    table = read_lengths(prefix, megatron_unit="sequence")
    table = replace(table, megatron_unit="", files=tuple(
        replace(f, num_sequences=0, num_documents=0) for f in table.files))
    config = PlannerConfig(parallel=ParallelConfig(dp=1, cp=2), capacity_tokens_per_rank=32,
                           global_batch_size=8, seed=3)
    made = make_plan(table, config, load_cost_model("default"))
    dataset = json.loads(made.header.to_json())["dataset"]
    assert "megatron_unit" not in dataset
    assert "num_sequences" not in dataset["files"][0]
    return write_plan(tmp / "old.arrow", made.header, made.record_batches())


def test_plans_open_in_their_unit_and_old_plans_as_sequences(tmp_path: Path) -> None:
    docs = random_documents(24, sequences=3, vocab=VOCAB, longest=20, seed=2)
    prefix = write_documents(tmp_path / "ds", docs)
    num_sequences = sum(len(d) for d in docs)
    new = tmp_path / "new.arrow"
    assert plan_main([f"{prefix}.idx", *PLAN, "--fingerprint", "content", "-o", str(new)]) == 0
    with PlanReader(new) as reader:
        source = open_plan_source(reader, [f"{prefix}.idx"])  # content verified: every token
        assert source.num_samples == len(docs)
    old = _old_plan(tmp_path, prefix)
    with PlanReader(old) as reader:
        assert reader.header.dataset.replay_megatron_unit == "sequence"
        source = open_plan_source(reader, [str(prefix)])
        assert source.num_samples == num_sequences
    assert plan_main(["validate", str(old), str(prefix)]) == 0
    # A plan of sequences read as documents would be refused by the lengths fingerprint; a
    # caller's own source (Trainer, PlanJob) in the other unit is named as such.
    with PlanReader(old) as reader, pytest.raises(ValueError, match="dataset of 46 samples"):
        reader.check_dataset(open_token_source(prefix).lengths(), [str(prefix)])
    with PlanReader(old) as reader, pytest.raises(
            ValueError, match=r"ds: read as Megatron documents, .*old\.arrow was planned on "
                              r"sequences \(its header's dataset\.megatron_unit\): open it with "
                              r"open_token_source\(\.\.\., megatron_unit='sequence'\)"):
        check_plan_source(reader, open_token_source([str(prefix)]))
    with PlanReader(new) as reader:
        check_plan_source(reader, open_token_source(prefix))


def _losses(log: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in log.read_text().splitlines() if '"step"' in x]


def test_training_on_documents_reads_their_concatenated_tokens(tmp_path: Path) -> None:
    """The oracle on a document plan of a Megatron dataset and on a plan of a JSONL holding the
    same documents' tokens: the same lengths, the same steps and so the same losses."""
    docs = random_documents(24, sequences=3, vocab=VOCAB, longest=20, seed=2)
    prefix = write_documents(tmp_path / "ds", docs)
    control = tmp_path / "control.jsonl"
    control.write_text("".join(json.dumps({"input_ids": t.tolist()}) + "\n"
                               for t in concatenated(docs)))
    plans = {name: tmp_path / f"{name}.arrow" for name in ("megatron", "control")}
    assert plan_main([f"{prefix}.idx", *PLAN, "-o", str(plans["megatron"])]) == 0
    assert plan_main([str(control), *PLAN, "-o", str(plans["control"])]) == 0
    with PlanReader(plans["megatron"]) as a, PlanReader(plans["control"]) as b:
        assert a.header.dataset.fingerprint == b.header.dataset.fingerprint
    losses = {}
    for name, plan in plans.items():
        log = tmp_path / f"{name}.log"
        assert train_main(["--plan", str(plan), *TRAIN, "--log-jsonl", str(log)]) == 0
        losses[name] = _losses(log)
    assert len(losses["megatron"]) == 2
    assert losses["megatron"] == losses["control"]
