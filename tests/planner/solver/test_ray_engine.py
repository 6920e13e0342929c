"""``--engine ray``: a local Ray of 2 workers plans the same bytes as ``--engine local``; its
errors are one clear line (bad flags, no Ray, a cluster that does not answer, a task's own error);
Ctrl-C and SIGTERM leave no file and no Ray process behind.

One Ray for the module (cold start is 4-10 s): ``dcp-plan`` run in this process finds Ray
initialized and uses it (``ray_engine.connected``). The signal test starts its own, through the
CLI's path (``ray.init`` of a new local Ray, shut down at the end).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray

from planner.cli import main
from planner.config import EngineError, ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import PlanStream
from planner.planfile.io import write_plan_stream
from planner.solver import ray_engine
from planner.solver.greedy import PackingParams
from planner.solver.jobs import StepJobs
from planner.solver.parallel import plan_steps
from planner.solver.ray_engine import IN_FLIGHT_PER_SLOT, _plan_task, _result, environment
from planner.sources.lengths import read_lengths

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "data" / "sample.jsonl"
WIKIPEDIA = ROOT / "data" / "workloads" / "flexsp_wikipedia_lengths.txt.gz"
BASE = ["--dp", "4", "--cp", "2", "--max-tokens-per-rank", "4096", "--global-batch-size", "64",
        "--long-sequences", "split", "--quiet"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False)
    signal.signal(signal.SIGTERM, sigterm)  # ray.init's handler would sys.exit pytest
    try:
        yield
    finally:
        ray.shutdown()


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("extra", [[], ["--effort", "fast"]], ids=["balanced", "fast"])
def test_ray_plan_is_byte_identical_to_local(tmp_path: Path, extra: list[str]) -> None:
    local, remote = tmp_path / "local.arrow", tmp_path / "ray.arrow"
    assert main([str(SAMPLE), "-o", str(local), *BASE, *extra]) == 0
    assert main([str(SAMPLE), "-o", str(remote), *BASE, *extra, "--engine", "ray"]) == 0
    assert _sha(remote) == _sha(local)


@pytest.mark.usefixtures("local_ray")
def test_many_step_ranges_come_back_in_step_order(tmp_path: Path) -> None:
    # 125 steps in ranges of 16 with 4 tasks out at a time: later ranges finish while the
    # writer waits for earlier ones, so the order of the file is the engine's doing.
    table = read_lengths([str(SAMPLE)])
    cost = load_cost_model()
    digests, reports = [], []
    for engine in ("local", "ray"):
        cfg = PlannerConfig(parallel=ParallelConfig(dp=4, cp=2), capacity_tokens_per_rank=4096,
                            global_batch_size=16, long_sequences="split", effort="fast",
                            engine=engine, workers=2 if engine == "ray" else 1)
        done: list[int] = []
        stream = PlanStream(table, cfg, cost, progress=lambda d, _t, done=done: done.append(d))
        out = write_plan_stream(tmp_path / f"{engine}.arrow", stream.steps(), stream.header,
                                lengths=table.lengths)
        digests.append(_sha(out))
        reports.append(done)
    assert stream.num_steps == 125
    assert digests[0] == digests[1]
    ranges = reports[1]
    assert ranges == sorted(ranges)
    assert ranges[-1] == 125
    assert len(ranges) > 2 * IN_FLIGHT_PER_SLOT


def test_leaving_early_lets_the_tasks_out_finish(local_ray: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C or a write error closes the step generator with tasks still out. ray.cancel on a
    task whose reply was on its way, or ray.shutdown before it came, aborted Ray's core worker
    (RAY_CHECK "Tried to complete task that was not pending", exit 1: CI's SIGINT test, ~1 in
    12). Now none is cancelled and all of them have answered when the generator is closed."""
    cfg = PlannerConfig(parallel=ParallelConfig(dp=2, cp=1), capacity_tokens_per_rank=1024,
                        global_batch_size=2)
    params = PackingParams.from_config(cfg, load_cost_model())
    n = 4 * 2 * IN_FLIGHT_PER_SLOT  # more steps than tasks out: some are left when it stops
    tokens = np.tile(np.array([300, 500], dtype=np.int64), n)
    jobs = StepJobs(sample=np.arange(2 * n, dtype=np.int64), offset=np.zeros(2 * n, np.int64),
                    tokens=tokens, bounds=np.arange(0, 2 * n + 1, 2, dtype=np.int64))
    cancelled: list[object] = []
    monkeypatch.setattr(ray, "cancel", lambda ref, **kw: cancelled.append(ref))
    steps = ray_engine.plan_steps_ray(jobs, params, 2)
    monkeypatch.setattr(ray_engine, "MAX_STEPS_PER_TASK", 1)  # one step a task: many tasks
    next(steps)
    waited: list[list[object]] = []
    wait = ray.wait

    def spy(refs: list[object], **kw: object) -> object:
        waited.append(list(refs))
        return wait(refs, **kw)

    monkeypatch.setattr(ray, "wait", spy)
    steps.close()
    assert cancelled == []
    assert waited, "the generator closed without waiting for its tasks"
    assert len(waited[-1]) > 1, "no tasks were out when the generator closed"
    ready, not_ready = wait(waited[-1], num_returns=len(waited[-1]), timeout=0)
    assert not_ready == []
    assert all(len(part) == 1 for part in ray.get(ready))  # each answered with its step


def test_ray_address_plans_on_a_running_cluster(tmp_path: Path, local_ray: None) -> None:
    # This module's Ray is a running cluster to another process: dcp-plan connects to it as a
    # second driver (ray.init(address=...)), its tasks run on the cluster's 2 workers.
    address = ray.get_runtime_context().gcs_address
    local, remote = tmp_path / "local.arrow", tmp_path / "cluster.arrow"
    assert main([str(SAMPLE), "-o", str(local), *BASE, "--effort", "fast"]) == 0
    proc = subprocess.run([sys.executable, "-m", "planner.cli", str(SAMPLE), "-o", str(remote),
                           *BASE, "--effort", "fast", "--engine", "ray", "--ray-address",
                           address], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert _sha(remote) == _sha(local)


def test_task_error_is_the_local_message(local_ray: None) -> None:
    cfg = PlannerConfig(parallel=ParallelConfig(dp=2, cp=1), capacity_tokens_per_rank=1024,
                        global_batch_size=2)
    params = PackingParams.from_config(cfg, load_cost_model())
    # Step 1 holds a segment no group holds (make_plan's long-sequence policy never lets one
    # through; through the API it reaches the solver, in a task).
    tokens = np.array([100, 200, 300, 99_999], dtype=np.int64)
    jobs = StepJobs(sample=np.arange(4, dtype=np.int64), offset=np.zeros(4, np.int64),
                    tokens=tokens, bounds=np.array([0, 2, 4], dtype=np.int64))
    with pytest.raises(ValueError, match="does not fit") as local:
        list(plan_steps(jobs, params))
    with pytest.raises(ValueError, match="does not fit") as remote:
        list(plan_steps(jobs, params, 2, engine="ray"))
    assert type(remote.value) is type(local.value)
    assert str(remote.value) == str(local.value)


def test_a_lost_worker_is_one_line(local_ray: None) -> None:
    # A worker that dies (OOM killer, a segfault) is Ray's failure, not the input's: one line
    # naming the steps, no Ray traceback.
    @ray.remote(max_retries=0)
    def die() -> None:
        os._exit(1)

    with pytest.raises(EngineError, match=r"^Ray lost the task for steps 3\.\.4: ") as e:
        _result(ray, die.remote(), 3, 5)
    assert "\n" not in str(e.value)


def test_a_node_with_other_versions_refuses_to_plan() -> None:
    jobs = StepJobs(sample=np.zeros(1, np.int64), offset=np.zeros(1, np.int64),
                    tokens=np.ones(1, np.int64), bounds=np.array([0, 1], dtype=np.int64))
    params = PackingParams.from_config(
        PlannerConfig(parallel=ParallelConfig(dp=1, cp=1), capacity_tokens_per_rank=64,
                      global_batch_size=1), load_cost_model())
    here = environment()
    assert _plan_task(jobs, params, 0, 1, here)[0].num_tokens.sum() == 1
    driver = tuple((name, "0.0.1" if name == "ortools" else v) for name, v in here)
    with pytest.raises(ValueError, match=r"ortools .* here, 0\.0\.1 on the driver; install"):
        _plan_task(jobs, params, 0, 1, driver)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's errors
        return int(e.code or 0)


@pytest.mark.parametrize(("flags", "message"), [
    (["--ray-address", "127.0.0.1:6379"], "--ray-address needs --engine ray"),
    (["--engine", "ray", "--ray-address", "ADDR"], "no Ray cluster answers at ADDR"),
    (["--engine", "ray", "--ray-address", "host:port"], "expected HOST:PORT"),
])
def test_engine_flag_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         flags: list[str], message: str) -> None:
    addr = f"127.0.0.1:{_free_port()}"  # nothing listens there
    out = tmp_path / "x.arrow"
    t0 = time.perf_counter()
    argv = [str(SAMPLE), "-o", str(out), *BASE, *(addr if f == "ADDR" else f for f in flags)]
    assert _exit_status(argv) == 2
    err = capsys.readouterr().err
    assert message.replace("ADDR", addr) in err
    assert "Traceback" not in err
    assert time.perf_counter() - t0 < 20  # Ray's own retries take minutes
    assert list(tmp_path.iterdir()) == []


def test_no_ray_installed_names_the_extra(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['ray'] = None\n"  # `import ray` raises ImportError
            "from planner.cli import main\n"
            f"sys.exit(main({[str(SAMPLE), '-o', str(tmp_path / 'x.arrow'), *BASE]!r}"
            " + ['--engine', 'ray']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "--engine ray needs Ray" in proc.stderr
    assert "pip install 'dcp-planner[ray]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def _session(sid: int) -> list[str]:
    """Live processes of session ``sid`` (Ray's processes stay in their driver's session)."""
    ps = subprocess.run(["ps", "-eo", "sid=,stat=,args="], capture_output=True, text=True)
    return [line for line in ps.stdout.splitlines()
            if line.split()[0] == str(sid) and not line.split()[1].startswith("Z")]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_while_ray_plans_leaves_no_file_and_no_ray(tmp_path: Path, sig: int) -> None:
    out = tmp_path / "w.arrow"
    # A shell's background job (CI's) inherits SIGINT ignored, and Python then installs no
    # handler: ask for Python's own, as an interactive dcp-plan has.
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from planner.cli import main; sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, str(WIKIPEDIA), "-o", str(out), "--dp", "16",
           "--cp", "4", "--max-tokens-per-rank", "16384", "--global-batch-size", "1024",
           "--long-sequences", "split", "--engine", "ray", "--workers", "2", "--quiet"]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stderr=subprocess.PIPE,
                            text=True)
    try:
        # Signal once steps are flowing: Ray's tasks run and the spill file grows.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not any(
                p.stat().st_size > 200_000 for p in tmp_path.glob(".w.arrow.spill-*")):
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert _session(proc.pid), "no Ray processes in the driver's session"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + sig, err
    # Our one line; Ray's core worker may log a line of its own while the tasks still out die
    # with it ("Failed to push error to driver", seen 1 run in ~10), from its own thread, so
    # before or after ours. Nothing else may be said.
    lines = err.strip().splitlines()
    ours = f"dcp-plan: interrupted by {signal.Signals(sig).name}; no plan written"
    assert lines.count(ours) == 1, err
    ray_log = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [A-Z] \d+ \d+\] ")
    assert all(ray_log.match(line) for line in lines if line != ours), err
    assert len(lines) <= 3, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    deadline = time.monotonic() + 10
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session(proc.pid) == []
