"""Save and resume a Megatron run through Megatron's ``dist_checkpointing``, one atomic unit each.

Layout (``DIR`` is ``--save`` / ``--resume``; the native trainer's rules, ``runtime.train.
checkpoint``)::

    DIR/latest                  name of the newest complete checkpoint, replaced atomically
    DIR/step-00000002/          training continues at step 2
        model/                  Megatron's distributed checkpoint of the model and optimizer
                                (common.pt, metadata.json, .metadata, __<rank>_<n>.distcp)
        run.json                plan position, plan digest and model, megatron-core version,
                                layout, optimizer kind
        rng/rank-<r>.pt         each rank's RNG states (torch CPU and CUDA, numpy, Megatron's
                                model-parallel CUDA tracker), tensors only
        manifest.json           size and sha256 of every file above; written last

What Megatron saves is what it saves for its own jobs: every chunk's ``sharded_state_dict``
(``model`` or ``model0``, ``model1`` ... under virtual stages: TP slices and PP stages as
ShardedTensors) and the optimizer's (``dp_reshardable``: the distributed optimizer's shards as
each rank holds them). A save goes into ``DIR/.step-N.tmp/`` (rank 0 creates it, every rank
writes its part, Megatron's writers fsync), the ranks hash the files between them (one
all-gather of digests), rank 0 writes the manifest last, renames the directory and moves
``latest``. Every step agrees through an all-reduce, so a failure on one rank fails every rank
with its message, and the previous checkpoint stays ``latest``.

Loading checks before anything is read into the model: the manifest (every file present, its
size and sha256, hashed by the ranks between them), ``run.json`` (same plan, model, world and
optimizer kind), and torch's checkpoint metadata (``model/.metadata``, a pickle that torch reads
with ``pickle.load``) through an unpickler that admits only the checkpoint metadata's own
classes; the objects stored inside the shards (torch unpickles them with
``weights_only=False``) are read with ``weights_only=True`` during the load
(``runtime.train.dcpsafe``), as are Megatron's ``common.pt`` (0.16; 0.19 keeps
it in the shards) and the RNG files: a crafted checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.planfile.io import fsync_dir
from runtime.adapters.megatron.compat import mcore, patches
from runtime.adapters.megatron.model.gpt import unwrap
from runtime.adapters.megatron.parallel import ddp
from runtime.train import checkpoint as native
from runtime.train import savetarget
from runtime.train.dcpsafe import check_metadata_pickle, objects_load_as_data
from runtime.train.rngstate import load_rng, rng_state, set_rng_state

FORMAT = 1
RUN_FILE = "run.json"
MODEL_DIR = "model"
SHARDING = "dp_reshardable"
"""The distributed optimizer's checkpoint layout: each rank's shard as it holds it (the plan
fixes the layout, so a resume never reshards)."""


def _agree(error: str) -> None:
    """Raise ``ValueError`` on every rank if any rank has an ``error`` (the lowest rank's)."""
    errors: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), "")
    if first:
        raise ValueError(first)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _share(items: list[str]) -> list[str]:
    """This rank's share of ``items`` (round robin over the world)."""
    return items[dist.get_rank()::dist.get_world_size()]


# ---- state dicts ------------------------------------------------------------------------------

def _metadata(groups: Any) -> dict[str, Any]:
    return {"dp_cp_group": groups.pool_group, "distrib_optim_sharding_type": SHARDING}


def _state_dict(chunks: list[nn.Module], optimizer: Any, scheduler: Any, groups: Any, *,
                loading: bool) -> dict[str, Any]:
    meta = _metadata(groups)
    inner: list[Any] = [unwrap(c) for c in chunks]
    with patches.checkpoint_groups(groups.pg_collection.tp, groups.pool_group):
        models = [m.sharded_state_dict(metadata=meta) for m in inner]
    keyed = ({"model": models[0]} if len(models) == 1
             else {f"model{i}": m for i, m in enumerate(models)})
    model_sd = models[0] if len(models) == 1 else keyed
    if loading:
        fresh_adam_state(optimizer)
    with patches.checkpoint_groups(groups.pg_collection.tp, groups.pool_group):
        opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=meta)
    state = {**keyed, "optimizer": opt_sd}
    if scheduler is not None:  # Megatron-LM's key; a common (unsharded) entry
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def fresh_adam_state(optimizer: Any) -> None:
    """Give a fresh torch Adam the state its first step would create, so Megatron can describe
    the state it is about to load (without Apex or TE its optimizers are torch's AdamW, which
    holds no state before a step); the checkpoint's values replace these zeros."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)


# ---- RNG ----------------------------------------------------------------------------------------

def _tracker_states() -> dict[str, torch.Tensor]:
    """Megatron's model-parallel CUDA RNG tracker (TE's dropout and init draw from it)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return {}
    return dict(mcore.tp_random.get_cuda_rng_tracker().get_states())


def _load_tracker(path: Path) -> dict[str, torch.Tensor]:
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file raises anything
        raise ValueError(f"{path}: unreadable checkpoint file ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) and v.dtype == torch.uint8
            for k, v in raw.items()):
        raise ValueError(f"{path}: not Megatron's RNG tracker states (name -> uint8 tensor)")
    return raw


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ---- save ---------------------------------------------------------------------------------------

def save(directory: str | os.PathLike[str], *, chunks: list[nn.Module], optimizer: Any,
         scheduler: Any, groups: Any, options: Any, next_step: int, meta: dict[str, Any]) -> Path:
    """Save a checkpoint atomically (collective over the job: every rank calls it).

    Raises:
        ValueError: a write failed on some rank (its path and error, on every rank); the
            previous checkpoint stays the latest.
    """
    root = Path(directory)
    name = native.step_dir_name(next_step)
    final, staging = root / name, root / f".{name}.tmp"
    rank, world = dist.get_rank(), dist.get_world_size()
    error = ""
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for p in root.glob(".step-*.*"):  # saves that were killed (only ours)
                if p.is_dir() and not p.is_symlink() and _only_ours(p):
                    shutil.rmtree(p, ignore_errors=True)
            (staging / MODEL_DIR).mkdir(parents=True)
            (staging / "rng").mkdir()
            run = {"format": FORMAT, "framework": "megatron", "next_step": next_step,
                   "meta": meta, "megatron_core": mcore.VERSION, "world_size": world,
                   "use_distributed_optimizer": options.use_distributed_optimizer,
                   "sharding_type": SHARDING}
            _write(staging / RUN_FILE, json.dumps(run, indent=1, sort_keys=True).encode())
        except (OSError, ValueError) as e:
            error = f"{staging}: cannot create the checkpoint: {getattr(e, 'strerror', '') or e}"
    _agree(error)
    try:
        ddp.sync_params(chunks, options)  # parameters still being gathered (overlap)
        state = _state_dict(chunks, optimizer, scheduler, groups, loading=False)
        mcore.dist_checkpointing.save(state, str(staging / MODEL_DIR))
        for name, obj in ((f"rank-{rank}.pt", rng_state()),
                          (f"tracker-{rank}.pt", _tracker_states())):
            buf = io.BytesIO()
            torch.save(obj, buf)
            _write(staging / "rng" / name, buf.getvalue())
    except (OSError, RuntimeError) as e:
        error = f"{staging}: rank {rank} cannot write its part of the checkpoint: {e}"
    _agree(error)
    digests: dict[str, dict[str, Any]] = {}
    try:
        for rel in _share(_files(staging)):
            p = staging / rel
            digests[rel] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    except OSError as e:
        error = f"{staging}: cannot read back the checkpoint: {e}"
    _agree(error)
    gathered: list[dict[str, Any]] = [{}] * world
    dist.all_gather_object(gathered, digests)
    if rank == 0:
        try:
            files = {k: v for d in gathered for k, v in d.items()}
            manifest = {"format": FORMAT, "next_step": next_step, "files": files}
            _write(staging / native.MANIFEST_FILE,
                   json.dumps(manifest, indent=1, sort_keys=True).encode())
            for d in [staging, staging / MODEL_DIR, staging / "rng"]:
                fsync_dir(d)
            native._install(root, staging, final, is_ours=is_checkpoint)
        except OSError as e:
            error = f"{root}: cannot complete checkpoint {name}: {e.strerror or e}"
    try:
        _agree(error)
    except ValueError:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


_OURS = {MODEL_DIR, "rng", RUN_FILE, native.MANIFEST_FILE}
"""The names a Megatron checkpoint directory holds (Megatron's files live under model/)."""


def _only_ours(p: Path) -> bool:
    try:
        return all(q.name in _OURS for q in p.iterdir())
    except OSError:
        return False


def is_checkpoint(p: Path) -> bool:
    """A checkpoint this module wrote (complete: its manifest is there), or a killed save's
    leftover of ours, or ``latest``: what a save may replace."""
    if p.name == native.LATEST_FILE:
        return savetarget._is_native_entry(p)
    return p.is_dir() and not p.is_symlink() and _only_ours(p) and (
        (p / native.MANIFEST_FILE).is_file() or p.name.startswith("."))


def check_target(directory: str, *, start: int, stop: int, save_every: int,
                 inputs: list[str]) -> None:
    """``--save DIR`` before the first step (collective): the native rules
    (``runtime.train.checkpoint.check_save_target``) with this layout's recogniser: every entry
    the run's saves would create or replace must be one of ours."""
    native.check_save_target(directory, dist.get_rank(),
                             writes=native.native_saves(start, stop, save_every),
                             is_ours=is_checkpoint, inputs=inputs)


# ---- load ---------------------------------------------------------------------------------------

def load(directory: str | os.PathLike[str], *, chunks: list[nn.Module], optimizer: Any,
         scheduler: Any, groups: Any, options: Any, expect_meta: dict[str, Any]) -> native.Resumed:
    """Verify and restore ``directory`` (a checkpoint, or the latest under it); collective.

    Raises:
        ValueError: no checkpoint, a missing, truncated or damaged file (named), metadata that
            would run code, or a checkpoint of another plan, model, world or optimizer kind.
    """
    error, path = "", Path(directory)
    run: dict[str, Any] = {}
    try:
        path = native.resolve(directory)
        run = _check_run(path, expect_meta, options)
        _verify_share(path)
        check_metadata_pickle(path / MODEL_DIR / ".metadata")
    except ValueError as e:
        error = str(e)
    _agree(error)
    state = _state_dict(chunks, optimizer, scheduler, groups, loading=True)
    with objects_load_as_data():
        loaded = mcore.dist_checkpointing.load(state, str(path / MODEL_DIR))
    if scheduler is not None:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    for i, c in enumerate(chunks):
        unwrap(c).load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"])
    with torch.no_grad():  # fp32 main weights are views of the parameters
        optimizer.load_state_dict(loaded["optimizer"])
    rank = dist.get_rank()
    try:
        set_rng_state(load_rng(path / "rng" / f"rank-{rank}.pt", 3))
        tracker = _load_tracker(path / "rng" / f"tracker-{rank}.pt")
        if tracker and torch.cuda.is_available():
            mcore.tp_random.get_cuda_rng_tracker().set_states(tracker)
    except ValueError as e:
        error = str(e)
    _agree(error)
    return native.Resumed(next_step=int(run["next_step"]), meta=dict(run["meta"]),
                          directory=path)


def saved_settings(path: str | os.PathLike[str]) -> list[tuple[float, float]] | None:
    """The optimizer groups' ``(lr, weight_decay)`` a checkpoint was saved with (its run file's
    ``meta.settings``), read before any load; None for a checkpoint saved before they were
    recorded, or an unreadable run file (``load`` then names what is wrong)."""
    try:
        got = json.loads((Path(path) / RUN_FILE).read_text())["meta"]["settings"]
        return [(float(lr), float(wd)) for lr, wd in got]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_run(path: Path, expect_meta: dict[str, Any], options: Any) -> dict[str, Any]:
    run_path = path / RUN_FILE
    if not run_path.is_file():
        if (path / native.STATE_FILE).is_file() or (path / native.MANIFEST_FILE).is_file():
            raise ValueError(f"{path}: a checkpoint of another --framework (no {RUN_FILE}); "
                             "resume it with the framework that saved it")
        raise ValueError(f"{run_path}: missing; {path} is not a Megatron checkpoint")
    try:
        run = json.loads(run_path.read_text())
        int(run["next_step"])
        dict(run["meta"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{run_path}: damaged ({e})") from None
    if run.get("format") != FORMAT or run.get("framework") != "megatron":
        raise ValueError(f"{run_path}: format {run.get('format')!r} of framework "
                         f"{run.get('framework')!r}, expected {FORMAT} of megatron")
    for key, want in expect_meta.items():
        if run["meta"].get(key) != want:
            raise ValueError(f"{run_path}: checkpoint has {key}={run['meta'].get(key)!r}, this "
                             f"run {want!r}")
    if run.get("world_size") != dist.get_world_size():
        raise ValueError(f"{run_path}: saved by {run.get('world_size')} ranks, this job has "
                         f"{dist.get_world_size()}")
    if bool(run.get("use_distributed_optimizer")) != options.use_distributed_optimizer:
        flag = "with" if run.get("use_distributed_optimizer") else "without"
        raise ValueError(f"{run_path}: saved {flag} --use-distributed-optimizer; resume the "
                         "same way")
    return dict(run)


def _verify_share(path: Path) -> None:
    """This rank's share of the manifest's files: present, of the right size and sha256."""
    mpath = path / native.MANIFEST_FILE
    if not mpath.is_file():
        raise ValueError(f"{mpath}: missing; {path} is an incomplete checkpoint")
    try:
        files = dict(json.loads(mpath.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{mpath}: damaged checkpoint manifest ({e})") from None
    for name in (RUN_FILE, f"{MODEL_DIR}/.metadata", f"{MODEL_DIR}/metadata.json"):
        if name not in files:
            raise ValueError(f"{mpath}: lists no {name}")
    for rel in _share(sorted(files)):
        p, want = path / rel, files[rel]
        if not p.is_file():
            raise ValueError(f"{p}: missing from the checkpoint")
        if p.stat().st_size != want.get("bytes"):
            raise ValueError(f"{p}: damaged checkpoint file: {p.stat().st_size} bytes, the "
                             f"manifest says {want.get('bytes')} (truncated?)")
        if _sha256(p) != want.get("sha256"):
            raise ValueError(f"{p}: damaged checkpoint file: sha256 differs from the manifest")
