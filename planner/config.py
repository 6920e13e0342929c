"""Frozen configuration for the planner; validation lives here, argparse lives in cli.py.

Every field is checked in ``__post_init__`` and a bad value raises ``ValueError`` naming it, so a
config that exists is a config that can be planned (or fails with a clear capacity error).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.groups import (
    LAYOUTS,
    MAX_GROUP_TOKENS,
    ZIGZAG,
    check_cp_sizes,
    pad_multiple,
    valid_cp_sizes,
)
from planner.planfile.version import EVAL, PLAN_KINDS

LONG_SEQUENCE_POLICIES = ("error", "split", "truncate", "drop")
MAX_SEED = 2**64 - 1
"""Seeds are 64-bit (the permutation's splitmix64 keys)."""

EFFORTS = ("fast", "balanced", "max")
ENGINES = ("local", "ray")
"""Where step ranges are planned (solver/parallel.py): this machine's processes, or Ray tasks."""


class EngineError(RuntimeError):
    """A planning engine failed for a reason outside the planner and its input: a Ray worker or
    node died, the cluster could not be reached or went away. ``dcp-plan`` reports it in one
    line, as it does bad input."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """The job's parallel layout; dynamic CP redistributes the pool of dp x cp ranks."""

    dp: int
    """Data-parallel size."""
    cp: int
    """Static context-parallel size; the pool is dp x cp ranks."""
    tp: int = 1
    """Tensor-parallel size (static; multiplies the alignment with sequence parallelism)."""
    pp: int = 1
    """Pipeline-parallel size (static)."""
    vpp: int = 1
    """Virtual pipeline stages per rank; > 1 needs microbatch counts in multiples of the group
    size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: sequences must also split evenly over tp."""
    microbatch_group_size: int = 0
    """Microbatches per virtual-stage group with vpp > 1; 0 means pp (Megatron's default)."""

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "pp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.microbatch_group_size < 0:
            raise ValueError(
                f"microbatch_group_size must be >= 0, got {self.microbatch_group_size}"
            )
        if self.vpp > 1 and self.pp < 2:
            raise ValueError(f"vpp={self.vpp} needs pp >= 2, got pp={self.pp}")

    @property
    def pool_size(self) -> int:
        """N = dp x cp, the ranks that dynamic CP redistributes."""
        return self.dp * self.cp

    @property
    def tp_eff(self) -> int:
        """tp' = tp with sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel else 1

    @property
    def world_size(self) -> int:
        """Ranks of the whole job: pool x tp x pp."""
        return self.pool_size * self.tp * self.pp

    @property
    def group_size(self) -> int:
        """Effective microbatch group size (pp when not set)."""
        return self.microbatch_group_size or self.pp

    @property
    def microbatch_multiple(self) -> int:
        """Every step's microbatch count is a multiple of this (1 unless vpp > 1)."""
        return self.group_size if self.vpp > 1 else 1


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverConfig:
    """Knobs of the step solver (greedy.py, cpsat.py); recorded in the plan header's ``solver``."""

    microbatch_tolerance: float = 0.01
    """A step takes more microbatches than the fewest that fit only when that is at least this
    much faster (relative): issue 3 ranks time first, then microbatch count, so near-ties go to
    fewer microbatches (fuller slots)."""
    refine_gap: float = 0.02
    """Steps whose heuristic time exceeds the step's malleable lower bound by more than this
    (relative) are refined (target search, then CP-SAT) under efforts balanced and max."""
    cpsat_seconds: float = -1.0
    """CP-SAT deterministic time per refined step; < 0 means the effort's default (balanced 0.05,
    max 0.5); 0 disables CP-SAT."""
    seed: int = 0
    """CP-SAT random seed (results are reproducible for a fixed seed)."""
    baselines: bool = True
    """Score static CP (at the job's cp) and Megatron's greedy as candidates for every step and
    keep the fastest (planner/solver/candidates.py); False plans with our search alone."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.microbatch_tolerance < 1.0:
            raise ValueError(
                f"microbatch_tolerance must be in [0, 1), got {self.microbatch_tolerance}")
        if self.refine_gap < 0.0:
            raise ValueError(f"refine_gap must be >= 0, got {self.refine_gap}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """Everything that decides a plan; equal configs and lengths give byte-identical plans."""

    parallel: ParallelConfig
    """Parallel layout of the job."""
    capacity_tokens_per_rank: int
    """C: padded tokens one rank may hold in one microbatch."""
    global_batch_size: int = 0
    """Samples per optimizer step (exclusive with global_batch_tokens)."""
    global_batch_tokens: int = 0
    """Real tokens per optimizer step, filled greedily in permutation order (exclusive)."""
    seed: int = 0
    """Seed of the per-epoch sample permutation."""
    epochs: int = 1
    """Epochs to plan; each draws a fresh permutation."""
    layout: str = ZIGZAG
    """Sharding of a group's packed buffer: zigzag (TE's load-balanced causal) or contiguous."""
    cp_sizes: tuple[int, ...] = ()
    """Group sizes the plan may use; empty means all valid sizes for the pool."""
    min_cp: int = 1
    """Smallest group size for any sequence."""
    long_sequences: str = "error"
    """What to do with a sample longer than the whole pool holds: error, split, truncate, drop."""
    max_segment_tokens: int = 0
    """With ``long_sequences="split"``: also split every sample longer than this into segments
    of at most this many tokens (0: no cap, only what the pool holds). ``dcp-plan
    --memory-per-rank`` sets it to the longest segment the memory limit keeps every group
    within (planner/memory.py, ``MemoryModel.segment_cap``)."""
    drop_last: bool = False
    """Drop an epoch's final partial global batch instead of planning it as a short step."""
    effort: str = "balanced"
    """Solver effort: fast (heuristic only), balanced, max."""
    cost_model: str = "default"
    """Name of a preset or path of a cost-model JSON file."""
    solver: SolverConfig = SolverConfig()
    """Solver knobs (tolerances, refinement threshold, CP-SAT budget)."""
    workers: int = 1
    """Processes (``engine="local"``) or Ray CPU slots (``"ray"``; 0: every CPU of the Ray
    cluster) that plan steps in parallel; the plan is identical for every value."""
    engine: str = "local"
    """Where steps are planned: ``local`` (this machine) or ``ray`` (Ray tasks); same plan."""
    ray_address: str = ""
    """With ``engine="ray"``: the Ray cluster to use (``ray.init(address=...)``); empty: a new
    local Ray of ``workers`` CPUs."""
    kind: str = "train"
    """``train``: epochs of seeded permutations; ``eval``: one pass in file order, the last partial
    batch kept, planned with the cost model's forward-only cost (no epochs, seed or drop_last)."""
    pad_to_multiple: int = 1
    """Every segment's padded length is also a multiple of this (e.g. 16 for FP8 GEMMs); the
    padding counts in capacity. 1: only the sharding rule (groups.pad_multiple)."""
    blend: tuple[float, ...] = ()
    """Weights of the dataset's file groups (``DataFile.group``, Megatron's ``--data-path W P``):
    every step draws ``blend_counts(blend, global_batch_size)`` samples from each group. Empty:
    no blend, one permutation over all samples."""
    sizes: tuple[int, ...] = field(init=False)
    """Resolved group sizes (set from cp_sizes and min_cp)."""

    def __post_init__(self) -> None:
        n = self.parallel.pool_size
        if self.capacity_tokens_per_rank < 1:
            raise ValueError(
                f"max tokens per rank must be >= 1, got {self.capacity_tokens_per_rank}"
            )
        if (self.global_batch_size > 0) == (self.global_batch_tokens > 0):
            raise ValueError("give exactly one of global_batch_size and global_batch_tokens (> 0)")
        if self.global_batch_size < 0 or self.global_batch_tokens < 0:
            raise ValueError("global batch size and tokens must not be negative")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            # splitmix64 keys take the seed modulo 2^64: a larger one would alias a small one.
            raise ValueError(f"seed must be an integer in 0..2^64-1, got {self.seed!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.long_sequences not in LONG_SEQUENCE_POLICIES:
            raise ValueError(
                f"long_sequences must be one of {', '.join(LONG_SEQUENCE_POLICIES)}, "
                f"got {self.long_sequences!r}"
            )
        if self.max_segment_tokens < 0 or (self.max_segment_tokens
                                           and self.long_sequences != "split"):
            raise ValueError(f"max_segment_tokens {self.max_segment_tokens} needs "
                             "long_sequences split and must not be negative")
        if self.kind not in PLAN_KINDS:
            raise ValueError(f"kind must be one of {', '.join(PLAN_KINDS)}, got {self.kind!r}")
        if self.kind == EVAL:
            # One pass in file order: these settings would silently mean nothing, so refuse them.
            if self.epochs != 1:
                raise ValueError(f"an eval plan is one pass: epochs must be 1, got {self.epochs}")
            if self.drop_last:
                raise ValueError("an eval plan keeps its last partial batch: drop_last must be "
                                 "False")
            if self.seed != 0:
                raise ValueError(f"an eval plan is in file order: seed must be 0, got "
                                 f"{self.seed}")
        if self.pad_to_multiple < 1:
            raise ValueError(f"pad to multiple must be >= 1, got {self.pad_to_multiple}")
        if self.blend:
            if self.global_batch_size <= 0:
                raise ValueError("a blend draws samples per step: it needs global_batch_size, "
                                 "not global_batch_tokens")
            if not all(w > 0 for w in self.blend):
                raise ValueError(f"blend weights must be positive, got {list(self.blend)}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.workers < (0 if self.engine == "ray" else 1):
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.ray_address and self.engine != "ray":
            raise ValueError("ray_address needs engine ray")
        if self.effort not in EFFORTS:
            raise ValueError(f"effort must be one of {', '.join(EFFORTS)}, got {self.effort!r}")
        sizes = check_cp_sizes(n, self.cp_sizes) if self.cp_sizes else valid_cp_sizes(n)
        sizes = tuple(k for k in sizes if k >= self.min_cp)
        if not sizes:
            raise ValueError(
                f"min_cp={self.min_cp} leaves no group size (sizes: {self.cp_sizes or 'default'})"
            )
        object.__setattr__(self, "sizes", sizes)
        # A group's packed buffer is addressed by int32 offsets (TE's cu_seqlens, the rows):
        # a group of k ranks holds up to k x C padded tokens, which must stay below 2^31.
        k = max(sizes)
        if k * self.capacity_tokens_per_rank > MAX_GROUP_TOKENS:
            raise ValueError(
                f"a group of {k} ranks holds up to {k} x {self.capacity_tokens_per_rank} = "
                f"{k * self.capacity_tokens_per_rank} padded tokens, more than the "
                f"{MAX_GROUP_TOKENS} that int32 offsets (cu_seqlens) address; lower "
                f"--max-tokens-per-rank to at most {MAX_GROUP_TOKENS // k} or limit --cp-sizes")
        # A rank must hold at least one padded sequence of the largest group: below that, every
        # sequence at that size is mostly padding and long samples split into a flood of tiny
        # microbatches (C = 3 at CP 2 zigzag planned 415 microbatches per step).
        k = sizes[-1]
        m = pad_multiple(k, self.parallel.tp_eff, self.layout)
        if self.capacity_tokens_per_rank < m:
            raise ValueError(
                f"max tokens per rank {self.capacity_tokens_per_rank} is below the padding "
                f"multiple {m} of group size {k} ({self.layout}, tp'={self.parallel.tp_eff}); "
                f"raise --max-tokens-per-rank to at least {m} or limit --cp-sizes")
