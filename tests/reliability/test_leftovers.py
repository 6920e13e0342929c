"""No leftovers: temporary plan files go away on SIGINT/SIGTERM, and a later write removes what a
``kill -9`` left.

Before: ``kill -9`` of ``dcp-plan`` during the write left ``.NAME.tmp-PID`` (17-40 MB) forever, and
SIGTERM (what schedulers and torchrun send) skipped every cleanup.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner.planfile.io import write_plan
from planner.planfile.schema import arrow_schema, step_batch
from tests.planner.planfile import handmade
from tests.reliability.helpers import ROOT

# A real writer process that stalls after the first step, with dcp-plan's signal handling.
_WRITER = """
import signal, sys, time
from pathlib import Path
from planner import cliguard
from planner.planfile.io import write_plan
from planner.planfile.schema import arrow_schema, step_batch
from tests.planner.planfile import handmade
signal.signal(signal.SIGTERM, cliguard.terminate)
# A shell's background job inherits SIGINT ignored, and Python then installs no handler: the
# test's SIGINT would be lost (seen once as a 30 s timeout). Ask for Python's own handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
h = handmade.header()
schema = arrow_schema(h)
def steps():
    for cols in handmade.steps():
        yield step_batch(schema, cols)
        print("writing", flush=True)
        time.sleep(60)
try:
    write_plan(Path(sys.argv[1]), h, steps(), check=False)
except (KeyboardInterrupt, cliguard.Terminated):
    sys.exit(130)
"""


def _start_writer(out: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "writing"
    return proc


def _temps(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_write_removes_the_temporary_file(tmp_path: Path, sig: int) -> None:
    out = tmp_path / "p.arrow"
    proc = _start_writer(out)
    assert _temps(out) == [f".p.arrow.tmp-{proc.pid}"]
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 130
    assert _temps(out) == []
    assert not out.exists()


def test_later_write_removes_what_a_killed_writer_left(tmp_path: Path) -> None:
    out = tmp_path / "p.arrow"
    proc = _start_writer(out)
    proc.kill()  # SIGKILL: no cleanup can run
    proc.wait(timeout=30)
    assert _temps(out) == [f".p.arrow.tmp-{proc.pid}"]
    # A live writer's temporary file is never touched by another write.
    live = _start_writer(out)
    try:
        h = handmade.header()
        schema = arrow_schema(h)
        write_plan(out, h, [step_batch(schema, c) for c in handmade.steps()])
        assert _temps(out) == [f".p.arrow.tmp-{live.pid}"]
    finally:
        live.kill()
        live.wait(timeout=30)
    time.sleep(0.1)
    write_plan(out, h, [step_batch(schema, c) for c in handmade.steps()])
    assert _temps(out) == []
    assert out.is_file()
