"""Plan checksums (format version 2): the header and every step's rows carry a sha256.

- The header: schema metadata key ``dcp.plan.sha256`` holds the hex sha256 of the ``dcp.plan``
  JSON bytes exactly as stored.
- Step ``i``: its record batch message carries the custom metadata key ``dcp.step.sha256``, the
  hex sha256 of the step's rows: a domain tag, the row count (int64 little-endian), then each
  plan column in schema order as its little-endian values (``step_digest``).

Together with the exact column types (``schema.check_schema``) and the check that the Arrow
file's two copies of the schema agree (``io.PlanFile``), every byte that carries meaning is
covered: a flipped bit either fails a check, naming the file and what broke, or lands in bytes
that do not change what any reader sees (padding, unused flatbuffer slots). Per-step digests
rather than one digest of the file keep ``step(i)`` O(1) and let a streaming writer emit each
step as it is made (the header digest is known before the first step).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

HEADER_CHECKSUM_KEY = b"dcp.plan.sha256"
STEP_CHECKSUM_KEY = b"dcp.step.sha256"
_STEP_TAG = b"dcp-step-v2\0"


def header_digest(header_json: bytes) -> str:
    """Hex sha256 of the header's JSON bytes."""
    return hashlib.sha256(header_json).hexdigest()


def step_digest(columns: Sequence[NDArray[Any]]) -> str:
    """Hex sha256 of one step's rows, given its plan columns in schema order."""
    h = hashlib.sha256(_STEP_TAG)
    rows = len(columns[0]) if columns else 0
    h.update(np.int64(rows).astype("<i8").tobytes())
    for col in columns:
        little = col.dtype.newbyteorder("<")
        h.update(np.ascontiguousarray(col, dtype=little).data)
    return h.hexdigest()
