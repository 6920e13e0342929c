"""Peak memory and CPU of a multi-epoch plan up to its first steps (issue 22: epochs are drawn
as the steps stream, so neither grows with ``--epochs``).

    .venv/bin/python bench/epochs_memory.py LENGTHS EPOCHS

Plans LENGTHS (any dataset ``dcp-plan`` reads) at N = 64 (dp 16 x cp 4), C = 16384, global
batch 1024, split, effort fast, and prints the CPU seconds and the peak RSS once the first 10
steps are out (BENCHMARKS.md).
"""

from __future__ import annotations

import itertools
import resource
import sys
import time

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import PlanStream
from planner.sources.lengths import read_lengths


def main() -> None:
    table = read_lengths(sys.argv[1])
    epochs = int(sys.argv[2])
    cfg = PlannerConfig(parallel=ParallelConfig(dp=16, cp=4), capacity_tokens_per_rank=16384,
                        global_batch_size=1024, epochs=epochs, long_sequences="split",
                        effort="fast")
    t0 = time.process_time()
    stream = PlanStream(table, cfg, load_cost_model())
    list(itertools.islice(stream.steps(), 10))
    print(f"epochs={epochs} cpu_to_first_10_steps={time.process_time() - t0:.1f}s "
          f"maxrss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")


if __name__ == "__main__":
    main()
