"""A tiny valid plan built by hand (no solver), for format and validation tests."""

from __future__ import annotations

import numpy as np

from planner.planfile.schema import DatasetInfo, ParallelInfo, PlanHeader, fingerprint_lengths

# 6 samples, pool of 4 ranks, capacity 16 tokens per rank.
LENGTHS = np.array([10, 40, 7, 16, 3, 12], dtype=np.int64)


def header(**overrides: object) -> PlanHeader:
    fields: dict[str, object] = dict(
        dataset=DatasetInfo(path="mem", num_samples=len(LENGTHS), num_tokens=int(LENGTHS.sum()),
                            fingerprint=fingerprint_lengths(LENGTHS), format="test"),
        parallel=ParallelInfo(dp=2, cp=2, tp=1, pp=1, vpp=1, sequence_parallel=False,
                              pool_size=4, microbatch_group_size=1),
        capacity_tokens_per_rank=16, cp_sizes=(1, 2, 4), layout="zigzag",
        global_batch={"size": 3, "tokens": 0, "drop_last": False}, seed=0,
        cost_model={"name": "t", "parameters": {"linear_s_per_token": 1.0,
                                                "attention_s_per_token2": 0.0}},
        stats={"dropped_samples": [], "truncated_samples": []}, epochs=((0, 2),),
    )
    fields.update(overrides)
    return PlanHeader(**fields)  # type: ignore[arg-type]


def steps() -> list[dict[str, np.ndarray]]:
    """Step 0: samples 1 (40 tok, cp4), 0 and 2 (cp1 each, ranks 0,1), 5 and 4 share a cp2 group.
    Step 1: sample 3 (cp1), fillers elsewhere."""
    rows0 = [  # step, mb, start, k, sample, offset, ntok, padded
        (0, 0, 0, 1, 0, 0, 10, 10),
        (0, 0, 1, 1, 2, 0, 7, 7),
        (0, 0, 2, 2, 5, 0, 12, 12),
        (0, 0, 2, 2, 4, 0, 3, 4),
        (0, 1, 0, 4, 1, 0, 40, 40),
    ]
    rows1 = [
        (1, 0, 0, 1, 3, 0, 16, 16),
        (1, 0, 1, 1, -1, 0, 0, 1),
        (1, 0, 2, 2, -1, 0, 0, 4),
    ]
    return [_cols(rows0), _cols(rows1)]


def _cols(rows: list[tuple[int, ...]]) -> dict[str, np.ndarray]:
    a = np.array(rows, dtype=np.int64)
    names = ["step", "microbatch", "rank_start", "cp_size", "sample_index", "token_offset",
             "num_tokens", "padded_tokens"]
    return {n: a[:, i] for i, n in enumerate(names)}
