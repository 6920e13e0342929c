"""torchtitan's own tokenizer config (``hf_assets_path`` + ``HuggingFaceTokenizer``) on a text plan.

A torchtitan user's job names its tokenizer folder in ``hf_assets_path``; torchtitan builds a
``HuggingFaceTokenizer`` from it and hands it to the data loader. When that folder holds the
plan's ``tokenizer.json`` (same sha256), ``PlanDataLoader`` tokenizes with it (here the recorded
path is gone, so only torchtitan's config can find it); another tokenizer is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runtime.data.plan_reader import PlanReader
from tests.dist import run_distributed
from tests.text.bpe import train_bpe
from tests.text.plans import text_plans
from tests.text.test_text_train import PLAN, TRAIN, _cli, _losses

pytest.importorskip("torchtitan")


def _own_tokenizer_run(rank: int, world_size: int, store: str, argv: list[str],
                       folder: str) -> None:
    """``dcp-train --framework torchtitan ARGV`` with torchtitan's tokenizer from ``folder``."""
    del rank, world_size, store
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from runtime.adapters.torchtitan.config import trainer_config
    from runtime.adapters.torchtitan.trainer import PlanTrainer
    from runtime.train.cli import parse_args

    cfg, model_config, _, _ = parse_args(argv)
    config = trainer_config(cfg, model_config)
    config.hf_assets_path = folder
    config.tokenizer = HuggingFaceTokenizer.Config()
    trainer = PlanTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()


@pytest.mark.dist
def test_torchtitans_hf_tokenizer_of_the_plans_file_is_used(tmp_path: Path) -> None:
    tp = text_plans(tmp_path, PLAN)
    moved = tmp_path / "assets"
    shutil.copytree(tp.tokenizer.parent, moved)
    shutil.rmtree(tp.tokenizer.parent)  # the recorded path is gone
    logs = {k: tmp_path / f"{k}.log" for k in ("text", "ids")}
    argv = ["--plan", str(tp.text_plan), *TRAIN, "--framework", "torchtitan", "--log-jsonl",
            str(logs["text"])]
    run_distributed(_own_tokenizer_run, 2, argv, str(moved), timeout=400)
    assert run_distributed(_cli, 2, ["--plan", str(tp.ids_plan), *TRAIN, "--framework",
                                     "torchtitan", "--log-jsonl", str(logs["ids"])],
                           timeout=400) == [0, 0]
    assert len(_losses(logs["text"])) == 2
    assert _losses(logs["text"]) == _losses(logs["ids"])


def test_another_hf_tokenizer_is_refused(tmp_path: Path) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from runtime.adapters.torchtitan.data import text_tokenizer

    tp = text_plans(tmp_path, PLAN)
    same = HuggingFaceTokenizer(tokenizer_path=str(tp.tokenizer.parent))
    other = HuggingFaceTokenizer(tokenizer_path=str(train_bpe(tmp_path / "o", vocab_size=290)
                                                    .parent))
    with PlanReader(tp.text_plan) as r:
        assert text_tokenizer(r, None, same) == str(tp.tokenizer)
        assert text_tokenizer(r, "given", same) == "given"
        with pytest.raises(ValueError, match=r"torchtitan's tokenizer .*o/tokenizer.json "
                           r"\(hf_assets_path\) is not the one the plan was made with"):
            text_tokenizer(r, None, other)
    with PlanReader(tp.ids_plan) as r:  # a plan of token ids: torchtitan's tokenizer is unused
        assert text_tokenizer(r, None, other) is None


def test_the_registry_path_takes_hf_assets_path_when_it_holds_the_plans_tokenizer(
        tmp_path: Path) -> None:
    """``torchrun -m torchtitan.train --module runtime.adapters.torchtitan.registry ...
    --plan.path TEXT_PLAN --hf_assets_path DIR``: torchtitan's own flag names the tokenizer."""
    from runtime.adapters.torchtitan import registry
    from runtime.adapters.torchtitan.section import PlanSection, apply_plan

    tp = text_plans(tmp_path, PLAN)
    other = train_bpe(tmp_path / "o", vocab_size=290)

    def applied(assets: str, tokenizer: str = "") -> str | None:
        config = registry.llama3_debugmodel()
        config.plan = PlanSection(path=str(tp.text_plan), dataset=str(tp.text),
                                  tokenizer=tokenizer)
        config.hf_assets_path = assets
        apply_plan(config)
        return config.dataloader.tokenizer_path  # type: ignore[no-any-return]

    assert applied(str(tp.tokenizer.parent)) == str(tp.tokenizer)
    assert applied(".") is None  # the registry's default: the plan's recorded path
    assert applied(str(other.parent), tokenizer=str(tp.tokenizer)) == str(tp.tokenizer)
    with pytest.raises(ValueError, match=r"--hf_assets_path .*o: holds another tokenizer.json"):
        applied(str(other.parent))
