"""Save and resume training: one atomic, checksummed directory per save.

Layout (``DIR`` is what ``--save``/``--resume`` name)::

    DIR/latest                   name of the newest complete checkpoint, replaced atomically
    DIR/step-00000012/           one checkpoint: training continues at step 12
        state.pt                 model and optimizer state dicts, next step, ``meta``
        rng-<rank>.pt            that rank's torch (CPU and CUDA) and numpy RNG states
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
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from planner.planfile.io import fsync_dir

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
FORMAT = 2
"""2: step directories with a manifest. 1 (``DIR/state.pt`` without a manifest) still loads."""


@dataclass(frozen=True, slots=True)
class Resumed:
    """What :func:`load` restored: the next step to run and the saved metadata."""

    next_step: int
    meta: dict[str, Any]
    directory: Path
    """The checkpoint directory that was loaded (``DIR/step-N``)."""


def step_dir_name(next_step: int) -> str:
    return f"step-{next_step:08d}"


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


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """True on every rank iff ``ok`` on every rank (a barrier that carries a verdict)."""
    if not dist.is_initialized():
        return ok
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _remove_leftovers(root: Path) -> None:
    """Staging or set-aside directories of saves that were killed (only rank 0 calls this)."""
    for p in root.iterdir():
        if p.name.startswith(".step-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


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
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(root)
            staging.mkdir()
        except OSError as e:
            error = f"{staging}: cannot create the checkpoint directory: {e.strerror or e}"
    if not _agree(not error, group):
        raise ValueError(error or f"{staging}: rank 0 could not create the checkpoint directory")
    rng_path = staging / f"rng-{rank}.pt"
    try:
        _write_synced(rng_path, obj=_rng_state())
    except OSError as e:
        error = f"{rng_path}: cannot write: {e.strerror or e}"
    if not _agree(not error, group):
        _cleanup(rank, staging)
        raise ValueError(error or f"{staging}: another rank failed to write its RNG file")
    if rank == 0:
        try:
            state = {"format": FORMAT, "model": model.state_dict(),
                     "optimizer": optimizer.state_dict(), "next_step": next_step, "meta": meta}
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
        except OSError as e:
            error = f"{root}: cannot complete checkpoint {name}: {e.strerror or e}"
    ok = _agree(not error, group)
    if not ok:
        _cleanup(rank, staging)
        raise ValueError(error or f"{root}: rank 0 failed to complete checkpoint {name}")
    return final


def _install(root: Path, staging: Path, final: Path) -> None:
    """Rename the staged checkpoint into place, then move ``latest`` to it (rank 0)."""
    aside = root / f".{final.name}.old"
    if final.exists():  # the same step saved again: set the old copy aside, then drop it
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
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file raises anything from zip to pickle
        raise ValueError(f"{path}: unreadable checkpoint file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


def load(directory: str | os.PathLike[str], *, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, rank: int, expect_meta: dict[str, Any]) -> Resumed:
    """Verify and restore the checkpoint ``directory`` (or the latest one under it).

    Raises:
        ValueError: no checkpoint; a missing, truncated or damaged file (named); an unknown
            format; or metadata that differs from ``expect_meta`` (another model shape or plan),
            naming the key.
    """
    path = resolve(directory)
    verify(path, rank)
    state_path = path / STATE_FILE
    # Load on the CPU: load_state_dict moves every tensor to its parameter's device, except
    # AdamW's "step" counters, which must stay on the CPU (on the GPU each step would read them
    # back with .item(): a host-device sync per parameter per step).
    state = _torch_load(state_path)
    if not isinstance(state, dict) or state.get("format") not in (1, FORMAT):
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{state_path}: checkpoint format {got!r}, expected 1 or {FORMAT}")
    for key, want in expect_meta.items():
        got = state["meta"].get(key)
        if got != want:
            raise ValueError(f"{state_path}: checkpoint has {key}={got!r}, this run {want!r}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng_path = path / f"rng-{rank}.pt"
    if rng_path.is_file():
        _set_rng_state(_torch_load(rng_path))
    return Resumed(next_step=int(state["next_step"]), meta=dict(state["meta"]), directory=path)


def config_meta(config: object) -> dict[str, Any]:
    """A dataclass config as a plain dict, for ``meta``."""
    return asdict(config)  # type: ignore[call-overload, no-any-return]
