"""The plan format's names that need neither numpy nor pyarrow: its version, kinds and header key.

``schema`` re-exports them; they live here so that ``dcp-plan --version``, ``--help`` and
``planner.config`` load none of the planning stack (issue 29).
"""

from __future__ import annotations

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Format versions this reader accepts (the version-1 plans in plans/golden must keep reading).
Version 2 adds the header's ``kind``, ``dataset.files`` and ``global_batch.blend``, and the
header and per-step sha256 (``planner.planfile.checksum``)."""
TRAIN = "train"
EVAL = "eval"
PLAN_KINDS = (TRAIN, EVAL)
"""Header ``kind``: a training plan (epochs of shuffled global batches, one per optimizer step) or
an evaluation plan (one pass over the dataset in file order, the last partial batch kept)."""
HEADER_KEY = b"dcp.plan"
CREATOR = "dcp-planner"
CREATOR_VERSION = "0.1.0"
