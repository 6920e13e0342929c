"""``--engine ray``: ``parallel.plan_steps``'s step ranges as Ray tasks. The only Ray import.

The driver (this process) puts the step jobs (every segment's sample, offset and tokens: 24 bytes
a segment) and the solver parameters into Ray's object store once, then submits tasks that name
only a step range, ``plan_range(jobs, params, first, last)``, the function ``--workers`` runs. At
most ``IN_FLIGHT_PER_SLOT`` tasks per CPU slot are out at a time; the driver waits for the
oldest (the next steps of the plan) and yields its steps, in order, while the others run. So the
plan is the same sequence of steps as ``--engine local`` (byte-identical file), and the driver
holds one range's results plus the window's in the object store, whatever the plan's length.

What the driver does per step is what it does locally: receive the step's rows, add them to the
header stats, checksum and spill them (``planfile.io.write_plan_stream``); that rate, not the
cluster, bounds the engine (docs/design.md, BENCHMARKS.md).

Ray is imported lazily, only when this engine runs: ``import planner`` never loads it. Without it
installed, ``import_ray`` raises ``EngineError`` naming the extra (exit 2). A task's own error (a
``ValueError`` on bad input) is re-raised as that exception, the message a local run gives;
Ray's failures (a worker or node that died, a cluster that cannot be reached) become
``EngineError`` with Ray's first line.
Every node must run the same dcp-planner, NumPy and OR-Tools as the driver (a CP-SAT answer may
differ between versions): a task checks and refuses otherwise.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import cache
from importlib import metadata
from types import ModuleType
from typing import Any

from planner.config import EngineError
from planner.solver.greedy import PackingParams, StepAssignment
from planner.solver.jobs import CHUNKS_PER_WORKER, StepJobs, plan_range

RAY_EXTRA = "pip install 'dcp-planner[ray]'"
MAX_STEPS_PER_TASK = 32
"""Steps per task at most: a task's results (~64 KB a step at N = 64) stay small in the object
store, and the first steps reach the writer early."""
IN_FLIGHT_PER_SLOT = 2
"""Tasks out per CPU slot: one running, one queued, so a slot never waits for the driver."""
DRAIN_S = 10.0
"""How long the tasks still out may run on when planning stops early, before Ray may shut down (a
task plans at most ``MAX_STEPS_PER_TASK`` steps: under 0.2 s measured on 2 cores)."""
CONNECT_TIMEOUT_S = 5.0
"""A ``--ray-address`` that does not answer a TCP connect in this time is refused (Ray itself
retries for minutes, printing a log line every few seconds)."""
DEFAULT_PORTS = {"ray": 10001, "": 6379}
"""Port of an address given without one: Ray Client (``ray://``), else the head's GCS."""


def import_ray() -> ModuleType:
    """The ``ray`` module, or an ``EngineError`` that says how to install it (exit 2)."""
    try:
        import ray
    except ImportError:
        raise EngineError(f"--engine ray needs Ray, which is not installed: "
                          f"{RAY_EXTRA}") from None
    return ray


def _host_port(address: str) -> tuple[str, int]:
    scheme, _, rest = address.rpartition("://")
    rest = rest.split("/", 1)[0]
    if rest.startswith("["):  # [IPv6]:port
        host, _, tail = rest[1:].partition("]")
        port = tail.lstrip(":")
    else:
        host, _, port = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"ray_address {address!r}: expected HOST:PORT or ray://HOST:PORT")
    return host, int(port) if port else DEFAULT_PORTS.get(scheme, 6379)


def check_address(address: str) -> None:
    """Refuse, within ``CONNECT_TIMEOUT_S``, an address where nothing listens ("" and "auto",
    which Ray resolves itself, pass)."""
    if address in ("", "auto", "local"):
        return
    host, port = _host_port(address)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        raise EngineError(
            f"ray_address {address}: no Ray cluster answers at {host}:{port} ({why}); start "
            "one with 'ray start --head' or leave ray_address out for a local Ray") from None


@cache
def environment() -> tuple[tuple[str, str], ...]:
    """The versions that decide a plan's bytes, as (package, version) pairs."""
    out = []
    for name in ("dcp-planner", "numpy", "ortools"):
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            out.append((name, "not installed"))
    return tuple(out)


def _plan_task(jobs: StepJobs, params: PackingParams, first: int, last: int,
               driver: tuple[tuple[str, str], ...]) -> list[StepAssignment]:
    """One Ray task: steps first..last-1, after checking this node plans as the driver does."""
    here = environment()
    if here != driver:
        diff = ", ".join(f"{a[0]} {b[1]} here, {a[1]} on the driver"
                         for a, b in zip(driver, here, strict=True) if a != b)
        raise ValueError(f"Ray worker on {socket.gethostname()}: {diff}; install the driver's "
                         "versions on every node (a plan must not depend on where it is made)")
    return plan_range(jobs, params, first, last)


@contextmanager
def connected(workers: int, address: str) -> Iterator[tuple[int, bool]]:
    """Ray, up for the block; yields (CPU slots to keep busy, whether this call started Ray).

    Ray already initialized in this process (by the caller) is used as it is and left running.
    Otherwise: the cluster at ``address``, or a new local Ray of ``workers`` CPUs (0: all of this
    machine's), shut down (or disconnected) when the block ends, however it ends.
    """
    ray = import_ray()
    started = False
    if not ray.is_initialized():
        check_address(address)
        _no_failure_handler(ray)
        quiet: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR,
                                 "log_to_driver": False}
        with _signals_held(ray) as held:
            try:
                if address:
                    ray.init(address=address, **quiet)
                else:
                    # "local": a new Ray here even where RAY_ADDRESS names a cluster.
                    ray.init(address="local", num_cpus=workers or os.cpu_count() or 1,
                             **quiet)
            except Exception as e:
                where = f"the Ray cluster at {address}" if address else "a local Ray"
                hint = ("; a cluster with token authentication needs RAY_AUTH_MODE=token and "
                        "its token (Ray's token-auth docs)" if address and
                        os.environ.get("RAY_AUTH_MODE") != "token" else "")
                raise EngineError(f"could not start or reach {where}: {_first_line(e)}{hint}"
                                  ) from None
        if held:
            # A signal came during the start-up: Ray goes down first, then the caller's own
            # handler gets it (dcp-plan's raises, so its cleanup runs and it exits 128+N).
            _shutdown(ray)
            signal.raise_signal(held[0])
        started = True
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        yield workers or max(cpus, 1), started
    finally:
        if started:
            _shutdown(ray)


def _no_failure_handler(ray: ModuleType) -> None:
    """Keep Ray's C++ failure-signal handler out of this (driver) process.

    The core worker installs it for SIGTERM among the fatal signals during ``ray.init`` (a SIGTERM
    then dumped a C++ stack and re-raised) and, in ``ray.shutdown``, resets SIGTERM and SIGINT to
    the default action at the C level for about a second (measured with ``sigaction``: Python's
    handler is not called, a SIGTERM then kills the process with no word and its temporary plan
    left behind). Ray reads this switch when the driver's core worker is made; its workers, other
    processes, keep their handler.
    """
    constants = getattr(ray._private, "ray_constants", None)
    if constants is not None and hasattr(constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"):
        constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def _shutdown(ray: ModuleType) -> None:
    """``ray.shutdown``, then the caller's signal handlers again (a Ray whose core worker was
    made with its failure handler, by the caller, resets SIGTERM and SIGINT to the default action
    on its way down, behind Python's back; see ``_no_failure_handler``). A signal during the
    shutdown is held, as during the start-up, and delivered after it."""
    with _signals_held(ray) as held:  # an exception raised inside the shutdown could abort
        ray.shutdown()
    if held:
        signal.raise_signal(held[0])


@contextmanager
def _signals_held(ray: ModuleType) -> Iterator[list[int]]:
    """SIGTERM and SIGINT held while Ray starts (yields the signals that came).

    ``ray.init`` first installs a SIGTERM handler of its own (``sys.exit``), and an exception
    raised in the middle of it, by that handler or the caller's, was lost (the plan went on,
    exit 0), exited 15 with no word, or aborted in Ray's C++ core (SIGABRT and a stack dump).
    So during the start-up both signals are only recorded, Ray is kept from installing its
    handler, and the caller's handlers are back afterwards, whatever happened.
    """
    if threading.current_thread() is not threading.main_thread():
        yield []  # only the main thread can set handlers (and Ray then sets none either)
        return
    held: list[int] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    utils = ray._private.utils
    own = getattr(utils, "set_sigterm_handler", None)
    if own is not None:
        utils.set_sigterm_handler = lambda handler: None
    for s in saved:
        signal.signal(s, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        if own is not None:
            utils.set_sigterm_handler = own
        for s, handler in saved.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _result(ray: ModuleType, ref: Any, first: int, last: int) -> list[StepAssignment]:
    """A task's steps, once it is done (the other tasks run on meanwhile); its own exception
    re-raised as itself, Ray's failures as EngineError."""
    try:
        ray.wait([ref], num_returns=1)
        steps: list[StepAssignment] = ray.get(ref)
    except SystemError as e:
        # A signal handler that raises a BaseException (dcp-plan's SIGTERM: cli.guard.Terminated)
        # while Ray's C++ wait checks signals comes back as SystemError from it: unwrap it.
        if isinstance(e.__cause__, BaseException) and not isinstance(e.__cause__, Exception):
            raise e.__cause__ from None
        raise
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, Exception):
            raise e.cause from None
        raise EngineError(f"Ray task for steps {first}..{last - 1} failed: "
                          f"{_first_line(e)}") from None
    except ray.exceptions.RayError as e:
        raise EngineError(f"Ray lost the task for steps {first}..{last - 1}: "
                          f"{_first_line(e)}") from None
    return steps


def plan_steps_ray(jobs: StepJobs, params: PackingParams, workers: int = 0,
                   progress: Callable[[int], None] | None = None, *,
                   address: str = "") -> Iterator[StepAssignment]:
    """Every step's assignment, in step order, planned as Ray tasks of at most
    ``MAX_STEPS_PER_TASK`` steps; ``progress(steps_done)`` after each task's steps.

    ``workers`` CPU slots are kept busy (0: every CPU of the cluster). Leaving the generator
    early (an error while writing, Ctrl-C) lets the tasks still out finish (never cancelled).
    """
    n = jobs.num_steps
    with connected(workers, address) as (slots, _):
        ray = import_ray()
        per_task = max(1, min(MAX_STEPS_PER_TASK, -(-n // (slots * CHUNKS_PER_WORKER))))
        ranges = [(a, min(a + per_task, n)) for a in range(0, n, per_task)]
        task = ray.remote(_plan_task)
        # Once into the object store: every task reads the same (zero-copy) arrays.
        jobs_ref, params_ref = ray.put(jobs), ray.put(params)
        env = environment()
        pending: deque[tuple[Any, int, int]] = deque()
        submitted = done = 0
        try:
            while pending or submitted < len(ranges):
                while submitted < len(ranges) and len(pending) < slots * IN_FLIGHT_PER_SLOT:
                    a, b = ranges[submitted]
                    pending.append((task.remote(jobs_ref, params_ref, a, b, env), a, b))
                    submitted += 1
                # The oldest task holds the plan's next steps: wait for it, the rest run on.
                ref, a, b = pending[0]
                part = _result(ray, ref, a, b)
                pending.popleft()
                yield from part
                done += len(part)
                if progress is not None:
                    progress(done)
        finally:
            # Left early (Ctrl-C, an error while writing): the tasks still out run to their end
            # (at most DRAIN_S) before Ray may go down. Neither ray.cancel nor ray.shutdown may
            # meet a task whose reply is on its way: Ray's core worker then aborts the process
            # (RAY_CHECK "Tried to complete task that was not pending", a C++ stack dump, exit
            # 1; 1 Ctrl-C in ~12 on 2 cores with ray.cancel, Ray 2.60).
            if pending:
                with suppress(Exception):
                    ray.wait([ref for ref, _, _ in pending], num_returns=len(pending),
                             timeout=DRAIN_S)
