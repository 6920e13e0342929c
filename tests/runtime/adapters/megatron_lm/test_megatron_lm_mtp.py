"""Multi-token prediction through Megatron-LM's own ``pretrain()`` (megatron-core 0.19.2's
wheel) with a plan whose microbatches use CP groups of 1, 2 and 4 ranks, on 4 gloo ranks,
against the launcher's one-process oracle (every segment alone: relative 1e-5 on every step's
loss, gradient norm and each depth's MTP loss; Megatron-LM's printed per-depth losses are the
same). Skipped without a supported ``megatron.training``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.runtime.adapters.megatron_lm.launch import (
    assert_same_steps,
    close,
    launch,
    lines,
    make_data,
    need_megatron_training,
    ok,
    reference,
)

pytestmark = [pytest.mark.slow, pytest.mark.dist]

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    need_megatron_training()
    return make_data(tmp_path_factory.mktemp("megatron_lm_mtp"))


def test_mtp_pool_of_4_with_cp_1_2_4_equals_the_oracle(data: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """Each microbatch's shift map and CP group bound into the MTP rolls (``binding.mtp``);
    the MTP term in the gradient (weight 0.3 / 2 per depth)."""
    run = launch(4, data["pool4"], data["data"], tmp_path / "run.jsonl", extra=MTP)
    ok(run)
    ok(reference(data["pool4"], data["data"], tmp_path / "ref.jsonl", extra=MTP))
    got, want = lines(tmp_path / "run.jsonl")[0], lines(tmp_path / "ref.jsonl")[0]
    assert_same_steps(got, want)
    for g, w in zip(got, want, strict=True):
        assert len(g["mtp_loss"]) == 2
        for a, b in zip(g["mtp_loss"], w["mtp_loss"], strict=True):
            assert close(a, b), (g, w)
    # Megatron-LM's line prints each depth's per-token loss (its second line averages the
    # first two iterations, as its lm loss: docs/megatron-lm.md).
    for d in (1, 2):
        printed = [float(m) for m in re.findall(rf"\| mtp_{d} loss: ([0-9.E+-]+) \|",
                                                run.stdout)]
        values = [g["mtp_loss"][d - 1] for g in got]
        assert len(printed) == 3, run.stdout[-3000:]
        for value, want_value in zip(printed, [values[0], (values[0] + values[1]) / 2,
                                               values[2]], strict=True):
            assert close(value, want_value, 1e-5), (d, value, want_value)
