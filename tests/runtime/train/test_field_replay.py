"""A plan made with ``dcp-plan --field NAME`` replays with no repeated flag.

The plan records the field (header ``dataset.field``); every reader of the dataset for a plan
(``open_plan_source``: the native trainer, its oracle, the evaluators, the Megatron and torchtitan
adapters; and ``dcp-plan validate``) reads it. The datasets here hold the training tokens under
``ids`` and *other* tokens of the same lengths under ``input_ids`` (the default field): a
runtime that ignored the recorded field would pass the lengths fingerprint and train on the
wrong tokens, so equal losses with a control dataset (the same tokens under ``input_ids``,
planned without ``--field``) prove which field was read.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from planner.cli import main as plan_main
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import PlanFile, write_plan
from planner.planfile.schema import PlanHeader
from planner.sources.lengths import read_lengths
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.data.tokens import read_segments
from runtime.train.cli import main as train_main
from tests.dist import run_distributed

VOCAB = 64
# Pool 2 (dp 1 x cp 2), C = 32: samples up to 60 tokens, so groups of 1 and of 2 ranks.
PLAN = ["--dp", "1", "--cp", "2", "--max-tokens-per-rank", "32", "--global-batch-size", "8",
        "--seed", "3", "--quiet"]
TRAIN = ["--vocab-size", str(VOCAB), "--hidden-size", "32", "--heads", "4", "--query-groups",
         "2", "--layers", "2", "--seed", "7", "--lr", "3e-3", "--steps", "2", "--quiet"]
TOL = 1e-5


def _seqs(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(3, 60, 24)]


def _datasets(d: Path) -> tuple[Path, Path]:
    """(``ids`` dataset with a same-length decoy under ``input_ids``, control dataset)."""
    tokens, decoy = _seqs(1), _seqs(1)
    decoy = [[(t + 1) % VOCAB for t in s] for s in decoy]
    field = d / "ids.jsonl"
    field.write_text("".join(json.dumps({"input_ids": x, "ids": t}) + "\n"
                             for t, x in zip(tokens, decoy, strict=True)))
    control = d / "control.jsonl"
    control.write_text("".join(json.dumps({"input_ids": t}) + "\n" for t in tokens))
    return field, control


def _losses(log: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in log.read_text().splitlines() if '"step"' in x]


def _cli(rank: int, world_size: int, store: str, argv: list[str]) -> int:
    del rank, world_size, store
    return train_main(argv)


def _plans(tmp: Path, *extra: str) -> tuple[Path, Path, Path, Path]:
    data, control = _datasets(tmp)
    plan, control_plan = tmp / "ids.arrow", tmp / "control.arrow"
    assert plan_main([str(data), "--field", "ids", "-o", str(plan), *PLAN, *extra]) == 0
    assert plan_main([str(control), "-o", str(control_plan), *PLAN, *extra]) == 0
    return data, control, plan, control_plan


def test_the_plan_records_the_field_and_default_plans_keep_their_bytes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, control, plan, control_plan = _plans(tmp_path)
    capsys.readouterr()
    assert plan_main([str(data), "--field", "ids", "-o", str(tmp_path / "again.arrow"),
                      *PLAN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset"]["field"] == "ids"
    assert (tmp_path / "again.arrow").read_bytes() == plan.read_bytes()  # deterministic
    with PlanFile(plan) as f:
        assert f.header.dataset.field == "ids"
        assert json.loads(f.header.to_json())["dataset"]["field"] == "ids"
        assert PlanHeader.from_json(f.header.to_json()).dataset.field == "ids"
    with PlanFile(control_plan) as f:
        assert f.header.dataset.field == ""
        assert "field" not in json.loads(f.header.to_json())["dataset"]
    # Same lengths, same flags: the same steps, byte for byte (only the headers differ).
    with PlanFile(plan) as a, PlanFile(control_plan) as b:
        assert a.num_steps == b.num_steps
        for i in range(a.num_steps):
            assert a.step(i).equals(b.step(i))


def _eval_plans(tmp: Path, data: Path, control: Path) -> tuple[list[str], list[str]]:
    """``--eval-plan`` flags for the ids dataset and for the control (made with ``--eval``)."""
    ev, control_ev = tmp / "ids-eval.arrow", tmp / "control-eval.arrow"
    flags = [f for f in PLAN if f not in ("--seed", "3")]
    assert plan_main([str(data), "--field", "ids", "--eval", "-o", str(ev), *flags]) == 0
    assert plan_main([str(control), "--eval", "-o", str(control_ev), *flags]) == 0
    return (["--eval-plan", str(ev), "--eval-dataset", str(data)],
            ["--eval-plan", str(control_ev), "--eval-dataset", str(control)])


def _evals(log: Path) -> list[float]:
    return [json.loads(x)["eval_loss"] for x in log.read_text().splitlines() if "eval_loss" in x]


def _replay_and_compare(tmp: Path, framework: str) -> tuple[Path, Path]:
    """2 ranks and the oracle of ``framework`` on the ids plan (training and evaluation), and the
    oracle on the control: the same losses. Returns (the ids dataset, its plan)."""
    data, control, plan, control_plan = _plans(tmp, "--fingerprint", "content")
    with PlanReader(plan) as reader:
        assert {int(k) for i in range(2) for k in reader.step(i).group_cp_size} == {1, 2}
    ev, control_ev = _eval_plans(tmp, data, control)
    train = [*TRAIN, "--framework", framework]
    logs = {name: tmp / f"{name}.log" for name in ("ranks", "oracle", "control")}
    # No --dataset, no --field: the plan's header names both.
    assert run_distributed(_cli, 2, ["--plan", str(plan), *train, *ev, "--log-jsonl",
                                     str(logs["ranks"])], timeout=400) == [0, 0]
    # The oracles in fresh processes (the frameworks keep global state between runs).
    for name, argv in (("oracle", ["--plan", str(plan), *ev]),
                       ("control", ["--plan", str(control_plan), *control_ev])):
        assert run_distributed(_cli, 1, [*argv, *train, "--reference", "--log-jsonl",
                                         str(logs[name])], backend=None, timeout=400) == [0]
    got, want = _losses(logs["ranks"]), _losses(logs["oracle"])
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOL * abs(w), (g, w)
    got_eval, want_eval = _evals(logs["ranks"]), _evals(logs["oracle"])
    assert len(got_eval) == len(want_eval) == 1
    assert abs(got_eval[0] - want_eval[0]) <= TOL * abs(want_eval[0])
    # The oracle read the ids, not the decoy under input_ids (the control's tokens).
    assert want == _losses(logs["control"])
    assert want_eval == _evals(logs["control"])
    return data, plan


@pytest.mark.dist
def test_two_ranks_replay_a_field_plan_as_the_oracle_does(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    data, plan = _replay_and_compare(tmp_path, "native")
    capsys.readouterr()
    # An override is read (with a notice): here the decoy, of the same lengths, which the
    # content fingerprint refuses; a lengths-only plan would train on it, as the user asked.
    assert train_main(["--plan", str(plan), *TRAIN, "--reference", "--field", "input_ids"]) == 2
    err = capsys.readouterr().err
    assert (f"dcp-train: notice: reading field 'input_ids' (--field), not field 'ids' that "
            f"{plan} was made with") in err
    assert f"the tokens of {data} (content fingerprint" in err
    assert "Traceback" not in err


@pytest.mark.dist
@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_framework_engines_replay_a_field_plan(tmp_path: Path, framework: str) -> None:
    """Megatron-core's schedules and torchtitan's trainer (and each one's oracle and evaluator)
    read the recorded field through the same ``open_plan_source``."""
    pytest.importorskip("megatron.core" if framework == "megatron" else "torchtitan")
    _replay_and_compare(tmp_path, framework)


def _old_plan(tmp: Path, data: Path) -> Path:
    """What a dcp-plan that did not record --field wrote: planned on ``ids``, no dataset.field."""
    table = replace(read_lengths(data, field="ids"), field=None)
    config = PlannerConfig(parallel=ParallelConfig(dp=1, cp=2), capacity_tokens_per_rank=32,
                           global_batch_size=8, seed=3)
    made = make_plan(table, config, load_cost_model("default"))
    assert "field" not in json.loads(made.header.to_json())["dataset"]
    return write_plan(tmp / "old.arrow", made.header, made.record_batches())


@pytest.mark.dist
def test_missing_or_wrong_field_is_a_clear_error_and_nothing_is_overwritten(
        tmp_path: Path) -> None:
    ids_only = tmp_path / "only.jsonl"
    ids_only.write_text("".join(json.dumps({"ids": t}) + "\n" for t in _seqs(1)))
    old = _old_plan(tmp_path, ids_only)
    log, ckpt = tmp_path / "mine.jsonl", tmp_path / "ckpt"
    # An earlier run's log (a file that is not a log would be refused before anything else).
    earlier = '{"step": 0, "loss": 4.1, "microbatches": 1}\n'
    log.write_text(earlier)
    ckpt.mkdir()
    (ckpt / "keep").write_text("mine")
    common = [*TRAIN, "--dataset", str(ids_only), "--log-jsonl", str(log), "--save", str(ckpt)]
    # Two ranks, no field in the header, none given: both refuse alike, before any step.
    errors = run_distributed(_cli_error, 2, ["--plan", str(old), *common], timeout=240)
    assert errors[0] == errors[1]
    assert f"{ids_only}:1: no usable field (one of 'input_ids', 'tokens', 'length', " \
           "'num_tokens')" in errors[0]
    assert f"{old} records no --field" in errors[0]
    assert "give the same --field NAME" in errors[0]
    # A wrong --field names the file and line too; the plan's own header field is not blamed.
    wrong = run_distributed(_cli_error, 2, ["--plan", str(old), *common, "--field", "tokens"],
                            timeout=240)
    assert f"{ids_only}:1: no 'tokens' field (or it is null)" in wrong[0]
    assert "records no --field" not in wrong[0]
    assert log.read_text() == earlier
    assert sorted(p.name for p in ckpt.iterdir()) == ["keep"]
    # With the field it replays (the same flag a plan made today no longer needs).
    assert train_main(["--plan", str(old), *TRAIN, "--dataset", str(ids_only), "--reference",
                       "--field", "ids"]) == 0


def _cli_error(rank: int, world_size: int, store: str, argv: list[str]) -> str:
    """``dcp-train ARGV`` on this rank; its stderr when it exits 2 (else a failure)."""
    del rank, world_size, store
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = train_main(argv)
    assert rc == 2, err.getvalue()
    assert "Traceback" not in err.getvalue()
    return err.getvalue()


def test_a_field_of_lengths_plans_but_does_not_replay(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The rule stays: a plan made from lengths (here ``--field n``, integers) cannot be trained
    on that file; the error says so at start-up and how to train on the tokenized data."""
    seqs = _seqs(1)
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text("".join(json.dumps({"n": len(t)}) + "\n" for t in seqs))
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text("".join(json.dumps({"ids": t}) + "\n" for t in seqs))
    plan = tmp_path / "lengths.arrow"
    assert plan_main([str(lengths), "--field", "n", "-o", str(plan), *PLAN]) == 0
    capsys.readouterr()
    assert train_main(["--plan", str(plan), *TRAIN, "--reference"]) == 2
    err = capsys.readouterr().err
    assert (f"{lengths}: record of sample 0 (line 1, byte 0) does not decode: no token list "
            "under 'n'") in err
    assert f"{plan} was made with --field 'n', which holds lengths" in err
    assert "--dataset TOKENIZED --field ITS_TOKEN_FIELD" in err
    # That is the way: the tokenized file, same samples, its token field named.
    assert train_main(["--plan", str(plan), *TRAIN, "--reference", "--dataset", str(tokens),
                       "--field", "ids"]) == 0


def _write_columnar(path: Path, tokens: list[list[int]], decoy: list[list[int]]) -> Path:
    table = pa.table({"input_ids": pa.array(decoy, pa.list_(pa.int32())),
                      "ids": pa.array(tokens, pa.list_(pa.int32()))})
    pq.write_table(table, path, row_group_size=8)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
def test_content_fingerprint_and_validate_use_the_recorded_field(
        tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--fingerprint content`` with ``--field``: the start-up check and ``dcp-plan validate
    PLAN DATASET`` hash the recorded field (the decoy under ``input_ids`` has the same lengths,
    so reading the default field would fail the check), and refuse an edited token of it."""
    import gzip

    tokens, decoy = _seqs(1), [[(t + 1) % VOCAB for t in s] for s in _seqs(1)]

    def write(path: Path, toks: list[list[int]]) -> Path:
        if fmt == "parquet":
            return _write_columnar(path, toks, decoy)
        text = "".join(json.dumps({"input_ids": x, "ids": t}) + "\n"
                       for t, x in zip(toks, decoy, strict=True)).encode()
        path.write_bytes(gzip.compress(text) if fmt.endswith(".gz") else text)
        return path

    data = write(tmp_path / f"d.{fmt}", tokens)
    plan = tmp_path / "p.arrow"
    assert plan_main([str(data), "--field", "ids", "--fingerprint", "content", "-o", str(plan),
                      *PLAN]) == 0
    with PlanReader(plan) as reader:
        source = open_plan_source(reader, str(data))
        got = read_segments(source, np.array([3]), np.array([0]), np.array([len(tokens[3])]))
        assert got.tolist() == tokens[3]
        getattr(source, "close", lambda: None)()
    capsys.readouterr()
    assert plan_main(["validate", str(plan), str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["content_checked"] is True
    # An override reads the decoy: the content fingerprint refuses it, after the notice.
    assert plan_main(["validate", str(plan), str(data), "--field", "input_ids"]) == 2
    err = capsys.readouterr().err
    assert "dcp-plan validate: notice: reading field 'input_ids' (--field), not field 'ids'" in err
    assert f"{data}: its tokens changed since {plan} was planned" in err
    edited = [list(t) for t in tokens]
    edited[5][0] = (edited[5][0] + 1) % VOCAB
    bad = write(tmp_path / f"e.{fmt}", edited)
    with PlanReader(plan) as reader, pytest.raises(
            ValueError, match=rf"the tokens of {re.escape(str(bad))} \(content fingerprint .* "
                              r"changed since planning"):
        open_plan_source(reader, str(bad))
    assert plan_main(["validate", str(plan), str(bad)]) == 2
    assert f"{bad}: its tokens changed since {plan} was planned" in capsys.readouterr().err
