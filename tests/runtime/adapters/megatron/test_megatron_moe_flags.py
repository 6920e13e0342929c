"""MoE and MTP flags: parsed into ``MegatronOptions``, refused where the adapter cannot run
them (with what to use instead), on every rank; the padding mask's convention at the boundary.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from runtime.train.cli import parse_args
from runtime.train.megatron_options import MegatronOptions
from tests.dist import run_distributed
from tests.runtime.adapters.megatron.harness import MODEL, lengths, plan, write_dataset

PLAN = "--plan p.arrow --dataset d.jsonl --framework megatron"


def _parse(extra: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(shlex.split(f"{PLAN} {extra}"))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_moe_and_mtp_flags_are_megatrons() -> None:
    cfg, _, _, _ = parse_args(shlex.split(
        f"{PLAN} --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 "
        "--moe-router-load-balancing-type seq_aux_loss --moe-ffn-hidden-size 96 "
        "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3"))
    assert cfg.megatron == MegatronOptions(
        num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="seq_aux_loss", moe_ffn_hidden_size=96,
        mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    assert cfg.megatron.load_balancing == "seq_aux_loss"


@pytest.mark.parametrize(("flags", "says"), [
    ("--num-experts 4 --expert-model-parallel-size 2", "expert parallelism is not supported"),
    ("--num-experts 4 --moe-expert-capacity-factor 1.25", "routing is dropless"),
    ("--num-experts 4 --moe-z-loss-coeff 1e-3", "z-loss is not handled under dynamic CP"),
    ("--num-experts 4 --moe-router-enable-expert-bias", "global_aux_loss"),
    ("--num-experts 4 --moe-token-dispatcher-type allgather", "alltoall"),
    ("--num-experts 4 --moe-grouped-gemm", "SequentialMLP"),
    ("--num-experts 4 --moe-router-load-balancing-type sinkhorn", "invalid choice"),
    ("--moe-router-topk 3", "MoE options; set --num-experts"),
    ("--num-experts 4 --moe-router-topk 5", "--moe-router-topk must be in 1..4"),
])
def test_unsupported_moe_flags_are_refused_with_what_to_use(
        flags: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert says in _parse(flags, capsys)


def test_other_engines_refuse_moe_and_mtp(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in ("--num-experts 4", "--mtp-num-layers 1"):
        with pytest.raises(SystemExit):
            parse_args(shlex.split(f"--plan p.arrow --dataset d.jsonl {flags}"))
        assert "use them with --framework megatron" in capsys.readouterr().err


def _refusal_rank(rank: int, world: int, store: str, plan_path: str, data: str,
                  fields: dict[str, Any]) -> str:
    del rank, world, store
    from runtime.adapters.megatron import PlanJob
    from runtime.adapters.megatron.model.gpt import shape_fields

    job = PlanJob(plan_path, data)
    try:
        job.transformer_config(**shape_fields(MODEL), num_moe_experts=4, moe_router_topk=2,
                               **fields)
    except ValueError as e:
        return str(e)
    finally:
        job.close()
    return ""


def test_plan_job_refuses_on_every_rank(tmp_path: Path) -> None:
    # PlanJob's own users get the same refusals as dcp-train's, before the model exists.
    data = write_dataset(tmp_path / "data.arrow", lengths(long=0), MODEL.vocab_size)
    p = plan(tmp_path / "plan.arrow", data, capacity=32, batch=12, dp=1, cp=2)
    fields = {"moe_expert_capacity_factor": 1.0, "moe_z_loss_coeff": 1e-3,
              "expert_model_parallel_size": 2, "mtp_num_layers": 1}
    got = run_distributed(_refusal_rank, 2, str(p), str(data), fields, timeout=300)
    assert got[0] == got[1]
    for name in fields:
        assert f"{name}=" in got[0], got[0]
    assert "set None" in got[0]
    assert "set 1" in got[0]


def test_mtp_the_adapter_cannot_run_is_refused_with_what_to_use() -> None:
    # From PlanJob.transformer_config on every rank, as the MoE refusals (above).
    from types import SimpleNamespace

    from runtime.adapters.megatron.binding import mtp

    config = SimpleNamespace(mtp_num_layers=2, pipeline_model_parallel_layout=None,
                             mtp_use_repeated_layer=False)
    mtp.check_config(config, tp=1, vpp=1)  # what the tests run
    with pytest.raises(ValueError, match="multi-token prediction the adapter cannot run") as e:
        mtp.check_config(config, tp=2, vpp=2)
    assert "tensor_model_parallel_size" in str(e.value)
    assert "plan with --tp 1" in str(e.value)
    assert "plan without --vpp" in str(e.value)


def _mask_rank(rank: int, world: int, store: str) -> dict[str, Any]:
    del rank, world, store
    import torch

    from runtime.adapters.megatron.binding import moe
    from runtime.adapters.megatron.compat import mcore

    real = torch.tensor([True, True, False])
    installed = (moe.mask_marks_padding(), moe.megatron_padding_mask(real).tolist())
    # A release whose code read True as a real token would get the mask as it is.
    original = mcore.moe_utils.compute_routing_scores_for_aux_loss

    def flipped(logits: Any, topk: int, score: str, fused: bool = False,
                padding_mask: Any = None) -> Any:
        return original(logits, topk, score, fused=fused, padding_mask=~padding_mask)

    mcore.moe_utils.compute_routing_scores_for_aux_loss = flipped
    moe.mask_marks_padding.cache_clear()
    try:
        other = (moe.mask_marks_padding(), moe.megatron_padding_mask(real).tolist(),
                 moe.real_tokens(moe.megatron_padding_mask(real)).tolist())
    finally:
        mcore.moe_utils.compute_routing_scores_for_aux_loss = original
        moe.mask_marks_padding.cache_clear()
    return {"installed": installed, "other": other, "version": mcore.VERSION}


def test_padding_mask_convention_is_probed_from_megatrons_code() -> None:
    # 0.16.1 and 0.19.2 treat True as padding in router.py / moe_utils.py (some docstrings say
    # the opposite); our batches mark real tokens True; the boundary converts either way.
    (got,) = run_distributed(_mask_rank, 1, backend=None, timeout=300)
    assert got["installed"] == (True, [False, False, True]), got
    assert got["other"] == (False, [True, True, False], [True, True, False]), got


def test_router_gemm_on_cpu_without_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TE installed (the GPU machines), moe_utils computed the router's logits through TE's
    GEMM, which takes only CUDA tensors: the CPU oracle beside a GPU run failed. TE does not
    install here, so its GEMM is stood in for by one that refuses CPU tensors as TE's does; after
    the patch the CPU router's product is torch's, gradients included."""
    import torch

    from runtime.adapters.megatron.compat import cpu_patches, mcore

    def te_gemm(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDAGuardImpl initialized with non-CUDA DeviceType: cpu")

    monkeypatch.setattr(mcore.moe_utils, "te_general_gemm", te_gemm, raising=False)
    inp = torch.randn(5, 8, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(4, 8, dtype=torch.float32, requires_grad=True)
    with pytest.raises(RuntimeError, match="non-CUDA"):
        mcore.moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    cpu_patches.router_gemm_without_te()
    out = mcore.moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.t(), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    torch.testing.assert_close(inp.grad, weight.detach().sum(0).expand(5, 8))
    torch.testing.assert_close(weight.grad, inp.detach().sum(0).expand(4, 8))
