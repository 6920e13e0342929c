"""Training reads a text plan's records through the plan's tokenizer, on the fly.

The text plan and its token-id twin (``tests.text.plans``) have the same steps; the twin's
records are ``TextEncoder.encode`` of the texts. A run on each must log the same losses step for
step, exactly (the same tokens in the same order), on 2 gloo ranks and in the oracle, for the
native engine and the framework adapters. The refusals (another tokenizer, an edited text, a
vocabulary too small, --tokenizer on a plan of token ids) name what is wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main as plan_main
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.data.text_records import open_text_records
from runtime.data.token_text import TextTokens
from runtime.data.tokens import read_segments
from runtime.train.cli import main as train_main
from tests.dist import run_distributed
from tests.text.bpe import train_bpe
from tests.text.plans import TextPlans, rewrite_as_text, text_plans, write_text

VOCAB = 320  # the test tokenizer has 300 ids
# Pool 2 (dp 1 x cp 2), C = 64: documents of up to ~150 tokens, split where longer than 128.
PLAN = ["--dp", "1", "--cp", "2", "--max-tokens-per-rank", "64", "--global-batch-size", "8",
        "--long-sequences", "split", "--seed", "3"]
TRAIN = ["--vocab-size", str(VOCAB), "--hidden-size", "32", "--heads", "4", "--query-groups",
         "2", "--layers", "2", "--seed", "7", "--lr", "3e-3", "--steps", "2", "--quiet"]


def _losses(log: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in log.read_text().splitlines() if '"step"' in x]


def _cli(rank: int, world_size: int, store: str, argv: list[str]) -> int:
    del rank, world_size, store
    return train_main(argv)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_the_text_source_gives_the_pretokenized_tokens(tmp_path: Path, suffix: str) -> None:
    tp = text_plans(tmp_path, PLAN, suffix=suffix)
    with PlanReader(tp.text_plan) as a, PlanReader(tp.ids_plan) as b:
        text = open_plan_source(a, [str(tp.text)])
        ids = open_plan_source(b, [str(tp.ids)])
        n = ids.lengths()
        assert np.array_equal(text.lengths(), n)
        every = np.arange(len(n), dtype=np.int64)
        # Segments in reverse order, some twice, some from the middle: read_many's gather.
        pick = np.r_[every[::-1], every[:5]]
        off = np.minimum(pick % 3, n[pick] - 1)
        want = read_segments(ids, pick, off, n[pick] - off)
        assert np.array_equal(read_segments(text, pick, off, n[pick] - off), want)
        assert np.array_equal(text.read(3, 1, 4), ids.read(3, 1, 4))


@pytest.mark.dist
def test_native_ranks_and_oracle_on_text_equal_the_pretokenized_runs(tmp_path: Path) -> None:
    tp = text_plans(tmp_path, PLAN)
    text_eval, ids_eval = _eval_twins(tmp_path, tp)
    logs = {k: tmp_path / f"{k}.log" for k in ("text", "ids", "text-oracle", "ids-oracle")}
    # No --dataset, no --tokenizer: the header names both (the evaluator's plan is text too).
    assert run_distributed(_cli, 2, ["--plan", str(tp.text_plan), *TRAIN, "--log-jsonl",
                                     str(logs["text"]), "--eval-plan", str(text_eval),
                                     "--eval-dataset", str(tp.text)], timeout=300) == [0, 0]
    assert run_distributed(_cli, 2, ["--plan", str(tp.ids_plan), *TRAIN, "--log-jsonl",
                                     str(logs["ids"]), "--eval-plan", str(ids_eval),
                                     "--eval-dataset", str(tp.ids)], timeout=300) == [0, 0]
    for name, plan in (("text-oracle", tp.text_plan), ("ids-oracle", tp.ids_plan)):
        assert train_main(["--plan", str(plan), *TRAIN, "--reference", "--log-jsonl",
                           str(logs[name])]) == 0
    text, ids = _losses(logs["text"]), _losses(logs["ids"])
    assert len(text) == 2
    assert text == ids  # the same tokens: the same losses, bit for bit
    assert len(_evals(logs["text"])) == 1
    assert _evals(logs["text"]) == _evals(logs["ids"])
    assert _losses(logs["text-oracle"]) == _losses(logs["ids-oracle"])
    for got, want in zip(text, _losses(logs["text-oracle"]), strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)


@pytest.mark.dist
@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_framework_ranks_on_text_equal_the_pretokenized_run(tmp_path: Path,
                                                           framework: str) -> None:
    pytest.importorskip("megatron.core" if framework == "megatron" else "torchtitan")
    tp = text_plans(tmp_path, PLAN)
    train = [*TRAIN, "--framework", framework]
    logs = {k: tmp_path / f"{k}.log" for k in ("text", "ids")}
    for name, plan in (("text", tp.text_plan), ("ids", tp.ids_plan)):
        assert run_distributed(_cli, 2, ["--plan", str(plan), *train, "--log-jsonl",
                                         str(logs[name])], timeout=400) == [0, 0]
    text = _losses(logs["text"])
    assert len(text) == 2
    assert text == _losses(logs["ids"])


def _eval_twins(tmp: Path, tp: TextPlans) -> tuple[Path, Path]:
    """(text eval plan, its token-id twin) over the same corpus (``dcp-plan --eval``)."""
    flags = [f for f in PLAN if f not in ("--seed", "3")]
    ids_eval = tmp / "ids-eval.arrow"
    assert plan_main([str(tp.ids), "--eval", "-o", str(ids_eval), "--quiet", *flags]) == 0
    return rewrite_as_text(ids_eval, tmp / "text-eval.arrow", tp.text, tp.encoder), ids_eval


def _evals(log: Path) -> list[float]:
    return [json.loads(x)["eval_loss"] for x in log.read_text().splitlines() if "eval_loss" in x]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_refusals_name_the_tokenizer_the_sample_and_the_vocabulary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tp = text_plans(tmp_path, PLAN)
    base = [*TRAIN, "--reference", "--steps", "1"]
    # --vocab-size below the tokenizer's 300 ids.
    err = _error(capsys, ["--plan", str(tp.text_plan), *base, "--vocab-size", "256"])
    assert "--vocab-size 256 is below the vocabulary of the plan's tokenizer" in err
    assert "(300 ids): give --vocab-size 300 or more" in err
    # Another tokenizer under --tokenizer: refused by sha256, naming both files.
    other = train_bpe(tmp_path / "other", vocab_size=290)
    err = _error(capsys, ["--plan", str(tp.text_plan), *base, "--tokenizer", str(other)])
    assert f"{tp.text_plan} was planned with tokenizer {tp.tokenizer} (sha256 " in err
    assert f"{other} is another tokenizer (sha256 " in err
    # The tokenizer moved: --tokenizer PATH (a folder) finds it; without it, the path is named.
    moved = tmp_path / "moved"
    shutil.copytree(tp.tokenizer.parent, moved)
    shutil.rmtree(tp.tokenizer.parent)
    err = _error(capsys, ["--plan", str(tp.text_plan), *base])
    assert f"tokenizer {tp.tokenizer}: no such file or folder" in err
    assert "give its new place with --tokenizer PATH" in err
    assert train_main(["--plan", str(tp.text_plan), *base, "--tokenizer", str(moved)]) == 0
    # A text edited since planning: the sample whose count changed is named, file and line.
    docs = list(tp.documents)
    docs[5] = docs[5] + " context parallel"
    write_text(tp.text, docs)
    err = _error(capsys, ["--plan", str(tp.text_plan), *base, "--tokenizer", str(moved)])
    assert f"sample 5 ({tp.text}, line 6) holds" in err
    assert "the text or the tokenizer is not the plan's" in err
    # --tokenizer on a plan of token ids.
    err = _error(capsys, ["--plan", str(tp.ids_plan), *base, "--tokenizer", str(moved)])
    assert "the plan was made from token ids" in err


def test_a_record_without_text_is_named(tmp_path: Path) -> None:
    tp = text_plans(tmp_path, PLAN)
    lines = tp.text.read_text().splitlines()
    lines[2] = json.dumps({"id": 2, "text": None})
    tp.text.write_text("\n".join(lines) + "\n")
    with PlanReader(tp.text_plan) as r, pytest.raises(ValueError, match=(
            rf"{tp.text}: record of sample 2 \(line 3\): no 'text' field \(or it is null\)$")):
        open_plan_source(r, [str(tp.text)])


def test_a_text_changed_while_training_is_refused_at_the_read(tmp_path: Path) -> None:
    tp = text_plans(tmp_path, PLAN)
    with PlanReader(tp.text_plan) as r:
        source = open_plan_source(r, [str(tp.text)])
        n = int(source.lengths()[9])
        docs = list(tp.documents)
        docs[9] = "plan"
        write_text(tp.text, docs)
        with pytest.raises(ValueError, match=rf"{tp.text}: the file changed since it was "
                           "opened"):
            source.read(9, 0, n)
    # A record whose tokens are not the count made at open is named (row, sample, counts).
    table = tmp_path / "t.parquet"
    write_text(table, tp.documents)
    records = open_text_records(str(table), "text")
    counts = tp.encoder.count(tp.documents)
    counts[9] += 1
    with pytest.raises(ValueError, match=rf"{table}: record of sample 9 \(row 9\) tokenizes "
                       rf"to {counts[9] - 1} tokens, {counts[9]} when the run started"):
        TextTokens(records, tp.encoder, counts).read(9, 0, 1)


def test_rewrite_keeps_the_steps(tmp_path: Path) -> None:
    """The helper's text plan is the twin's steps under a text header (the tests' premise)."""
    tp = text_plans(tmp_path, PLAN)
    again = rewrite_as_text(tp.ids_plan, tmp_path / "again.arrow", tp.text, tp.encoder)
    assert again.read_bytes() == tp.text_plan.read_bytes()
    with PlanReader(tp.text_plan) as a, PlanReader(tp.ids_plan) as b:
        assert a.header.dataset.tokenizer == tp.encoder.spec.to_dict()
        assert a.header.dataset.field == "text"
        assert all(a.columns(i)["sample_index"].tolist() == b.columns(i)["sample_index"].tolist()
                   for i in range(a.num_steps))


def _shared_count(rank: int, world_size: int, store: str, plan: str, data: str,
                  batch: int) -> list[int] | str:
    """Open the text plan's source on this rank with ``batch`` records per counted batch."""
    del rank, world_size, store
    import runtime.data.token_text as token_text

    token_text.COUNT_BATCH = batch
    with PlanReader(plan) as r:
        try:
            return [int(n) for n in open_plan_source(r, [data]).lengths()]
        except ValueError as e:
            return str(e)


@pytest.mark.dist
def test_two_ranks_share_the_count_and_a_bad_record_fails_both(tmp_path: Path) -> None:
    tp = text_plans(tmp_path, PLAN)
    want = tp.encoder.count(tp.documents).tolist()
    # 40 records in batches of 7: rank 0 counts batches 0, 2, 4; rank 1 batches 1, 3, 5.
    got = run_distributed(_shared_count, 2, str(tp.text_plan), str(tp.text), 7, timeout=120)
    assert got == [want, want]
    lines = tp.text.read_text().splitlines()
    lines[8] = json.dumps({"id": 8, "text": 8})  # batch 1: rank 1's
    tp.text.write_text("\n".join(lines) + "\n")
    first, second = run_distributed(_shared_count, 2, str(tp.text_plan), str(tp.text), 7,
                                    timeout=120)
    assert first == f"{tp.text_plan}: another rank found a bad record in the text corpus " \
        "(that rank's message names it)"
    assert second == (f"{tp.text}: record of sample 8 (line 9): 'text' is int, not a string "
                      "of text")


def test_an_eval_plan_of_text_evaluates_as_its_twin(tmp_path: Path) -> None:
    """``--eval-plan`` of text (the evaluator and the oracle's eval open it alike), beside a
    training plan of text: the eval losses of the token-id twins."""
    tp = text_plans(tmp_path, PLAN)
    text_eval, ids_eval = _eval_twins(tmp_path, tp)
    logs = {k: tmp_path / f"{k}.log" for k in ("text", "ids")}
    for name, plan, ev, data in (("text", tp.text_plan, text_eval, tp.text),
                                 ("ids", tp.ids_plan, ids_eval, tp.ids)):
        assert train_main(["--plan", str(plan), *TRAIN, "--reference", "--steps", "1",
                           "--eval-plan", str(ev), "--eval-dataset", str(data),
                           "--log-jsonl", str(logs[name])]) == 0
    assert len(_evals(logs["text"])) == 1
    assert _evals(logs["text"]) == _evals(logs["ids"])
