"""Run a function on a real multi-process world (gloo on CPU, NCCL where asked) for tests.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes, joins them
through a ``FileStore`` in a temporary directory (no TCP port, so no "address already in use"
flakes between concurrent runs) and calls ``fn(rank, world_size, store_path, *args)`` on each.
The process group is created before ``fn`` and destroyed in a ``finally`` after it, so ``fn``
does only the test's work. ``fn`` must be a top-level function of an importable module.

Start method: ``forkserver`` with torch preloaded, by default. Children must not be forked from
the test process (it holds threads and torch state, which deadlocks intermittently), so the
choice is between spawn and forkserver; both start from a clean interpreter that never ran test
code. Spawn re-imports torch in every child, about 4 s of CPU each here: a world of 8 took 23 s on
2 cores to do one all-reduce. The forkserver imports torch once per session and forks each child
from that clean, single-threaded server: the same world starts in 0.3 s. (Python 3.14 made
forkserver the default on Linux for the same reasons.) ``start_method="spawn"`` remains available.

Results: each rank's return value comes back through a pickle file in the temporary directory;
``run_distributed`` returns them as a list indexed by rank. Failures: each child writes its
traceback with a timestamp; when any rank fails the parent waits briefly for the others, kills
what is left and raises ``ChildFailed`` with the *earliest* traceback first (the root cause; the
others are usually "connection closed by peer" echoes of it). After ``timeout`` seconds every
child is killed and ``TimeoutError`` names the ranks still running, so a hung collective costs one
timeout, never a hung test session.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

DEFAULT_TIMEOUT_S = 120.0
_FAILURE_GRACE_S = 3.0
# Modules the forkserver imports once, before it forks any child. The first autograd backward
# imports torch.fx.experimental.symbolic_shapes (and sympy): 7 s per process where bytecode is not
# cached (PYTHONDONTWRITEBYTECODE=1 here), so it is preloaded too.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.fx.experimental.symbolic_shapes",
    "numpy",
    "pytest",
    "planner.groups",
    # torchtitan (~5 s of CPU to import, per rank) and Megatron-core with the adapter (~4 s per
    # rank; test_megatron_dist.py took 116 CPU-s without it, 49 with): imported once where the
    # extras are installed; the forkserver skips a preload module that is not importable.
    # Importing the adapter patches nothing (``apply_patches`` runs when a job is built).
    "runtime.adapters.torchtitan.titan",
    "runtime.adapters.megatron",
]
multiprocessing.set_forkserver_preload(_PRELOAD)


class ChildFailed(RuntimeError):
    """A rank of a distributed test raised or died; the message holds the traceback."""


def _write_error(workdir: str, rank: int) -> None:
    path = os.path.join(workdir, f"error.{rank}")
    if not os.path.exists(path):  # keep the first (innermost) failure of this rank
        with open(path, "w") as f:
            f.write(f"{time.time():.6f}\n{traceback.format_exc()}")


def _child(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    workdir: str,
    backend: str | None,
    threads: int,
    args: tuple[Any, ...],
) -> None:
    try:
        # Several ranks share a 2-core machine: one intra-op thread each avoids oversubscription,
        # which otherwise makes gloo tests many times slower and timing-dependent.
        torch.set_num_threads(threads)
        store_path = os.path.join(workdir, "store")
        if backend is not None:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, store_path, *args)
        except BaseException:
            # Stamp the failure before the process group is torn down: tearing it down makes the
            # peers fail too, and the earliest stamp must be the root cause.
            _write_error(workdir, rank)
            raise
        finally:
            if backend is not None and dist.is_initialized():
                dist.destroy_process_group()
        # Write then rename: the parent never reads a half-written result.
        tmp = os.path.join(workdir, f"result.{rank}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, os.path.join(workdir, f"result.{rank}.pkl"))
    except BaseException:
        _write_error(workdir, rank)
        raise


def _failure_report(workdir: str, exitcodes: dict[int, int | None]) -> str:
    errors = []
    for path in Path(workdir).glob("error.*"):
        stamp, _, text = path.read_text().partition("\n")
        errors.append((float(stamp), int(path.suffix[1:]), text))
    errors.sort()
    if not errors:
        return f"ranks died without a Python traceback; exit codes {exitcodes}"
    first_t, first_rank, first_text = errors[0]
    parts = [f"rank {first_rank} failed first:\n{first_text}"]
    for t, rank, text in errors[1:]:
        last_line = text.strip().splitlines()[-1] if text.strip() else "?"
        parts.append(f"rank {rank} failed {t - first_t:+.3f} s later: {last_line}")
    return "\n".join(parts)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str | None = "gloo",
    threads: int = 1,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, store_path, *args)`` on ``world_size`` fresh processes.

    Args:
        fn: a top-level (picklable) function; its return value must be picklable.
        world_size: number of processes (ranks).
        *args: extra picklable arguments passed to every rank.
        timeout: seconds before every child is killed and ``TimeoutError`` is raised.
        backend: process-group backend created around ``fn`` ("gloo", or "nccl" on GPUs, where
            rank r uses device r); None leaves initialisation to ``fn``, which gets the
            FileStore path for it.
        threads: torch intra-op threads per child.
        start_method: "forkserver" (default, see the module docstring) or "spawn"; never "fork".

    Returns:
        The return values of ``fn``, indexed by rank.

    Raises:
        ChildFailed: a rank raised or died; the message starts with the earliest traceback.
        TimeoutError: the world did not finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    workdir = tempfile.mkdtemp(prefix="dcp-dist-")
    try:
        ctx = start_processes(  # type: ignore[no-untyped-call]
            _child,
            args=(fn, world_size, workdir, backend, threads, tuple(args)),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        procs = ctx.processes
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    # Give the survivors a moment to fail on their own and write their side.
                    grace = time.monotonic() + _FAILURE_GRACE_S
                    while any(p.is_alive() for p in procs) and time.monotonic() < grace:
                        time.sleep(0.05)
                    break
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise TimeoutError(
                        f"distributed test {getattr(fn, '__name__', fn)} (world_size="
                        f"{world_size}) did not finish in {timeout:.0f} s; ranks still "
                        f"running: {alive}"
                    )
                time.sleep(0.02)
        finally:
            # Nothing may outlive the test: kill what is left and reap it.
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
        exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
        if any(code != 0 for code in exitcodes.values()):
            raise ChildFailed(_failure_report(workdir, exitcodes))
        results = []
        for rank in range(world_size):
            with open(Path(workdir) / f"result.{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
