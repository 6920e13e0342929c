"""The plan file's contract (docs/PLAN_FORMAT.md, format version 2): columns, Arrow schema, header.

Every invariant of the contract is checked by ``planner.planfile.validate.validate``.

Header: schema metadata key ``dcp.plan`` holding a UTF-8 JSON object (keys sorted, so the bytes are
deterministic). Readers reject a format version they do not know, naming both versions; they
read every version in ``READABLE_VERSIONS`` (version 1 has no ``kind``: it reads as ``train``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from planner.planfile import version
from planner.planfile.checksum import HEADER_CHECKSUM_KEY, header_digest

# The contract's names, defined in version.py (no numpy or pyarrow there) and named here too.
FORMAT_VERSION = version.FORMAT_VERSION
READABLE_VERSIONS = version.READABLE_VERSIONS
TRAIN = version.TRAIN
EVAL = version.EVAL
PLAN_KINDS = version.PLAN_KINDS
HEADER_KEY = version.HEADER_KEY
CREATOR = version.CREATOR
CREATOR_VERSION = version.CREATOR_VERSION

COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("step", pa.int32()),
    ("microbatch", pa.int32()),
    ("rank_start", pa.int32()),
    ("cp_size", pa.int32()),
    ("sample_index", pa.int64()),
    ("token_offset", pa.int64()),
    ("num_tokens", pa.int32()),
    ("padded_tokens", pa.int32()),
)
COLUMN_NAMES = tuple(name for name, _ in COLUMNS)
NUMPY_DTYPES = {name: np.dtype(t.to_pandas_dtype()) for name, t in COLUMNS}
_TYPES = dict(COLUMNS)
MEGATRON_UNITS = ("document", "sequence")
"""What a sample of a Megatron ``.bin``/``.idx`` file is (``dataset.megatron_unit``)."""
LEGACY_MEGATRON_UNIT = "sequence"
"""The unit of a plan whose header records none: plans made before it was recorded planned
sequences."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetInfo:
    """Which dataset a plan was made for; the fingerprint hashes its lengths in file order."""

    path: str
    num_samples: int
    num_tokens: int
    fingerprint: str
    format: str = ""
    files: list[dict[str, Any]] = field(default_factory=list)
    """Format 2: every file in sample order (path, format, num_samples, num_tokens, fingerprint,
    group, and with ``--fingerprint content`` content_fingerprint); empty in version 1 plans
    (one file, ``path``)."""
    content_fingerprint: str = ""
    """Format 2, ``dcp-plan --fingerprint content``: sha256 over the files' content fingerprints
    (``planner.sources.content``); empty (and absent from the JSON): lengths only."""
    field: str = ""
    """Format 2, ``dcp-plan --field NAME``: the record field (JSONL) or column (Parquet, Arrow)
    the lengths, and so the runtime's tokens, were read from; empty (and absent from the JSON):
    the default fields (``input_ids``, ``tokens``, ...)."""
    # dataclasses.field: the name ``field`` is this class's attribute above.
    tokenizer: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Format 2, a text corpus (``dcp-plan --tokenizer``): the tokenizer the lengths were
    counted with (``planner.sources.textenc.TokenizerSpec.to_dict()``: path, sha256,
    vocab_size, bos, append_eod, bos_id, eod_id); empty (and absent from the JSON): token ids."""
    megatron_unit: str = ""
    """Format 2, ``dcp-plan --megatron-unit``: what a sample of the dataset's Megatron files is,
    ``document`` or ``sequence``; empty (and absent from the JSON): no Megatron file, or a plan
    made before the unit was recorded, which planned sequences (``replay_megatron_unit``)."""

    @property
    def replay_megatron_unit(self) -> str:
        """The unit to read the Megatron files in: the recorded one, else ``sequence``."""
        return self.megatron_unit or LEGACY_MEGATRON_UNIT


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelInfo:
    """The parallel layout a plan was made for; the runtime checks the live job against it."""

    dp: int
    cp: int
    tp: int
    pp: int
    vpp: int
    sequence_parallel: bool
    pool_size: int
    microbatch_group_size: int

    @property
    def tp_eff(self) -> int:
        return self.tp if self.sequence_parallel else 1

    @property
    def microbatch_multiple(self) -> int:
        return self.microbatch_group_size if self.vpp > 1 else 1

    @property
    def world_size(self) -> int:
        """Processes a job of this plan runs: pool x tp x pp."""
        return self.pool_size * self.tp * self.pp

    @property
    def launch(self) -> str:
        """How to start that job on one node: ``torchrun --nproc-per-node 8``."""
        return f"torchrun --nproc-per-node {self.world_size}"

    def launch_hint(self, command: str = "") -> str:
        """The launch on one node and across nodes, for messages and the summary; ``command``
        (``-m runtime.train ARGS``) follows torchrun's own flags."""
        return describe_launch(self.dp, self.cp, self.tp, self.pp, command)


TRAIN_COMMAND = "-m runtime.train ARGS"
"""What follows torchrun's flags in a launch hint of ``dcp-train``'s errors (its own flags)."""


def describe_launch(dp: int, cp: int, tp: int, pp: int, command: str = "") -> str:
    """``torchrun --nproc-per-node 8 [COMMAND] (dp 1 x cp 2 x tp 2 x pp 2 = 8 processes; ...)``."""
    w = dp * cp * tp * pp
    run = f" {command}" if command else ""
    return (f"torchrun --nproc-per-node {w}{run} (dp {dp} x cp {cp} x tp {tp} x pp {pp} = {w} "
            f"process{'es' if w > 1 else ''}; on several nodes: --nnodes N "
            f"--nproc-per-node {w}/N)")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanHeader:
    """The ``dcp.plan`` header. ``stats`` holds derived numbers and the long-sequence policy log."""

    dataset: DatasetInfo
    parallel: ParallelInfo
    capacity_tokens_per_rank: int
    cp_sizes: tuple[int, ...]
    layout: str
    global_batch: dict[str, Any]
    seed: int
    cost_model: dict[str, Any]
    stats: dict[str, Any]
    epochs: tuple[tuple[int, int], ...] = ()
    """Per epoch (first_step, num_steps); steps of different epochs never share a sample."""
    solver: dict[str, Any] = field(default_factory=dict)
    kind: str = TRAIN
    """``train`` or ``eval`` (PLAN_KINDS); absent in version 1, which reads as ``train``."""
    pad_to_multiple: int = 1
    """Every padded length is also a multiple of this (``--pad-to-multiple``). Written only when
    > 1, so plans made without the option keep their bytes; absent reads as 1."""
    format_version: int = FORMAT_VERSION
    creator: dict[str, str] = field(
        default_factory=lambda: {"name": CREATOR, "version": CREATOR_VERSION}
    )

    @property
    def skips_bad_records(self) -> bool:
        """Made with ``--skip-bad-records``, which skipped some: readers of its dataset (the
        runtime, ``dcp-plan validate``) must skip them too, as the planner counted them."""
        return int(self.stats.get("skipped_bad_records", 0) or 0) > 0

    @property
    def num_steps(self) -> int:
        return sum(n for _, n in self.epochs)

    def to_json(self) -> str:
        """Deterministic JSON (sorted keys, no whitespace variation)."""
        d = asdict(self)
        d["cp_sizes"] = list(self.cp_sizes)
        d["epochs"] = [list(e) for e in self.epochs]
        if self.pad_to_multiple == 1:
            del d["pad_to_multiple"]
        if not self.dataset.content_fingerprint:
            del d["dataset"]["content_fingerprint"]
        if not self.dataset.field:
            del d["dataset"]["field"]
        if not self.dataset.tokenizer:
            del d["dataset"]["tokenizer"]
        if not self.dataset.megatron_unit:
            del d["dataset"]["megatron_unit"]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "plan") -> PlanHeader:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: header is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{source}: header is not a JSON object")
        version = d.get("format_version")
        if version not in READABLE_VERSIONS or type(version) is not int:
            readable = ", ".join(str(v) for v in READABLE_VERSIONS)
            raise ValueError(
                f"{source}: plan format version {version!r} is not supported "
                f"(this dcp-planner reads versions {readable})"
            )
        try:
            return cls(
                dataset=DatasetInfo(**d["dataset"]),
                parallel=ParallelInfo(**d["parallel"]),
                capacity_tokens_per_rank=int(d["capacity_tokens_per_rank"]),
                cp_sizes=tuple(int(k) for k in d["cp_sizes"]),
                layout=str(d["layout"]),
                global_batch=dict(d["global_batch"]),
                seed=int(d["seed"]),
                cost_model=dict(d["cost_model"]),
                stats=dict(d["stats"]),
                epochs=tuple((int(a), int(b)) for a, b in d.get("epochs", [])),
                solver=dict(d.get("solver", {})),
                kind=str(d.get("kind", TRAIN)),
                pad_to_multiple=int(d.get("pad_to_multiple", 1)),
                format_version=int(version),
                creator=dict(d.get("creator", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: header is missing or has a malformed field: {e}") from None


def arrow_schema(header: PlanHeader) -> pa.Schema:
    """The plan's Arrow schema with the header (and its sha256) attached as metadata."""
    text = header.to_json().encode()
    return pa.schema(
        [pa.field(n, t, nullable=False) for n, t in COLUMNS],
        metadata={HEADER_KEY: text, HEADER_CHECKSUM_KEY: header_digest(text).encode()},
    )


def check_schema(schema: pa.Schema, source: str) -> None:
    """Raise ValueError unless ``schema`` has every plan column with its exact type.

    Column data is read as raw buffers of the expected width (``column_numpy``), so a column of
    another type would be read as garbage rather than refused.
    """
    for name, typ in COLUMNS:
        if name not in schema.names:
            raise ValueError(f"{source}: plan lacks column {name!r}")
        f = schema.field(name)
        if f.type != typ or f.nullable:
            raise ValueError(f"{source}: plan column {name!r} has type {f.type}"
                             f"{' (nullable)' if f.nullable else ''}, expected non-null {typ}")


def fingerprint_lengths(lengths: NDArray[np.integer]) -> str:
    """Dataset fingerprint: sha256 of the sample lengths in file order (int64 little-endian)."""
    h = hashlib.sha256(b"dcp-lengths-v1\0")
    h.update(np.ascontiguousarray(lengths, dtype="<i8").tobytes())
    return "sha256:" + h.hexdigest()


def dataset_content_fingerprint(files: Sequence[str]) -> str:
    """A dataset's content fingerprint from its files' (``planner.sources.content``), in order:
    sha256 of ``dcp-content-dataset-v1\\0`` and each file's fingerprint on a line."""
    text = "".join(f + "\n" for f in files)
    return "sha256:" + hashlib.sha256(b"dcp-content-dataset-v1\0" + text.encode()).hexdigest()


def step_batch(schema: pa.Schema, columns: dict[str, NDArray[Any]]) -> pa.RecordBatch:
    """One step's rows as a record batch with exactly the schema's column types."""
    # Build from buffers: pa.array(numpy) goes through pandas' type inference on first use,
    # which costs ~1 s of imports; the columns are plain fixed-width integers.
    arrays = []
    for name, typ in COLUMNS:
        a = np.ascontiguousarray(columns[name], dtype=NUMPY_DTYPES[name])
        arrays.append(pa.Array.from_buffers(typ, len(a), [None, pa.py_buffer(a)]))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def column_numpy(batch: pa.RecordBatch, name: str) -> NDArray[Any]:
    """A fixed-width, null-free column of ``batch`` as a zero-copy numpy view.

    ``Array.to_numpy`` would do the same but imports pandas on first use (~1-3 s); plan columns
    are plain integers, so a view of the data buffer is exact.
    """
    col = batch.column(name)
    if col.null_count:
        raise ValueError(f"plan column {name!r} holds nulls")
    want = _TYPES.get(name)
    if want is not None and col.type != want:
        raise ValueError(f"plan column {name!r} has type {col.type}, expected {want}")
    dtype = NUMPY_DTYPES.get(name) or np.dtype(col.type.to_pandas_dtype())
    data = col.buffers()[1]
    if data is None:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=len(col) + col.offset)[col.offset:]
