"""A text corpus end to end through the commands: plan from text, or tokenize then plan; train.

Two routes from one JSONL corpus and one tokenizer (``tests.text.bpe``), every step a command
line (``dcp-plan`` in a fresh process, ``dcp-train`` on 2 gloo ranks through its ``main``):

(a) ``dcp-plan CORPUS --tokenizer TOK ...`` -> ``dcp-train`` (tokenizes the records on the fly);
(b) ``dcp-plan tokenize CORPUS --tokenizer TOK -o PREFIX`` -> ``dcp-plan PREFIX.idx ...`` (the
    same flags) -> ``dcp-train`` (reads the token ids).

Both plans must have the same steps, row for row, and the runs the same per-step losses, bit for
bit (the same tokens in the same order, fp32). The corpus ends in an empty text (0 tokens: a
record (a) keeps with length 0 and never plans, which (b) does not write) and, in the second
case, a line that is not UTF-8, skipped by both routes under ``--skip-bad-records``: (a) keeps
it as a sample of length 0, and training must read it as the planner did (a bad record, not a
text of U+FFFD replacements, whose tokens would contradict the plan). They come last because
a plan's draw order is keyed by sample index (``planner.solver.batches.epoch_permutation``):
records that (b) leaves out must not shift the indices of the others.

Beside it: ``dcp-plan validate`` passes on the text plan, a corpus edited after planning is
refused by ``dcp-train`` naming the sample, and a bad record in the middle of a text corpus is
skipped exactly as one in a token-id corpus (the same steps and losses as that twin).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.data.plan_reader import PlanReader
from runtime.data.tokens import open_token_source
from tests.dist import run_distributed
from tests.reliability.helpers import ROOT, run_cli
from tests.text.bpe import texts, train_bpe
from tests.text.test_text_train import PLAN, TRAIN, _cli, _losses

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # 2 gloo ranks; 22-47 s for the three on 2 cores

NOT_UTF8 = b'{"id": 99, "text": "caf\xe9 au lait"}'  # Latin-1: a bad record


def _corpus(path: Path, *, bad_at: int | None = None) -> Path:
    """40 documents and an empty text last, as JSONL; ``bad_at``: a non-UTF-8 line there."""
    docs = texts(41, seed=2)
    lines = [json.dumps({"id": i, "text": t}).encode() for i, t in enumerate(docs[1:] + docs[:1])]
    if bad_at is not None:
        lines.insert(bad_at, NOT_UTF8)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _plan(*args: str) -> str:
    """``dcp-plan ARGS`` in a fresh process; its stdout (it must succeed)."""
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _train(plan: Path, log: Path) -> list[float]:
    """``dcp-train --plan PLAN`` on 2 gloo ranks (dataset and tokenizer from the header)."""
    argv = ["--plan", str(plan), *TRAIN, "--steps", "3", "--log-jsonl", str(log)]
    assert run_distributed(_cli, 2, argv, timeout=300) == [0, 0]
    return _losses(log)


def _rows(plan: Path) -> list[dict[str, list[int]]]:
    with PlanReader(plan) as r:
        return [{k: np.asarray(v).tolist() for k, v in r.columns(i).items()}
                for i in range(r.num_steps)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("case", ["empty", "not-utf8"])
def test_planned_from_text_trains_as_tokenized_then_planned(tmp_path: Path, tokenizer: Path,
                                                            case: str) -> None:
    skip = ["--skip-bad-records"] if case == "not-utf8" else []
    corpus = _corpus(tmp_path / "corpus.jsonl", bad_at=41 if skip else None)
    tok = ["--tokenizer", str(tokenizer)]
    text_plan, ids_plan, prefix = tmp_path / "text.arrow", tmp_path / "ids.arrow", tmp_path / "ids"
    # (a) planned from the text.
    said = _plan(str(corpus), *tok, *PLAN, *skip, "-o", str(text_plan))
    assert f"{corpus}: {42 if skip else 41} samples" in said
    # (b) tokenized once, then planned with the same flags.
    said = _plan("tokenize", str(corpus), *tok, *skip, "-o", str(prefix))
    assert "40 documents" in said
    assert "1 empty documents (no tokens)" in said
    if skip:
        assert "1 bad records" in said
    _plan(f"{prefix}.idx", *PLAN, "-o", str(ids_plan))
    with PlanReader(text_plan) as r:
        assert r.header.skips_bad_records == bool(skip)
        assert r.header.dataset.tokenizer["sha256"]
    rows = _rows(text_plan)
    assert len(rows) == 5
    assert rows == _rows(ids_plan)
    # The text plan checks against its corpus (the skip policy from its header).
    assert "valid train plan" in _plan("validate", str(text_plan), str(corpus))
    text = _train(text_plan, tmp_path / "text.log")
    assert len(text) == 3
    assert text == _train(ids_plan, tmp_path / "ids.log")  # exact: the same tokens
    # A corpus edited after planning: refused before the first step, naming the sample.
    lines = corpus.read_bytes().split(b"\n")
    record = json.loads(lines[5])
    lines[5] = json.dumps({**record, "text": record["text"] + " context parallel"}).encode()
    corpus.write_bytes(b"\n".join(lines))
    run = subprocess.run([sys.executable, "-m", "runtime.train", "--plan", str(text_plan),
                          *TRAIN, "--reference", "--steps", "1"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    assert f"sample 5 ({corpus}, line 6) holds" in run.stderr
    assert "the text or the tokenizer is not the plan's" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_bad_text_record_is_skipped_as_a_bad_token_id_record(tmp_path: Path,
                                                               tokenizer: Path) -> None:
    """A non-UTF-8 line in the middle of the text (sample 7) and a bad line at the same place
    of its token-id twin: both plans keep it as a sample of length 0, so they have the same
    steps, and training reads past it to the same tokens (the records after it are not
    shifted)."""
    corpus = _corpus(tmp_path / "corpus.jsonl", bad_at=7)
    prefix = tmp_path / "ids"
    _plan("tokenize", str(corpus), "--tokenizer", str(tokenizer), "--skip-bad-records", "-o",
          str(prefix))
    source = open_token_source(f"{prefix}.idx")
    n = source.lengths()
    ids = [source.read(d, 0, int(n[d])).tolist() for d in range(len(n))]
    # Token-id twin: the bad line where the text's is, the empty text last (0 tokens).
    twin_lines = [json.dumps({"input_ids": t}) for t in ids]
    twin_lines.insert(7, '{"input_ids": "not tokens"}')
    twin = tmp_path / "twin.jsonl"
    twin.write_text("\n".join([*twin_lines, json.dumps({"input_ids": []})]) + "\n")
    text_plan, twin_plan = tmp_path / "text.arrow", tmp_path / "twin.arrow"
    _plan(str(corpus), "--tokenizer", str(tokenizer), *PLAN, "--skip-bad-records", "-o",
          str(text_plan))
    _plan(str(twin), *PLAN, "--skip-bad-records", "-o", str(twin_plan))
    for plan in (text_plan, twin_plan):
        with PlanReader(plan) as r:
            assert r.header.skips_bad_records
    assert _rows(text_plan) == _rows(twin_plan)
    assert _train(text_plan, tmp_path / "text.log") == _train(twin_plan, tmp_path / "twin.log")
