"""The Megatron-LM launcher on a text plan: its tokenizer flags against the plan's, and a run.

The launcher tokenizes the plan's records itself (``open_plan_source``); Megatron-LM's
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`` must name the plan's file (PATH
is then where it is read), ``NullTokenizer``'s ``--vocab-size`` must hold its ids, and any other
tokenizer is refused. The run (Megatron-LM's ``pretrain()`` under torchrun, 2 gloo ranks) on the
text plan logs the losses of the run on its token-id twin. (Megatron-LM's HuggingFaceTokenizer
needs ``transformers``, not installed here: that run uses NullTokenizer.)
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from planner.planfile.io import PlanFile
from runtime.adapters.megatron_lm import flags
from tests.runtime.adapters.megatron_lm.launch import launch, lines, need_megatron_training, ok
from tests.text.bpe import train_bpe
from tests.text.plans import text_plans

PLAN = ["--dp", "1", "--cp", "2", "--max-tokens-per-rank", "64", "--global-batch-size", "8",
        "--long-sequences", "split", "--seed", "3"]


def _check(plan: Path, **args: object) -> tuple[list[str], str | None]:
    with PlanFile(plan) as f:
        return flags.text_tokenizer(SimpleNamespace(**args), f.header, source=str(plan))


def test_tokenizer_flags_are_checked_against_the_plans(tmp_path: Path) -> None:
    tp = text_plans(tmp_path, PLAN)
    hf = "HuggingFaceTokenizer"
    assert _check(tp.text_plan, tokenizer_type=hf, tokenizer_model=str(tp.tokenizer.parent)) \
        == ([], str(tp.tokenizer))
    assert _check(tp.text_plan, tokenizer_type="NullTokenizer", vocab_size=320) == ([], None)
    (low,), _ = _check(tp.text_plan, tokenizer_type="NullTokenizer", vocab_size=256)
    assert low.startswith("--vocab-size 256: the plan ")
    assert "(300 ids); give --vocab-size 300 or more" in low
    other = train_bpe(tmp_path / "other", vocab_size=290)
    (wrong,), _ = _check(tp.text_plan, tokenizer_type=hf, tokenizer_model=str(other))
    assert f"--tokenizer-model {other}: {other} (sha256" in wrong
    assert "is another tokenizer" in wrong
    (hub,), _ = _check(tp.text_plan, tokenizer_type=hf, tokenizer_model="meta-llama/Llama-3")
    assert "a hub name cannot be compared" in hub
    (gpt2,), _ = _check(tp.text_plan, tokenizer_type="GPT2BPETokenizer")
    assert gpt2.startswith("--tokenizer-type GPT2BPETokenizer: the plan")
    # A plan of token ids: Megatron-LM's tokenizer only sizes the vocabulary, as before.
    assert _check(tp.ids_plan, tokenizer_type="GPT2BPETokenizer") == ([], None)


@pytest.mark.dist
def test_the_launcher_trains_a_text_plan_as_its_token_id_twin(tmp_path: Path) -> None:
    need_megatron_training()
    tp = text_plans(tmp_path, PLAN)
    extra = ["--global-batch-size", "8", "--train-iters", "2", "--vocab-size", "320"]
    logs = {k: tmp_path / f"{k}-log.jsonl" for k in ("text", "ids")}
    ok(launch(2, tp.text_plan, tp.text, logs["text"], extra=extra))
    ok(launch(2, tp.ids_plan, tp.ids, logs["ids"], extra=extra))
    text, ids = lines(logs["text"])[0], lines(logs["ids"])[0]
    assert len(text) == 2
    assert [r["loss"] for r in text] == [r["loss"] for r in ids]
    # A vocabulary below the tokenizer's: refused before any process group, naming both.
    run = launch(2, tp.text_plan, tp.text, tmp_path / "no.jsonl",
                 extra=[*extra, "--vocab-size", "256"])
    assert run.returncode != 0
    assert "--vocab-size 256: the plan" in run.stdout + run.stderr
