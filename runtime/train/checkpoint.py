"""Save and resume training: one atomic, checksummed directory per save.

Layout (``DIR`` is what ``--save``/``--resume`` name)::

    DIR/latest                   name of the newest complete checkpoint, replaced atomically
    DIR/step-00000012/           one checkpoint: training continues at step 12
        state.pt                 model and optimizer state dicts, next step, ``meta``
        rng-<rank>.pt            that rank's torch (CPU and CUDA) and numpy RNG states, as
                                 tensors and plain numbers (``rngstate``)
        manifest.json            size and sha256 of every file above; written last

A save is one unit: every file goes into ``DIR/.step-N.tmp`` and is fsynced, rank 0 writes the
manifest last, fsyncs the directory, renames it to ``DIR/step-N``, fsyncs ``DIR`` and only then
points ``latest`` at it. A crash at any moment leaves ``latest`` on the previous complete
checkpoint; a later save removes what a killed one left. ``load`` verifies every file against
the manifest and names the one that is missing, truncated or damaged. Ranks agree on success
through an all-reduce, so a rank that fails to write (a full disk) fails every rank, with the
path, instead of leaving the others waiting in a barrier.

Parameters and optimizer states are replicated on every pool rank, so rank 0 alone writes
``state.pt``; every rank writes its own RNG file because RNG streams are per process. Resuming
with the same plan reproduces the losses of an uninterrupted run bit for bit on CPU.

A checkpoint is data: every file loads with ``torch.load(weights_only=True)`` (tensors, dicts,
lists, numbers, strings; no pickled callable is ever run), and every key ``load`` uses is checked
with a message naming the file and the key. Format 3 stores the numpy RNG state as a tensor and
plain numbers; format 2 wrote it as a numpy array, which loads through the same restricted
unpickler with numpy's array reconstruction alone allowed (``rngstate.load_rng``). Format 1
(``DIR/state.pt``, no manifest) loads too, unverified.

``check_save_target`` runs before the first step (every engine calls it): a ``--save`` that
is a file, cannot be written, or holds an entry the run would replace that is not one of our
checkpoints (a user's own ``DIR/step-00000003/``) is refused then, not after the training; and
nothing that is not ours is ever deleted (``_install`` refuses instead).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.fileguard import fsync_dir
from runtime.train.rngstate import load_rng, rng_state, set_rng_state
from runtime.train.savetarget import (
    LATEST_FILE,
    MANIFEST_FILE,
    STATE_FILE,
    STEP_DIR,
    agree,
    check_continues,
    check_save_target,
    is_checkpoint_dir,
    native_saves,
    remove_leftovers,
    step_dir_name,
)

__all__ = ["FORMAT", "LATEST_FILE", "MANIFEST_FILE", "STATE_FILE", "STEP_DIR", "Resumed", "agree",
           "check_continues", "check_save_target", "config_meta", "is_checkpoint_dir", "load",
           "native_saves", "resolve", "resolve_agreed", "save", "step_dir_name", "verify"]

FORMAT = 3
"""3: RNG files hold tensors and numbers only. 2 (numpy RNG state as an array) and 1
(``DIR/state.pt`` without a manifest) still load."""
FORMATS = (1, 2, 3)
STATE_KEYS = ("format", "model", "optimizer", "next_step", "meta")
"""What ``state.pt`` must hold (each checked, by name, on load)."""
@dataclass(frozen=True, slots=True)
class Resumed:
    """What :func:`load` restored: the next step to run and the saved metadata."""

    next_step: int
    meta: dict[str, Any]
    directory: Path
    """The checkpoint directory that was loaded (``DIR/step-N``)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_synced(path: Path, data: bytes | None = None, obj: object = None) -> None:
    if data is None:
        # Serialise in memory first: torch.save into a file turns a full disk into an opaque
        # RuntimeError ("unexpected pos"); a plain write raises OSError with its errno.
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(directory: str | os.PathLike[str], *, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, next_step: int, meta: dict[str, Any],
         rank: int, group: dist.ProcessGroup | None = None) -> Path:
    """Save a checkpoint atomically (collective over ``group``: every rank calls it).

    Args:
        directory: the checkpoint root; created when missing.
        model: the model (its state is identical on every rank).
        optimizer: its optimizer.
        next_step: the first step a resumed run executes.
        meta: small JSON-like facts kept for checks on resume (model config, plan digest).
        rank: this process's rank in ``group`` (rank 0 writes the shared state).
        group: the ranks that save together; None for the default group.

    Returns:
        The new checkpoint directory ``directory/step-<next_step>``.

    Raises:
        ValueError: a write failed on some rank (naming the path and the error on that rank);
            the previous checkpoint stays the latest one.
    """
    root = Path(directory)
    name = step_dir_name(next_step)
    final, staging = root / name, root / f".{name}.tmp"
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    error = ""
    created = False  # only what this save created is removed on the way out
    try:
        if rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                remove_leftovers(root)
                existed = staging.exists()
                try:
                    staging.mkdir()
                finally:
                    # A signal handled right after the mkdir (CPython runs its handler when the
                    # call returns) raises out of it with the directory made: still ours.
                    created = not existed and staging.is_dir()
            except OSError as e:
                error = f"{staging}: cannot create the checkpoint directory: {e.strerror or e}"
        if not agree(not error, group):
            raise ValueError(error or f"{staging}: rank 0 could not create the checkpoint "
                             "directory")
        rng_path = staging / f"rng-{rank}.pt"
        try:
            _write_synced(rng_path, obj=rng_state())
        except OSError as e:
            error = f"{rng_path}: cannot write: {e.strerror or e}"
        if not agree(not error, group):
            _cleanup(rank, staging)
            raise ValueError(error or f"{staging}: another rank failed to write its RNG file")
        if rank == 0:
            try:
                state = {"format": FORMAT, "model": model.state_dict(),
                         "optimizer": optimizer.state_dict(), "next_step": next_step,
                         "meta": meta}
                _write_synced(staging / STATE_FILE, obj=state)
                files = [STATE_FILE] + [f"rng-{r}.pt" for r in range(world)]
                manifest = {"format": FORMAT, "next_step": next_step, "world_size": world,
                            "files": {f: {"bytes": (staging / f).stat().st_size,
                                          "sha256": _sha256(staging / f)} for f in files}}
                # The manifest last: a directory with a valid manifest is complete.
                _write_synced(staging / MANIFEST_FILE,
                              data=json.dumps(manifest, indent=1, sort_keys=True).encode())
                fsync_dir(staging)
                _install(root, staging, final)
            except (OSError, ValueError) as e:
                reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                error = f"{root}: cannot complete checkpoint {name}: {reason}"
        ok = agree(not error, group)
        if not ok:
            _cleanup(rank, staging)
            raise ValueError(error or f"{root}: rank 0 failed to complete checkpoint {name}")
    except BaseException:
        # Whatever ended the save (an error above, Ctrl-C, SIGTERM, SIGHUP): its staging goes;
        # the previous checkpoint stays the latest.
        if created:
            _cleanup(rank, staging)
        raise
    return final


def _install(root: Path, staging: Path, final: Path, *,
             is_ours: Callable[[Path], bool] = is_checkpoint_dir) -> None:
    """Rename the staged checkpoint into place, then move ``latest`` to it (rank 0).
    ``is_ours``: the engine's recogniser of its own checkpoint directories."""
    aside = root / f".{final.name}.old"
    if final.exists() or final.is_symlink():
        # The same step saved again: set the old copy aside, then drop it. Only ours: a user's
        # directory of that name is refused (check_save_target refused it before training).
        if not is_ours(final):
            raise ValueError(f"{final}: exists and is not a checkpoint; refusing to replace it")
        os.replace(final, aside)
    os.replace(staging, final)
    fsync_dir(root)
    tmp = root / f".{LATEST_FILE}.tmp"
    _write_synced(tmp, data=(final.name + "\n").encode())
    os.replace(tmp, root / LATEST_FILE)
    fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)


def _cleanup(rank: int, staging: Path) -> None:
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)


def resolve(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint directory to load for ``--resume DIR``: ``DIR`` itself when it holds a
    manifest (or a format-1 ``state.pt``), else the one ``DIR/latest`` names."""
    path = Path(directory)
    if (path / MANIFEST_FILE).is_file() or (path / STATE_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if not latest.is_file():
        raise ValueError(f"{path}: no checkpoint (neither {LATEST_FILE} nor {MANIFEST_FILE})")
    try:
        name = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{latest}: unreadable: {e}") from None
    if not name.startswith("step-") or "/" in name or not (path / name).is_dir():
        raise ValueError(f"{latest}: names {name!r}, which is not a checkpoint in {path}")
    return path / name


def resolve_agreed(directory: str | os.PathLike[str], rank: int,
                   group: dist.ProcessGroup | None = None) -> Path:
    """``resolve`` on rank 0 only, its answer (or its error) given to every rank (collective
    over ``group``): while ``latest`` moves (another run saving), every rank still loads the
    one checkpoint rank 0 chose."""
    answer: list[Any] = [None]
    if rank == 0:
        try:
            answer[0] = ("ok", str(resolve(directory)))
        except ValueError as e:
            answer[0] = ("error", str(e))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(answer, src=dist.get_global_rank(group, 0) if group
                                   else 0, group=group)
    status, text = answer[0]
    if status != "ok":
        raise ValueError(text)
    return Path(text)


def verify(directory: Path, rank: int) -> dict[str, Any] | None:
    """Check ``state.pt`` and this rank's RNG file against the manifest; return the manifest
    (None for a format-1 checkpoint, which has none)."""
    mpath = directory / MANIFEST_FILE
    if not mpath.is_file():
        if (directory / STATE_FILE).is_file():
            return None  # format 1: nothing to verify against
        raise ValueError(f"{mpath}: missing; {directory} is an incomplete checkpoint")
    try:
        manifest = json.loads(mpath.read_text())
        files = dict(manifest["files"])
        int(manifest["next_step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{mpath}: damaged checkpoint manifest ({e})") from None
    for name in (STATE_FILE, f"rng-{rank}.pt"):
        p = directory / name
        want = files.get(name)
        if want is None:
            if name == STATE_FILE:
                raise ValueError(f"{mpath}: lists no {STATE_FILE}")
            continue  # resumed on more ranks than saved: this rank starts from the seed's RNG
        if not p.is_file():
            raise ValueError(f"{p}: missing from the checkpoint")
        if p.stat().st_size != want.get("bytes"):
            raise ValueError(f"{p}: damaged checkpoint file: {p.stat().st_size} bytes, the "
                             f"manifest says {want.get('bytes')} (truncated?)")
        if _sha256(p) != want.get("sha256"):
            raise ValueError(f"{p}: damaged checkpoint file: sha256 differs from the manifest")
    return dict(manifest)


def _torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors, containers and numbers; a pickled callable
    (a crafted file) is refused by torch's restricted unpickler, never run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file raises anything from zip to pickle
        first = str(e).splitlines()[0] if str(e) else ""
        if isinstance(e, pickle.UnpicklingError) and "Weights only" in first:
            raise ValueError(f"{path}: holds objects other than tensors and plain data (a "
                             "checkpoint is data; refusing to unpickle code)") from None
        raise ValueError(f"{path}: unreadable checkpoint file ({type(e).__name__}: "
                         f"{first})") from None


def _state(path: Path) -> dict[str, Any]:
    """``state.pt``, with every key ``load`` uses present and of its type (named if not)."""
    state = _torch_load(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a checkpoint state (holds a {type(state).__name__}, "
                         "not a dict)")
    if state.get("format") not in FORMATS:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, expected one "
                         f"of {', '.join(map(str, FORMATS))}")
    types = {"model": dict, "optimizer": dict, "next_step": int, "meta": dict}
    for key in STATE_KEYS[1:]:
        if key not in state:
            raise ValueError(f"{path}: checkpoint state has no {key!r}")
        if not isinstance(state[key], types[key]) or isinstance(state[key], bool):
            raise ValueError(f"{path}: checkpoint {key!r} is a {type(state[key]).__name__}, "
                             f"expected a {types[key].__name__}")
    if state["next_step"] < 0:
        raise ValueError(f"{path}: checkpoint next_step {state['next_step']} is negative")
    return state


def load(directory: str | os.PathLike[str], *, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, rank: int, expect_meta: dict[str, Any]) -> Resumed:
    """Verify and restore the checkpoint ``directory`` (or the latest one under it).

    Raises:
        ValueError: no checkpoint; a missing, truncated or damaged file (named); an unknown
            format; a file holding anything but tensors and plain data; a missing key; or
            metadata that differs from ``expect_meta`` (another model shape or plan), naming
            the key.
    """
    path = resolve(directory)
    verify(path, rank)
    state_path = path / STATE_FILE
    # Load on the CPU: load_state_dict moves every tensor to its parameter's device, except
    # AdamW's "step" counters, which must stay on the CPU (on the GPU each step would read them
    # back with .item(): a host-device sync per parameter per step).
    state = _state(state_path)
    for key, want in expect_meta.items():
        if key not in state["meta"]:
            raise ValueError(f"{state_path}: checkpoint meta has no {key!r} (this run's is "
                             f"{want!r})")
        got = state["meta"][key]
        if got != want:
            raise ValueError(f"{state_path}: checkpoint has {key}={got!r}, this run {want!r}")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{state_path}: the model or optimizer state does not fit this "
                         f"run's ({first})") from None
    rng_path = path / f"rng-{rank}.pt"
    if rng_path.is_file():
        set_rng_state(load_rng(rng_path, int(state["format"])))
    return Resumed(next_step=int(state["next_step"]), meta=dict(state["meta"]), directory=path)


def config_meta(config: object) -> dict[str, Any]:
    """A dataclass config as a plain dict, for ``meta``."""
    return asdict(config)  # type: ignore[call-overload, no-any-return]
