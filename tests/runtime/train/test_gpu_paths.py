"""GPU paths (skipped without CUDA; ``-m gpu`` selects them): torch's varlen kernel and TE against
per-sequence attention, and 2-GPU NCCL training through each backend against the CPU oracle.

Needs no ortools (the H200 machines lack it): plans are made with ``effort="fast"``; the
packed-buffer helper comes from test_model (hypothesis, which the H200 image has). Run there
with ``python3 -m pytest -q -m gpu tests/runtime/train/test_gpu_paths.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.groups import ZIGZAG
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.attention.torch_varlen import TorchCPAttention
from runtime.train import Trainer, TrainResult
from runtime.train.model import GPT, AttentionFn, GPTConfig, sequence_attention
from tests.dist import run_distributed
from tests.runtime.train.test_model import _packed
from tests.runtime.train.test_train_dist import (
    MODEL,
    STEPS,
    _cfg,
    _cp_sizes_used,
    _lengths,
    _reference,
    _write_dataset,
)

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_packed_vs_alone(bind: Callable[[torch.Tensor, torch.Tensor], AttentionFn]) -> None:
    """bf16: the packed forward through ``bind``'s attention equals each sequence alone."""
    config = GPTConfig(vocab_size=97, num_layers=2, hidden_size=128, num_heads=4,
                       num_query_groups=2)
    model = GPT(config, seed=1).cuda()
    seqs, tokens, positions, cu, cu_pad = _packed([5, 90, 1, 33], pad_to=8)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model(tokens.cuda(), positions.cuda(), bind(cu_pad.cuda(), cu.cuda()))
        for s, start in zip(seqs, cu_pad[:-1].tolist(), strict=True):
            alone = model(s.cuda(), torch.arange(len(s), device="cuda"), sequence_attention)
            torch.testing.assert_close(packed[start:start + len(s)].float(), alone.float(),
                                       rtol=3e-2, atol=3e-2)


@needs_cuda
def test_varlen_kernel_matches_sequence_attention_on_cuda() -> None:
    attn = TorchCPAttention(ZIGZAG)
    _cuda_packed_vs_alone(lambda cu_pad, cu: attn.bind(cu_pad, cu, 1, 0, None,
                                                       torch.device("cuda")))


@needs_cuda
def test_te_attention_matches_sequence_attention_on_cuda() -> None:
    from runtime.attention import te as te_adapter

    if not te_adapter.te_available():
        pytest.skip("Transformer Engine is not importable")
    modules = [te_adapter.TEAttention(num_heads=4, head_dim=32, num_query_groups=2)
               for _ in range(2)]

    def bind(cu_pad: torch.Tensor, cu: torch.Tensor) -> AttentionFn:
        packed = SimpleNamespace(cu_seqlens=cu.int(), cu_seqlens_padded=cu_pad.int(),
                                 max_seqlen=int((cu_pad[1:] - cu_pad[:-1]).max()))
        return lambda q, k, v, i: modules[i](q, k, v, packed)

    _cuda_packed_vs_alone(bind)


def _gpu_rank_fn(rank: int, world_size: int, store: str, tmp: str, attention: str) -> TrainResult:
    cfg = _cfg(Path(tmp) / "pool2.arrow", Path(tmp) / "data.arrow", device="cuda",
               attention=attention, dtype="bf16")
    return Trainer(cfg, MODEL).run(keep_state=rank == 0)


@needs_cuda
@pytest.mark.parametrize("attention", ["torch", "te", "reference"])
def test_gpu_paths_match_reference(tmp_path: Path, attention: str) -> None:
    """2 GPUs over NCCL, bf16, pool 2 with CP 1 and 2 groups: close to the fp32 CPU oracle."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if attention == "te":
        from runtime.attention.te import te_available

        if not te_available():
            pytest.skip("Transformer Engine is not importable")
    data = _write_dataset(tmp_path / "data.arrow", _lengths())
    config = PlannerConfig(parallel=ParallelConfig(dp=1, cp=2), capacity_tokens_per_rank=64,
                           global_batch_size=12, seed=3, effort="fast")
    plan = make_plan(read_lengths(data), config, load_cost_model("default"))
    write_plan(tmp_path / "pool2.arrow", plan.header, plan.record_batches())
    assert _cp_sizes_used(tmp_path / "pool2.arrow", STEPS) == {1, 2}
    got = run_distributed(_gpu_rank_fn, 2, str(tmp_path), attention, backend="nccl",
                          timeout=300)[0]
    ref = _reference(_cfg(tmp_path / "pool2.arrow", data))
    for g, w in zip(got.logs, ref.logs, strict=True):
        assert g.loss_tokens == w.loss_tokens
        assert abs(g.loss - w.loss) <= 2e-2 * w.loss, (g.step, g.loss, w.loss)
    for name, want in ref.grads.items():
        cos = torch.nn.functional.cosine_similarity(got.grads[name].flatten(), want.flatten(),
                                                    dim=0)
        assert cos > 0.98, (name, float(cos))
