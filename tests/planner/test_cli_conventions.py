"""Conventional command lines: --version, defaults in --help, subcommands listed, Megatron aliases
that give byte-identical plans, --json / --summary-json with every figure, errors that name flags,
no traceback for a user's mistake, and a progress bar only on a terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from planner.cli.args import flag_message

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample.jsonl"
BASE = ["--dp", "2", "--cp", "2", "--max-tokens-per-rank", "8192", "--global-batch-size", "100",
        "--long-sequences", "split"]
BIN = Path(sys.executable).parent


def _run(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          check=False, **kw)  # type: ignore[call-overload]


@pytest.mark.parametrize("prog", ["dcp-plan", "dcp-train", "dcp-calibrate"])
def test_version_and_defaults_in_help(prog: str) -> None:
    out = _run([str(BIN / prog), "--version"])
    assert out.returncode == 0
    assert out.stdout.startswith(f"{prog} 0.")
    assert "plan format 2" in out.stdout
    text = _run([str(BIN / prog), "--help"]).stdout
    if prog == "dcp-plan":
        for want in ("validate", "show", "(default: zigzag)", "(default: balanced)",
                     "--context-parallel-size", "--max-seqlen-per-dp-cp-rank", "--data-path"):
            assert want in text, want
    else:
        # dcp-train's --vocab-size default was only in an error before.
        assert "(default: 256)" in " ".join(text.split())
        assert "--num-layers" in text
        assert "--num-attention-heads" in text


def test_subcommand_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["show", "--help"])
    assert e.value.code == 0
    assert "--steps A:B" in capsys.readouterr().out
    for cmd, want in (("compare", "(default: 1000)"), ("report", "replaces only a report")):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert want in " ".join(capsys.readouterr().out.split())
        with pytest.raises(SystemExit) as e:
            main([cmd, "--version"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(f"dcp-plan {cmd} 0.")


def _sha(p: Path) -> bytes:
    return p.read_bytes()


def test_megatron_aliases_give_byte_identical_plans(tmp_path: Path) -> None:
    short = ["--dp", "3", "--cp", "2", "--tp", "2", "--sequence-parallel", "--pp", "2",
             "--vpp", "2", "--microbatch-group-size", "2", "--max-tokens-per-rank", "4096",
             "--global-batch-size", "500", "--long-sequences", "truncate", "--effort", "fast"]
    long = ["--data-parallel-size", "3", "--context-parallel-size", "2",
            "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
            "--microbatch-group-size-per-virtual-pipeline-stage", "2",
            "--max-seqlen-per-dp-cp-rank", "4096", "--global-batch-size", "500",
            "--long-sequences", "truncate", "--effort", "fast"]
    a, b = tmp_path / "a.arrow", tmp_path / "b.arrow"
    assert main([str(SAMPLE), "-o", str(a), "--quiet", *short]) == 0
    # Options and paths in another order, the dataset through --data-path.
    assert main(["--data-path", str(SAMPLE), *long, "--quiet", "-o", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()


def test_json_summary_has_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, js = tmp_path / "p.arrow", tmp_path / "summary.json"
    assert main([str(SAMPLE), "-o", str(out), *BASE, "--json", "--summary-json", str(js)]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads(js.read_text())
    assert printed == written
    for key in ("plan", "dataset", "parallel", "num_steps", "microbatches_per_step",
                "cp_size_groups", "padding_overhead", "alignment_padding", "slot_fill",
                "simulated_seconds", "lower_bound_seconds", "time_over_bound", "seconds",
                "samples_per_second", "split_samples", "cost_model"):
        assert key in printed, key
    assert printed["dataset"]["num_samples"] == 2000
    assert printed["dataset"]["files"][0]["fingerprint"].startswith("sha256:")
    assert printed["time_over_bound"] >= 1.0
    # The text summary is rendered from the same figures.
    assert main([str(SAMPLE), "-o", str(out), *BASE]) == 0
    assert f"{printed['slot_fill']:.3f}" in capsys.readouterr().out
    assert main(["validate", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] is True
    assert main(["show", str(out), "--steps", "1:3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["show", "PLAN", "--steps", "abc"], "argument --steps: expected a step range A:B"),
        ([str(SAMPLE), *BASE, "--epochs", "abc"],
         "argument --epochs: expected a positive integer, got 'abc'"),
        ([str(SAMPLE), *BASE, "--dp", "0"], "argument --dp/--data-parallel-size: expected a "
         "positive integer, got 0"),
        ([str(SAMPLE), *BASE, "--micro-batch-size", "4"],
         "--micro-batch-size is not used by dcp-plan: dcp-plan chooses every step's "
         "microbatches; bound their size with --max-tokens-per-rank"),
        (["--data-path", "0.3", str(SAMPLE), "0.7", *BASE],
         "--data-path: 3 items; with weights they come in pairs"),
    ],
)
def test_flag_errors_name_the_flag(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_library_errors_name_flags_not_fields(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "long.jsonl"
    data.write_text('{"length": 5}\n{"length": 40000}\n')
    assert main([str(data), "-o", str(tmp_path / "x.arrow"), *BASE[:-2]]) == 2
    err = capsys.readouterr().err
    assert "use --long-sequences split, truncate or drop" in err
    assert "long_sequences" not in err
    assert flag_message("min_cp=8 and vpp=2 needs pp >= 2", {"min_cp=": "--min-cp ",
                        "vpp=": "--vpp ", "pp >=": "--pp >="}) == \
        "--min-cp 8 and --vpp 2 needs --pp >= 2"
    # Paths that contain a field's name are left alone.
    assert flag_message("/data/long_sequences.jsonl: bad", {"long_sequences": "--x"}) == \
        "/data/long_sequences.jsonl: bad"


@pytest.mark.parametrize("argv", [
    ["dcp-plan", "missing.jsonl", *BASE],
    ["dcp-plan", "show", "missing.arrow"],
    ["dcp-plan", "validate", "README.md"],
    ["dcp-plan", str(SAMPLE), *BASE, "--cost-model", "nope"],
    ["dcp-train", "--plan", "missing.arrow", "--dataset", str(SAMPLE)],
    ["dcp-train", "--plan", "missing.arrow"],
    ["dcp-calibrate", "-o", "/tmp/x.json", "--repeats", "0"],
])
def test_no_traceback_for_user_errors(argv: list[str]) -> None:
    out = _run([str(BIN / argv[0]), *argv[1:]])
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"{argv[0].split()[0]}" in out.stderr.splitlines()[-1]


def _with_tty(args: list[str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal: (status, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, cwd=ROOT, text=True,
                            env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    shown = b""
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        shown += data
    out = proc.stdout.read() if proc.stdout else ""
    status = proc.wait(timeout=300)
    os.close(master)
    return status, out, shown.decode("utf-8", "replace")


def test_progress_only_on_a_terminal(tmp_path: Path) -> None:
    args = [str(BIN / "dcp-plan"), str(SAMPLE), *BASE, "-o", str(tmp_path / "p.arrow")]
    status, out, shown = _with_tty(args)
    assert status == 0
    assert "planning" in shown
    assert "20/20" in shown
    assert "step/s" in shown or "s/step" in shown     # the rate
    assert "<" in shown                                # elapsed<remaining: the ETA
    assert "plan " in out                              # the summary still goes to stdout
    piped = _run(args)
    assert piped.returncode == 0
    assert piped.stderr == ""                          # silent when not a terminal
    assert "\r" not in piped.stdout


def test_train_progress_on_a_terminal(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(i * 7 + j) % 200 for j in range(20 + i)]})
                            + "\n" for i in range(12)))
    plan = tmp_path / "p.arrow"
    assert main([str(data), "-o", str(plan), "--dp", "1", "--max-tokens-per-rank", "256",
                 "--global-batch-size", "4", "--quiet"]) == 0
    args = [str(BIN / "dcp-train"), "--plan", str(plan), "--steps", "3"]
    status, out, shown = _with_tty(args)
    assert status == 0, shown
    assert "training" in shown
    assert "3/3" in shown
    assert "<" in shown
    assert [json.loads(line)["step"] for line in out.splitlines()] == [0, 1, 2]
    piped = _run([*args, "--json"])
    assert piped.returncode == 0
    assert piped.stderr == ""
    lines = [json.loads(line) for line in piped.stdout.splitlines()]
    assert [x.get("step") for x in lines[:3]] == [0, 1, 2]
    summary = lines[3]
    assert summary["num_steps"] == 3
    assert summary["dataset"] == [str(data)]
    assert summary["tokens"] == sum(x["tokens"] for x in lines[:3])


def test_flag_message_renames_fields_not_plain_words() -> None:
    from planner.cli.args import flag_message

    flags = {"long_sequences": "--long-sequences", "device": "--device", "steps": "--steps"}
    assert flag_message("use long_sequences split", flags) == "use --long-sequences split"
    assert flag_message("x: [Errno 28] No space left on device", flags) == \
        "x: [Errno 28] No space left on device"
    assert flag_message("steps must be >= 0", flags) == "steps must be >= 0"


def test_console_script_flushes_before_its_fast_exit(tmp_path: Path) -> None:
    # `dcp-plan` ends with os._exit (cli.entry): everything printed to a pipe must still arrive.
    plan = tmp_path / "p.arrow"
    out = _run([str(BIN / "dcp-plan"), str(SAMPLE), *BASE, "-o", str(plan), "--json"])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_steps"] == 20
    shown = _run([str(BIN / "dcp-plan"), "show", str(plan), "--steps", ":"])
    assert shown.returncode == 0, shown.stderr
    rows = [line for line in shown.stdout.splitlines()
            if not line.startswith(("gain: ", "cost: ", "warning: "))]
    assert rows[-1].split()[0] == "19"   # the last step's row
    # then the predicted gain, the cost model's mark and (a preset: an estimate) its warning
    assert [line.split(":")[0] for line in shown.stdout.splitlines()[-4:]] == [
        "gain", "gain", "cost", "warning"]
