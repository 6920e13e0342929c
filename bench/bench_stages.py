"""Where a `dcp-plan` run's CPU time goes: seconds per stage, this checkout and (``--base``) an
earlier revision, side by side.

Each variant runs in its own process (``--base REV``: ``git archive`` of its ``planner/`` first
on PYTHONPATH, as in bench_ab.py), which plans once untimed (imports, numba's loading), then
again with ``time.process_time`` around the functions of each stage; a stage a revision does
not have reads 0. The fastest of ``--repeats`` processes is kept per stage. Nested stages are
marked with "-": they are inside the one above.

Usage:
    .venv/bin/python bench/bench_stages.py --lengths FILE [--base REV] [--runs 64:fast,...]
        [--repeats 2]

Each run is N:EFFORT: dp N/4 x cp 4, C = 16384, global batch 16 N, ``--long-sequences split``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.revision import base_env, check_base, export_planner  # noqa: E402

STAGES = [
    ("kernel passes (solve_step)", [("planner.solver.greedy", "solve_step")]),
    ("tables and bounds", [("planner.solver.greedy", "make_problem"),
                           ("planner.solver.jobs", "run_tables")]),
    ("baselines (best_rows)", [("planner.solver.greedy", "best_rows")]),
    ("rows (spread, emit)", [("planner.solver.greedy", "spread"),
                             ("planner.solver.greedy", "emit_rows")]),
    ("header stats", [("planner.planfile.stats", "StatsAccumulator.add")]),
    ("spill (step_batch)", [("planner.planfile.io", "step_batch")]),
    ("validate + copy pass", [("planner.planfile.io", "validate")]),
    ("- coverage", [("planner.planfile.coverage", "Coverage.add")]),
    ("- checksums", [("planner.planfile.io", "step_digest")]),
    ("setup (read, permutation)", [("planner.sources.lengths", "read_lengths"),
                                   ("planner.plan", "PlanStream.__init__")]),
]
# Calls counted, not timed: kernel passes (StepProblem.run, one place() each) and steps.
COUNTS = [("passes", "planner.solver.step", "StepProblem.run"),
          ("steps", "planner.solver.greedy", "solve_step")]

CHILD = r"""
import importlib, json, sys, time
from collections import defaultdict
stages, counts, args = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
from planner.cli import main
main(args)  # untimed: imports, numba's loading
spent = defaultdict(float)
calls = defaultdict(int)
def wrap(mod_name, attr, label, counted=False):
    mod = importlib.import_module(mod_name)
    owner, name = mod, attr
    if "." in attr:
        cls, name = attr.split(".")
        owner = getattr(mod, cls, None)
    f = getattr(owner, name, None) if owner is not None else None
    if f is None:
        return
    def timed(*a, **k):
        if counted:
            calls[label] += 1
            return f(*a, **k)
        t0 = time.process_time()
        try:
            return f(*a, **k)
        finally:
            spent[label] += time.process_time() - t0
    setattr(owner, name, timed)
for label, funcs in stages:
    for m, a in funcs:
        wrap(m, a, label)
for label, m, a in counts:
    wrap(m, a, label, counted=True)
t0 = time.process_time()
main(args)
spent["in-process CPU s"] = time.process_time() - t0
if calls["steps"]:
    spent["kernel passes a step"] = calls["passes"] / calls["steps"]
print(json.dumps(spent))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=Path, required=True, help="dataset (any dcp-plan input)")
    ap.add_argument("--base", default="", help="git revision to compare against")
    ap.add_argument("--runs", default="64:fast,64:balanced,256:balanced,1024:balanced",
                    help="N:EFFORT,...")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        envs = {"this": dict(os.environ)}
        if args.base:
            export_planner(args.base, work / "base", "bench_stages")
            check_base(work / "base", "bench_stages")
            envs = {"base": base_env(work / "base"), **envs}
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for run in args.runs.split(","):
            n_text, effort = run.split(":")
            pool = int(n_text)
            cp = 4 if pool % 4 == 0 else 1
            best: dict[str, dict[str, float]] = {k: {} for k in envs}
            for _ in range(args.repeats):
                for name, env in envs.items():
                    flags = [str(args.lengths.resolve()), "-o", str(work / f"{name}.arrow"),
                             "--dp", str(pool // cp), "--cp", str(cp), "--max-tokens-per-rank",
                             "16384", "--global-batch-size", str(16 * pool),
                             "--long-sequences", "split", "--effort", effort, "--quiet"]
                    out = subprocess.run([sys.executable, "-P", "-c", CHILD, json.dumps(STAGES),
                                          json.dumps(COUNTS),
                                          *flags], env=env, cwd=work, capture_output=True,
                                         text=True, check=False)
                    if out.returncode != 0:
                        raise SystemExit(f"bench_stages: {name} failed:\n{out.stderr[-2000:]}")
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    for k, v in got.items():
                        best[name][k] = min(best[name].get(k, float("inf")), v)
            print(f"\nN = {pool}, {effort} (CPU s" + (", base -> this)" if args.base else ")"))
            for label in (["in-process CPU s"] + [lab for lab, _ in STAGES]
                          + ["kernel passes a step"]):
                vals = [best[name].get(label, 0.0) for name in envs]
                print(f"  {label:28s} " + " -> ".join(f"{v:6.3f}" for v in vals))
        print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
