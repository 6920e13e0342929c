"""docs/megatron-lm.md: its CPU example runs as written (4 gloo ranks through the real
``pretrain()`` of megatron-core 0.19.2 with the project's driver, then the oracle, then a script
of one's own that calls ``install()``), the three logs agree, and the page names every flag the
launcher refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.adapters.megatron_lm import flags
from tests.runtime.adapters.megatron_lm.launch import close, need_megatron_training
from tests.test_readme import ROOT, block, checkout, run_bash

__all__ = ["checkout"]  # the fixture, imported for this module's tests

PAGE = "docs/megatron-lm.md"


def test_the_page_names_every_refused_flag() -> None:
    text = (ROOT / PAGE).read_text()
    for flag, _, _ in flags.REFUSED:
        assert f"`{flag}`" in text, flag


@pytest.mark.slow
@pytest.mark.dist
def test_cpu_example_runs_and_matches_its_oracle(checkout: Path) -> None:
    need_megatron_training()
    (checkout / ".mcore-0.19.2").symlink_to(ROOT / ".mcore-0.19.2")
    (checkout / "my_megatron_lm_job.py").write_text(block(PAGE, "On the CPU", "python"))
    run_bash(block(PAGE, "On the CPU", "bash"), checkout)

    def steps(name: str) -> list[dict[str, float]]:
        rows = (checkout / "runs" / name).read_text().splitlines()
        return [json.loads(r) for r in rows if '"step"' in r]

    want = steps("mlm-reference.jsonl")
    assert [w["step"] for w in want] == [0, 1, 2]
    for g, w in zip(steps("mlm-train.jsonl") + steps("mlm-own.jsonl"), want * 2, strict=True):
        assert g["loss_tokens"] == w["loss_tokens"]
        assert close(g["loss"], w["loss"]), (g, w)
        assert close(g["grad_norm"], w["grad_norm"]), (g, w)
