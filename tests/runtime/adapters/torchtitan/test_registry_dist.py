"""torchtitan's own entry point with a plan: ``torchrun -m torchtitan.train --module
runtime.adapters.torchtitan.registry --config llama3_debugmodel --plan.path ...``.

Two real launches of ``torchtitan.train``'s ``main`` (4 gloo ranks, fp32, CPU) on a pool dp 2 x
cp 2 plan with CP groups of 1, 2 and 4 (4 steps), flags as a torchtitan user passes them:

1. torchtitan's llama3_debugmodel config as the registry gives it (selective activation
   checkpointing, clipping at 1.0, AdamW 8e-4 with weight decay), a warmup + cosine schedule
   from flags, an eval plan every 2 steps, TensorBoard, torchtitan's checkpointer saving every
   2 steps;
2. full activation checkpointing, started from launch 1's step-2 checkpoint
   (``--checkpoint.initial_load_path``) for the last 2 steps.

The oracle (``oracle.reference_of_config``: the same parsed config, one process, every segment
alone, no CP, no FSDP) runs in the test process. Every step's loss of launch 1 and of the resumed
launch 2 and every evaluation equals it to 1e-5 relative, and launch 2's losses are launch 1's
bit for bit. The refusals go through torchtitan's real ``ConfigManager`` in this process, and
one through ``python -m torchtitan.train`` (no traceback, exit status 2).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.train.runlog import TrainResult
from tests.runtime.data.test_eval_dist import _eval_lengths, write_eval_set
from tests.runtime.train.test_train_dist import _cp_sizes_used, _lengths, _plan, _write_dataset

pytest.importorskip("torchtitan")

pytestmark = [pytest.mark.slow, pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[4]
TOL = 1e-5
STEPS = 4
REGISTRY = ["--module", "runtime.adapters.torchtitan.registry", "--config", "llama3_debugmodel"]
# fp32 parameters (torchtitan's default FSDP param dtype is bf16) and a warmup + cosine decay
# to 10% (the virtual last step keeps the last rate above it): factors 0.5, 1, 1, 0.55.
SCHEDULE = ["--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2",
            "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.decay_ratio", "None",
            "--lr_scheduler.min_lr_factor", "0.1"]


def _args(tmp: Path, *extra: str, evaluate: bool = True) -> list[str]:
    # A tyro subcommand (activation_checkpoint:full) comes last: flags after it are its own.
    evaluation = ["--plan.eval_path", str(tmp / "eval-zigzag.arrow"), "--plan.eval_dataset",
                  str(tmp / "eval.arrow"), "--validator.freq", "2", "--validator.steps", "2"]
    return [*REGISTRY, "--plan.path", str(tmp / "zigzag.arrow"), "--plan.dataset",
            str(tmp / "data.arrow"), *(evaluation if evaluate else []), "--seed", "7",
            "--dump_folder", str(tmp / "out"), *SCHEDULE, *extra]


def _torchrun(tmp: Path, name: str, *extra: str) -> list[dict[str, Any]]:
    """One ``torchtitan.train`` launch on 4 ranks; rank 0's JSON lines (steps, evaluations)."""
    log = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "torchtitan.train", *_args(tmp, "--log_jsonl", str(log), "--quiet", *extra)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("registry")
    data = _write_dataset(tmp / "data.arrow", _lengths())
    _plan(tmp / "zigzag.arrow", data, "zigzag")
    write_eval_set(tmp, _eval_lengths(), layout="zigzag", name="eval-zigzag")
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    full = _torchrun(tmp, "full", *ckpt, "--checkpoint.folder", "ckpt",
                     "--metrics.enable_tensorboard")
    resumed = _torchrun(tmp, "resumed", *ckpt, "--checkpoint.folder", "ckpt2",
                        "--checkpoint.initial_load_path", str(tmp / "out" / "ckpt" / "step-2"),
                        "--checkpoint.no-initial-load-model-only", "activation_checkpoint:full")
    return tmp, {"full": full, "resumed": resumed}


def _parse(args: list[str]) -> Any:
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(args)


@pytest.fixture(scope="module")
def oracle(runs: tuple[Path, dict[str, Any]]) -> TrainResult:
    from runtime.adapters.torchtitan.oracle import reference_of_config

    return reference_of_config(_parse(_args(runs[0])))


def _steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "step" in r]


@pytest.mark.timeout(1200)
def test_every_step_equals_the_oracle(runs: tuple[Path, dict[str, Any]],
                                      oracle: TrainResult) -> None:
    tmp, out = runs
    assert _cp_sizes_used(tmp / "zigzag.arrow", STEPS) == {1, 2, 4}
    assert [r["step"] for r in _steps(out["full"])] == list(range(STEPS))
    assert [r["step"] for r in _steps(out["resumed"])] == [2, 3]
    want = {w.step: w for w in oracle.logs}
    for row in _steps(out["full"]) + _steps(out["resumed"]):
        w = want[row["step"]]
        assert row["loss_tokens"] == w.loss_tokens, row
        assert abs(row["loss"] - w.loss) <= TOL * abs(w.loss), (row, w.loss)


def test_evaluations_equal_the_oracle(runs: tuple[Path, dict[str, Any]],
                                      oracle: TrainResult) -> None:
    # --plan.eval_path with --validator.freq 2 --validator.steps 2: after steps 2 and 4
    # (0-based 1 and 3); the resumed run after its last step only (4 is also a multiple of 2).
    evals = {e.after_step: e for e in oracle.evals}
    assert sorted(evals) == [1, 3]
    got = [r for r in runs[1]["full"] + runs[1]["resumed"] if "after_step" in r]
    assert [r["after_step"] for r in got] == [1, 3, 3]
    for row in got:
        w = evals[row["after_step"]]
        assert row["eval_tokens"] == w.eval_tokens
        assert abs(row["eval_loss"] - w.eval_loss) <= TOL * abs(w.eval_loss), (row, w)


def test_torchtitans_metrics_are_written(runs: tuple[Path, dict[str, Any]]) -> None:
    # --metrics.enable_tensorboard: torchtitan's own TensorBoard logger, beside the JSON lines.
    events = list((runs[0] / "out").rglob("events.out.tfevents.*"))
    assert events
    assert all(e.stat().st_size > 0 for e in events)


def test_resume_continues_bit_for_bit(runs: tuple[Path, dict[str, Any]]) -> None:
    full = {r["step"]: r for r in _steps(runs[1]["full"])}
    for row in _steps(runs[1]["resumed"]):
        assert row["loss"] == full[row["step"]]["loss"], row
        assert row["microbatches"] == full[row["step"]]["microbatches"]


def test_the_schedule_is_torchtitans(runs: tuple[Path, dict[str, Any]]) -> None:
    from runtime.adapters.torchtitan.oracle import lr_factor

    config = _parse(_args(runs[0]))
    factors = [lr_factor(k, config.lr_scheduler, STEPS) for k in range(STEPS)]
    assert factors == pytest.approx([0.5, 1.0, 1.0, 0.55])
    # torchtitan's own scheduler, stepped as its train loop steps it.
    import torch

    from runtime.adapters.torchtitan.titan import LRSchedulersContainer

    assert isinstance(config.lr_scheduler, LRSchedulersContainer.Config)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    schedulers = config.lr_scheduler.build(optimizers=[opt], training_steps=STEPS)
    seen = []
    for _ in range(STEPS):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        schedulers.step()
    assert seen == pytest.approx(factors)


def _flat(text: str) -> str:
    """tyro's boxed error as one line."""
    return " ".join(re.sub(r"[\u2500-\u257f]", " ", text).split())


REFUSED = [
    (["--parallelism.data_parallel_shard_degree", "2"],
     "--parallelism.data_parallel_shard_degree 2 x data_parallel_replicate_degree 1 = 2 ranks,"
     " but {plan} is planned for a pool of 4 ranks"),
    (["--parallelism.context_parallel_degree", "2"],
     "--parallelism.context_parallel_degree 2: the plan's CP groups replace torchtitan's fixed "
     "cp dimension; {plan} needs 1"),
    (["--training.local_batch_size", "8"],
     "--training.local_batch_size 8: under a plan a microbatch is one packed buffer (1)"),
    (["--training.seq_len", "2048"],
     "--training.seq_len 2048: {plan} packs segments up to 128 tokens"),
    (["--training.steps", "9"], "--training.steps 9: {plan} holds 4 steps"),
    (["--training.global_batch_size", "16"], "--training.global_batch_size 16: under a plan"),
    (["--validator.enable"], "--validator.enable True: under a plan validation needs "
     "--plan.eval_path"),
]


@pytest.mark.parametrize(("flags", "message"), REFUSED)
def test_contradicting_flags_are_refused(runs: tuple[Path, dict[str, Any]], flags: list[str],
                                         message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    tmp = runs[0]
    with pytest.raises(SystemExit) as exc:
        _parse(_args(tmp, *flags, evaluate=False))
    assert exc.value.code == 2
    assert message.format(plan=tmp / "zigzag.arrow") in _flat(capsys.readouterr().err)


def test_plan_values_are_accepted_and_filled(runs: tuple[Path, dict[str, Any]]) -> None:
    config = _parse(_args(runs[0], "--training.seq_len", "128", "--training.steps", "2"))
    assert (config.training.seq_len, config.training.steps) == (128, 2)
    assert config.dataloader.plan == str(runs[0] / "zigzag.arrow")
    assert type(config.activation_checkpoint).__qualname__ == "SelectiveAC.Config"


def test_every_llama3_config_of_torchtitan_is_offered(runs: tuple[Path, dict[str, Any]]) -> None:
    import runtime.adapters.torchtitan.registry as registry
    from runtime.adapters.torchtitan.attention import PlanAttention

    assert {"llama3_debugmodel", "llama3_8b", "llama3_70b"} <= set(dir(registry))
    config = _parse([*REGISTRY[:3], "llama3_8b", "--plan.path", str(runs[0] / "zigzag.arrow"),
                     "--plan.dataset", str(runs[0] / "data.arrow")])
    assert type(config).__qualname__ == "PlanTrainer.Config"
    assert config.model_spec.flavor == "8B"
    assert all(isinstance(layer.attention.inner_attention, PlanAttention.Config)
               for layer in config.model_spec.model.layers)


def test_a_resume_with_another_lr_is_refused(runs: tuple[Path, dict[str, Any]]) -> None:
    """torchtitan restores the checkpoint's lr (optimizer groups, scheduler base rates), so
    another lr on a resume trained at the saved rate silently; now refused by the
    registry's checkpointer (``PlanCheckpointManager``) on every rank, naming the saved value."""
    tmp = runs[0]
    step = tmp / "out" / "ckpt" / "step-2"
    saved = _parse(_args(tmp)).optimizer.param_groups[0].optimizer_kwargs["lr"]
    flag = "--optimizer.param-groups.0.optimizer-kwargs.lr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "torchtitan.train",
           *_args(tmp, "--quiet", "--checkpoint.enable", "--checkpoint.folder", "ckpt3",
                  "--checkpoint.initial_load_path", str(step),
                  "--checkpoint.no-initial-load-model-only", flag, "0.5",
                  evaluate=False)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    want = (f"{step}: the checkpoint was saved with {flag} {saved:g}, this run has {flag} 0.5; "
            f"resume with {flag} {saved:g}")
    # Each rank refuses (the same groups); torchrun may stop the others before they print.
    assert want in _flat(out.stderr), out.stderr[-4000:]
    assert not (tmp / "out" / "ckpt3").exists() or not any((tmp / "out" / "ckpt3").iterdir())


def test_a_run_without_a_plan_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"--plan.path PLAN is required"):
        _parse(REGISTRY).build()


def test_refusal_from_the_command_line_is_not_a_traceback(
        runs: tuple[Path, dict[str, Any]]) -> None:
    tmp = runs[0]
    cmd = [sys.executable, "-m", "torchtitan.train",
           *_args(tmp, "--parallelism.context_parallel_degree", "4")]
    out = subprocess.run(cmd, cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "--parallelism.context_parallel_degree 4: the plan's CP groups" in _flat(out.stderr)
