"""Where a checkpoint may be written: the ``--save`` directory's layout, what in it is ours, and
``check_save_target``, which every engine runs before its first step.

A save creates or replaces ``DIR/step-N/``, its staging ``DIR/.step-N.tmp/``, its set-aside
``DIR/.step-N.old/`` and ``DIR/latest``. Each such entry that exists must be ours: a directory
of our file names only (with a manifest or a ``state.pt`` for a checkpoint), a ``latest`` that
names a step. Anything else (a user's own ``DIR/step-00000003/``) is refused before training
and never deleted. Other engines pass their own names and recogniser (torchtitan's ``step-N``
of DCP files; Megatron's ``iter_N``).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from planner.fileguard import check_directory

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
STEP_DIR = re.compile(r"^step-(\d{8})$")
_RNG_FILE = re.compile(r"^rng-\d+\.pt$")
_LEFTOVER = re.compile(r"^\.step-\d{8}\.(?:tmp|old)$")
_SAVE_NAME = re.compile(r"^(?:step-(\d{8})|\.step-(\d{8})\.(?:tmp|old))$")


def step_dir_name(next_step: int) -> str:
    return f"step-{next_step:08d}"


def agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """True on every rank iff ``ok`` on every rank (a barrier that carries a verdict)."""
    if not dist.is_initialized():
        return ok
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _only_our_files(p: Path) -> bool:
    """A directory holding nothing but the names a save writes (possibly none)."""
    try:
        names = [q.name for q in p.iterdir()]
    except OSError:
        return False
    return all(n in (STATE_FILE, MANIFEST_FILE) or _RNG_FILE.match(n) for n in names)


def is_checkpoint_dir(p: Path) -> bool:
    """True for a checkpoint this module wrote: a directory of our files only, with a manifest
    (format 2, 3) or a ``state.pt`` (format 1)."""
    return (p.is_dir() and not p.is_symlink() and _only_our_files(p)
            and ((p / MANIFEST_FILE).is_file() or (p / STATE_FILE).is_file()))


def _is_native_entry(p: Path) -> bool:
    """An entry of a ``--save`` directory that a save may replace: one of our checkpoints, a
    killed save's staging or set-aside directory, or a ``latest`` naming a step."""
    if p.name == LATEST_FILE:
        try:
            return p.is_file() and p.stat().st_size <= 64 and \
                bool(STEP_DIR.match(p.read_text().strip()))
        except (OSError, UnicodeDecodeError):
            return False
    if _LEFTOVER.match(p.name):
        return p.is_dir() and not p.is_symlink() and _only_our_files(p)
    return is_checkpoint_dir(p)


def native_saves(start: int, stop: int, save_every: int) -> Callable[[str], bool]:
    """The entries of ``DIR`` that a run of steps [start, stop) saving every ``save_every``
    steps (and after the last) creates or replaces, as a predicate on names."""

    def writes(name: str) -> bool:
        if name == LATEST_FILE:
            return True
        m = _SAVE_NAME.match(name)
        if m is None:
            return False
        n = int(m.group(1) or m.group(2))
        return start < n <= stop and (n == stop or (save_every > 0 and n % save_every == 0))

    return writes


def check_save_target(directory: str | os.PathLike[str], rank: int,
                      group: dist.ProcessGroup | None = None, *,
                      writes: Callable[[str], bool] | None = None,
                      is_ours: Callable[[Path], bool] = _is_native_entry,
                      inputs: Iterable[str | os.PathLike[str]] = (),
                      flag: str = "--save") -> Path:
    """Refuse, before the first step, a checkpoint directory that a save would fail on or
    damage (collective over ``group``: every rank calls it, all refuse alike).

    Every rank checks that ``directory`` is a directory or can be created (not a file, not an
    input, not under a read-only or unwritable parent: rank 0 creates and removes a probe), and
    that every existing entry a save would create or replace (``writes(name)``) is one of ours
    (``is_ours(path)``). Engines with another on-disk layout (torchtitan's ``step-N``, Megatron's
    ``iter_N``) pass their own ``writes`` and ``is_ours``.

    Args:
        directory: the ``--save`` directory.
        rank: this process's rank in ``group``.
        group: the ranks that save together; None for the default group.
        writes: the names the run's saves create or replace; default: every step directory,
            every killed save's leftover and ``latest``.
        is_ours: whether an existing entry may be replaced.
        inputs: the run's input files (a save directory is never one of them).
        flag: the option that named ``directory``, for messages.

    Returns:
        ``directory`` as a Path.

    Raises:
        ValueError: naming the path and what is wrong, on every rank.
    """
    root = Path(directory)
    error = ""
    try:
        check_directory(root, inputs=inputs, flag=flag, probe=rank == 0)
        if root.is_dir():
            default = native_saves(0, 2**62, 1)
            for entry in sorted(root.iterdir()):
                if (writes or default)(entry.name) and not is_ours(entry):
                    what = "a directory" if entry.is_dir() else "a file"
                    raise ValueError(
                        f"{entry}: exists and is {what} that is not a checkpoint of this run's "
                        f"format; a save would replace it, so refusing before training (move "
                        f"it, or choose another {flag})")
    except ValueError as e:
        error = str(e)
    if not agree(not error, group):
        raise ValueError(error or f"{root}: another rank refused {flag} (see its message)")
    return root


def remove_leftovers(root: Path) -> None:
    """Staging or set-aside directories of saves that were killed (only rank 0 calls this);
    only ours: a name of our pattern holding our files only."""
    for p in root.iterdir():
        if _LEFTOVER.match(p.name) and p.is_dir() and not p.is_symlink() and _only_our_files(p):
            shutil.rmtree(p, ignore_errors=True)


def check_continues(save: str | os.PathLike[str], *, resumed: Path | None, start: int,
                    replace: bool) -> None:
    """Refuse a ``--save`` directory whose checkpoints this run would not continue, before the
    first step: one whose ``latest`` names a checkpoint of another run (this run resumes from
    elsewhere, or from nothing), or one whose ``latest`` lies past ``start`` (the saves would
    move it back). ``replace`` (``--replace-checkpoints``) allows both.

    Raises:
        ValueError: naming the directory, its latest checkpoint and the way out.
    """
    root = Path(save)
    latest = root / LATEST_FILE
    if replace or not latest.is_file():
        return
    try:
        name = latest.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return  # check_save_target / resolve name an unreadable latest
    m = STEP_DIR.match(name)
    if m is None:
        return
    if resumed is None or resumed.parent.resolve() != root.resolve():
        source = f"this run resumes from {resumed}" if resumed else "this run starts afresh"
        raise ValueError(f"--save {save}: holds the checkpoints of another run (latest "
                         f"{name}), and {source}; --resume {save} continues them, "
                         "--replace-checkpoints replaces them, or choose another directory")
    if int(m.group(1)) > start:
        raise ValueError(f"--save {save}: its latest checkpoint is {name}, this run resumes "
                         f"from {resumed.name} (step {start}) and its saves would move latest "
                         "back to an earlier step; resume from the latest, or pass "
                         "--replace-checkpoints")
