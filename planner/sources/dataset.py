"""Datasets of many files: paths, directories and globs in a documented order; Megatron blends.

A dataset is an ordered list of files; sample indices run through them in that order (the first
file's records are samples 0..n0-1, the second's follow, ...). The order, documented for users:

1. the arguments in the order given (``dcp-plan a.jsonl b.jsonl``, or ``--data-path A B``);
2. a directory stands for the dataset files directly inside it (not in sub-directories), a glob
   (``'shards/*.jsonl.zst'``, quoted so the shell leaves it) for the files it matches; either is
   sorted by path, by code point (zero-padded shard numbers sort as numbers do). A directory's
   Megatron pair ``x.bin``/``x.idx`` is one file, ``x``; hidden files and ``.dcpidx`` index caches
   are not dataset files, nor are a Hugging Face ``save_to_disk`` folder's metadata
   (``dataset_info.json``, ``state.json``, ``dataset_dict.json``: its data are the ``.arrow``
   files beside them), nor this tool's own outputs: dcp plans, JSON summaries
   (``--summary-json``) and ``dcp-train --log-jsonl`` logs (left out with a notice: an output
   written into a dataset's directory must not become data of the next plan or run).

The same file twice is an error (it would be two samples of one record). Megatron's
``--data-path`` may interleave weights: ``0.3 A 0.7 B`` (Megatron-core's rule: if the first item
is a number, items are (weight, path) pairs; otherwise every item is a path). Each weighted
entry (which may itself be a directory or a glob) is a *group*; weights decide how many samples
each step draws from each group (``blend_counts``).
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["DataFile", "blend_counts", "expand_paths", "file_identity", "parse_data_path",
           "plan_items"]

_GLOB_CHARS = frozenset("*?[")
INDEX_CACHE_SUFFIXES = (".dcpidx", ".dcptok", ".dcplen")
"""Files the runtime and the planner write beside a dataset (index caches, text lengths
caches): never dataset files."""
HF_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")
"""What Hugging Face ``datasets``' ``save_to_disk`` writes beside its ``.arrow`` data files."""
PLAN_SUFFIXES = (".arrow", ".feather", ".ipc")
"""Names a dcp plan may have among dataset files (Arrow IPC): such a file is opened to tell."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataFile:
    """One file of a dataset: where it is, what it holds and its fingerprint."""

    path: str
    """The path as expanded from the arguments (not resolved: plans stay portable)."""
    format: str
    """One of ``planner.sources.lengths.FORMATS``."""
    num_samples: int
    """Records of this file (skipped bad records included)."""
    num_tokens: int
    """Real tokens of this file."""
    fingerprint: str
    """sha256 of this file's lengths (``fingerprint_lengths``)."""
    group: int = 0
    """Which ``--data-path`` entry (blend group) the file came from."""
    content_fingerprint: str = ""
    """sha256 of this file's tokens (``planner.sources.content``; ``dcp-plan --fingerprint
    content``); empty: not computed."""
    num_sequences: int = 0
    """A Megatron file's sequences (its samples are documents or sequences: the plan's
    ``dataset.megatron_unit``); 0 (and absent from the JSON): not a Megatron file."""
    num_documents: int = 0
    """A Megatron file's documents; 0 (and absent from the JSON): not a Megatron file, or an
    index without document indices."""

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        # Plans made without them keep their bytes.
        for key in ("content_fingerprint", "num_sequences", "num_documents"):
            if not d[key]:
                del d[key]
        return d


def parse_data_path(items: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Split Megatron's ``--data-path`` list into (paths, weights or None).

    Raises:
        ValueError: weights and paths do not pair up, or a weight is not a positive number.
    """
    items = list(items)
    if not items:
        return [], None
    try:
        float(items[0])
    except ValueError:
        return items, None
    if len(items) % 2:
        raise ValueError(f"--data-path: {len(items)} items; with weights they come in pairs "
                         "'WEIGHT PATH WEIGHT PATH ...'")
    weights: list[float] = []
    paths: list[str] = []
    for w, path in zip(items[0::2], items[1::2], strict=True):
        try:
            value = float(w)
        except ValueError:
            raise ValueError(f"--data-path: {w!r} (before {path!r}) is not a weight; give "
                             "'WEIGHT PATH' pairs or paths only") from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--data-path: weight {w} of {path!r} must be a positive number")
        weights.append(value)
        paths.append(path)
    return paths, weights


_ESCAPED = re.compile(r"\[([*?[])\]")


def plan_items(files: Sequence[dict[str, object]], path: str) -> tuple[str, ...]:
    """A plan header's dataset (``dataset.files``, else format 1's ``dataset.path``) as
    ``expand_paths`` items: each stored file is that file, never a pattern (its glob
    characters escaped), so ``star[1].jsonl`` moved away is missing, not ``star1.jsonl``."""
    return tuple(glob.escape(str(f["path"])) for f in files) or (path,)


def _unescaped(item: str) -> str | None:
    """The file an item names whose every glob character is escaped (``glob.escape``'s
    ``[*]``, ``[?]``, ``[[]``): a literal path, never a pattern; else None."""
    plain = _ESCAPED.sub(r"\1", item)
    return plain if plain != item and glob.escape(plain) == item else None


def _is_dataset_file(p: Path, suffixes: Sequence[str]) -> bool:
    name = p.name
    if name.startswith(".") or name.endswith(INDEX_CACHE_SUFFIXES) or name in HF_METADATA \
            or not p.is_file():
        return False
    return name.lower().endswith(tuple(suffixes))


def _directory(path: str, suffixes: Sequence[str]) -> list[str]:
    found = sorted(str(p) for p in Path(path).iterdir() if _is_dataset_file(p, suffixes))
    out: list[str] = []
    for f in found:
        lower = f.lower()
        if lower.endswith(".bin") and f[:-4] + ".idx" in found:
            continue  # the pair is listed once, as its prefix, from the .idx
        out.append(f[:-4] if lower.endswith(".idx") else f)
    if not out:
        splits = (Path(path) / "dataset_dict.json").is_file()
        hint = ("; it is a Hugging Face DatasetDict (save_to_disk): give one split's folder, "
                f"such as {Path(path) / 'train'}" if splits else "")
        raise ValueError(f"{path}: directory holds no dataset files (suffixes "
                         f"{', '.join(suffixes)}){hint}")
    return out


def _is_plan(path: str) -> bool:
    """A dcp plan (an Arrow file with a ``dcp.plan`` header): an output, never a dataset."""
    if not path.lower().endswith(PLAN_SUFFIXES):
        return False
    from planner.fileguard import is_plan_file  # pyarrow: only for Arrow-named files

    return is_plan_file(path)


def _own_output(path: str) -> str:
    """What this tool wrote, if ``path`` is one of its outputs (a dcp plan, a ``--summary-json``
    JSON summary or cost model, a ``dcp-train --log-jsonl`` log), else ''."""
    if _is_plan(path):
        return "a dcp plan"
    if not path.lower().endswith((".json", ".jsonl")):
        return ""
    from planner.fileguard.kinds import KINDS

    try:
        if os.path.getsize(path) == 0:
            return ""  # an empty file is nobody's output: an empty dataset file
    except OSError:
        return ""
    if KINDS["summary"].own(Path(path)):
        return "a JSON summary (--summary-json)"
    if KINDS["log"].own(Path(path)):
        return "a dcp-train log (--log-jsonl)"
    return ""


def expand_paths(items: Sequence[str], suffixes: Sequence[str],
                 notice: Callable[[str], None] | None = None) -> list[tuple[str, int]]:
    """Every file of the dataset, in order, each with the index of the item it came from.

    A dcp plan is never a dataset file: given by name it is refused; found in a directory or
    by a glob it is left out, and ``notice`` (if given) is told which.

    Args:
        items: files, directories, globs or Megatron prefixes, in the order given.
        suffixes: what a dataset file inside a directory ends with (lower case).
        notice: called with one line per plan file left out of a directory or glob.

    Raises:
        ValueError: an item matches nothing, a file appears twice, an item is a plan, or a
            named file is not a regular file (a FIFO, a device, a symlink loop).
    """
    from planner.fileguard import check_input

    out: list[tuple[str, int]] = []
    for g, item in enumerate(items):
        item = os.fspath(item)
        plain = _unescaped(item)
        item = item if plain is None else plain
        expanded = True
        if os.path.isdir(item):
            files = _directory(item, suffixes)
        elif plain is not None or os.path.lexists(item) or os.path.isfile(f"{item}.idx") or not (
                _GLOB_CHARS & set(item)):
            check_input(item, "a dataset file")
            if _is_plan(item):
                raise ValueError(f"{item}: is a dcp plan, not a dataset; give the dataset the "
                                 "plan was made from (plans are outputs: dcp-plan -o)")
            files, expanded = [item], False
        else:
            matched = sorted(glob.glob(item))
            files = [f for f in matched if _is_dataset_file(Path(f), suffixes)]
            if not files:
                raise ValueError(f"{item}: no dataset file matches this pattern"
                                 + (f" ({len(matched)} other files do)" if matched else ""))
        own = {f: what for f in files if (what := _own_output(f))} if expanded else {}
        if own:
            files = [f for f in files if f not in own]
            if notice is not None:
                for f, what in own.items():
                    notice(f"{f}: {what} in {item!r}, not a dataset file: left out")
            if not files:
                what = ("dcp plans" if set(own.values()) == {"a dcp plan"}
                        else "this tool's outputs")
                raise ValueError(f"{item}: holds only {what} ({', '.join(own)}), no dataset "
                                 "file")
        out.extend((f, g) for f in files)
    seen: dict[object, str] = {}
    for f, _ in out:
        key = file_identity(f)
        if key in seen:
            raise ValueError(f"{f}: the same file is given twice (as {seen[key]!r} too); a "
                             "dataset lists each file once")
        seen[key] = f
    return out


def file_identity(f: str) -> object:
    """What makes two names one dataset file: the device and inode (hard links, symlinks,
    other spellings), a Megatron pair's ``.idx`` for the pair (``m``, ``m.idx``, ``m.bin``)."""
    lower = f.lower()
    pair = f[:-4] + ".idx" if lower.endswith((".bin", ".idx")) else f + ".idx"
    for name in (pair, f):
        try:
            st = os.stat(name)
        except OSError:
            continue
        if name == f or os.path.isfile(name) and (lower.endswith((".bin", ".idx"))
                                                  or not os.path.isfile(f)):
            return (st.st_dev, st.st_ino)
    return os.path.realpath(f)


def blend_counts(weights: Sequence[float], global_batch_size: int) -> list[int]:
    """Samples each group gives every step: ``B * w / sum(w)``, rounded by largest remainder.

    Deterministic: ties in the remainder go to the earlier group. Example: weights (0.3, 0.7),
    B = 64 -> exact (19.2, 44.8) -> [19, 45].

    Raises:
        ValueError: a group would give no sample per step.
    """
    total = float(sum(weights))
    exact = [global_batch_size * w / total for w in weights]
    if not all(math.isfinite(x) for x in exact):
        # Weights near the float limit (1e308 + 1e308 overflows): the same shares, scaled
        # first. Finite sums keep the formula above, so their counts never change.
        top = max(weights)
        scaled = [w / top for w in weights]
        exact = [global_batch_size * (w / sum(scaled)) for w in scaled]
    counts = [int(math.floor(x)) for x in exact]
    rest = global_batch_size - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    for i, c in enumerate(counts):
        if c == 0:
            raise ValueError(f"--data-path weight {weights[i]:g} of entry {i} gives 0 of "
                             f"{global_batch_size} samples per step; raise the weight or "
                             "--global-batch-size")
    return counts
