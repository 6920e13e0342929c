"""Memory before launch, runtime side (issue 33, item 5): ``dcp-train`` refuses, before its first
step, a plan whose heaviest microbatch would not fit the host, naming the step, the microbatch
and both figures; and the estimate's O(L^2) term is what the CPU reference attention holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.data.plan_reader import PlanReader
from runtime.train import main
from runtime.train.memcheck import memory_model
from runtime.train.model import GPTConfig
from tests.runtime.train.test_train_dist import _write_dataset

ROOT = Path(__file__).resolve().parents[3]


def _long_document_plan(tmp_path: Path) -> tuple[Path, Path]:
    """(dataset, plan): 300,000 tokens on one CPU rank, whose L x L scores alone would be
    terabytes, among three short documents."""
    data = _write_dataset(tmp_path / "data.arrow", np.array([40, 300_000, 25, 60]))
    config = PlannerConfig(parallel=ParallelConfig(dp=1, cp=1),
                           capacity_tokens_per_rank=1 << 19, global_batch_size=4)
    plan = make_plan(read_lengths(data), config, load_cost_model("default"))
    return data, write_plan(tmp_path / "plan.arrow", plan.header, plan.record_batches())


def test_a_long_document_is_refused_before_the_first_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, path = _long_document_plan(tmp_path)
    cols = PlanReader(path).columns(0)
    mb = int(cols["microbatch"][np.flatnonzero(cols["sample_index"] == 1)[0]])
    log = tmp_path / "train.jsonl"
    assert main(["--plan", str(path), "--dataset", str(data), "--vocab-size", "64",
                 "--hidden-size", "32", "--quiet", "--log-jsonl", str(log)]) == 2
    err = capsys.readouterr().err
    want = memory_model(GPTConfig(vocab_size=64, hidden_size=32), "reference",
                        torch.device("cpu")).group_peaks(
        np.array([1]), np.array([300_000]), np.array([300_000.0**2]), np.array([300_000]))[0]
    assert (f"step 0 microbatch {mb} (CP group of 1 at rank 0, longest sequence 300,000 "
            f"padded tokens of sample 1) needs about {want / 2**30:.2f} GiB per rank, more than "
            f"this host's available memory shared by its 1 rank(s) (") in err
    assert "--no-memory-check" in err
    assert log.read_text() == ""  # refused before any step ran


PROBE = """
import numpy as np, torch, torch.nn.functional as F
from runtime.train.model import GPT, GPTConfig
from runtime.attention.reference import local_attention
from runtime.calibrate.memory import reset_peak_rss, peak_rss
torch.set_num_threads(1)
model = GPT(GPTConfig(vocab_size=256, num_layers=LAYERS, hidden_size=64, num_heads=4), seed=0)
def peak(lengths):
    cu = torch.tensor(np.r_[0, np.cumsum(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    tok = torch.randint(0, 256, (len(pos),))
    reset_peak_rss()
    logits = model(tok, pos, lambda q, k, v, i: local_attention(q, k, v, cu, cu))
    F.cross_entropy(logits, tok, reduction="sum").backward()
    return peak_rss()
peak([256, 256])
short = peak([128] * 32)
print(peak([4096]) - short)
"""


@pytest.mark.parametrize("layers", [2, 4])
def test_the_quadratic_term_is_what_the_reference_attention_holds(layers: int) -> None:
    """One 4,096-token sequence against 32 of 128 (the same tokens): the difference is the
    scores, (layers + 2) fp32 copies of 4 heads x 4096^2, within 10%."""
    out = subprocess.run([sys.executable, "-c", PROBE.replace("LAYERS", str(layers))],
                         capture_output=True, text=True, cwd=ROOT, check=True, timeout=300)
    measured = int(out.stdout.split()[-1])
    model = memory_model(GPTConfig(vocab_size=256, num_layers=layers, hidden_size=64),
                         "reference", torch.device("cpu"))
    predicted = model.per_score * (model.held + model.transient) * (4096**2 - 32 * 128**2)
    assert measured == pytest.approx(predicted, rel=0.1), (measured, predicted)


def test_the_adapters_entry_skips_what_the_estimate_does_not_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``check_adapter_memory`` (the adapters' entry): a run the estimate cannot judge (TP or
    PP) gets a one-line notice and runs; the same run judged is refused; and nothing at all
    with ``--no-memory-check``."""
    from dataclasses import replace

    from runtime.train.config import TrainConfig
    from runtime.train.memcheck import check_adapter_memory

    data, path = _long_document_plan(tmp_path)
    cfg = TrainConfig(plan=str(path), dataset=str(data))
    model, cpu = GPTConfig(vocab_size=64, hidden_size=32), torch.device("cpu")
    with PlanReader(path) as reader:
        check_adapter_memory(cfg, reader, model, cpu, range(1), unmodelled="tp 2")
        assert capsys.readouterr().err == ("dcp-train: memory check skipped: planner/memory.py "
                                           "does not model tp 2 (--no-memory-check silences "
                                           "this)\n")
        with pytest.raises(ValueError, match="step 0 microbatch .* needs about"):
            check_adapter_memory(cfg, reader, model, cpu, range(1))
        check_adapter_memory(replace(cfg, memory_check=False), reader, model, cpu, range(1),
                             unmodelled="tp 2")
        assert capsys.readouterr().err == ""
