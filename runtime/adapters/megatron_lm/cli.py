"""``python -m runtime.adapters.megatron_lm``: the launcher's command line.

Its own flags come first, then ``--``, then the user's command as they run it without the
launcher: ``SCRIPT ARGS...`` (``pretrain_gpt.py`` or any script of that shape, run as
``__main__`` with its folder first on ``sys.path``, where ``gpt_builders`` and
``model_provider`` live) or ``-m MODULE ARGS...``. Under ``torchrun`` every rank runs it.
``--reference`` runs the oracle instead (``oracle``): one process, every sequence alone.

A user's mistake (a missing plan, a flag the plan path refuses, a plan that is not the job's)
exits with status 2 and a message naming it, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from runtime.adapters.megatron_lm import LauncherOptions, ReleaseError

USAGE = ("python -m runtime.adapters.megatron_lm --plan PLAN [options] -- "
         "(SCRIPT | -m MODULE) [Megatron-LM flags]")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime.adapters.megatron_lm", usage=USAGE,
        description="Run Megatron-LM's pretrain_gpt.py (or a script of its shape) with a "
                    "dcp plan: the plan decides the data, the packing and each microbatch's "
                    "CP group; Megatron-LM keeps its model, optimizer, LR schedule, "
                    "recomputation, checkpoints, logging and evaluation.")
    p.add_argument("--plan", required=True, help="the training plan (dcp-plan)")
    p.add_argument("--eval-plan", default="",
                   help="an evaluation plan (dcp-plan --eval) for --eval-interval / "
                        "--eval-iters; each evaluation runs its first --eval-iters steps")
    p.add_argument("--dataset", nargs="+", default=[],
                   help="the dataset the plan was made for (default: the files its header "
                        "lists, or Megatron-LM's --data-path when it names them)")
    p.add_argument("--eval-dataset", nargs="+", default=[],
                   help="the eval plan's dataset (default: the files its header lists)")
    p.add_argument("--log-jsonl", default="",
                   help="rank 0 appends one JSON line per step and evaluation (dcp-train's "
                        "format: step, loss, loss_tokens, grad_norm, ...)")
    p.add_argument("--init-seed", type=int, default=None,
                   help="set every weight to the project's split-independent initial value "
                        "for this seed (runs of any split, and --reference, start equal); "
                        "default: Megatron-LM's initialisation")
    p.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="do not refuse, before the first step, a plan whose heaviest "
                        "microbatch would not fit a rank (GPU memory; on CPU the host's "
                        "available memory shared by its ranks)")
    p.add_argument("--reference", action="store_true",
                   help="run the oracle: one process, no parallelism, every sequence alone, "
                        "the same LR schedule and initial weights (needs --init-seed)")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's flags, the user's command) around the first ``--``."""
    if "--" not in argv:
        raise ValueError(f"no '--' before the Megatron-LM command (usage: {USAGE})")
    i = argv.index("--")
    command = argv[i + 1:]
    if not command:
        raise ValueError(f"nothing after '--' (usage: {USAGE})")
    return argv[:i], command


def options_of(ns: argparse.Namespace) -> LauncherOptions:
    for name in ("plan", "eval_plan"):
        path = getattr(ns, name)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')} {path}: no such file")
    return LauncherOptions(plan=ns.plan, eval_plan=ns.eval_plan, dataset=tuple(ns.dataset),
                           eval_dataset=tuple(ns.eval_dataset), log_jsonl=ns.log_jsonl,
                           init_seed=ns.init_seed, memory_check=ns.memory_check)


def run_command(command: list[str]) -> None:
    """Run the user's command as ``__main__`` (``sys.argv`` as it would see it)."""
    if command[0] == "-m":
        if len(command) < 2:
            raise ValueError("-m needs a module name")
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        return
    script = command[0]
    sys.argv = list(command)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        own, command = split_argv(argv)
        ns = parser().parse_args(own)
        options = options_of(ns)
        if ns.reference:
            from runtime.adapters.megatron_lm import oracle

            oracle.run(options, command)
            return 0
        from runtime.adapters.megatron_lm import install

        install(options)
        if command[0] != "-m" and not os.path.isfile(command[0]):
            raise ValueError(f"{command[0]}: no such script")
    except (ValueError, ReleaseError) as e:
        print(f"dcp launcher: {e}", file=sys.stderr)
        return 2
    # From here on the user's script runs: its errors keep their tracebacks (the launcher's
    # own checks exit with status 2 and a message, SystemExit).
    run_command(command)
    return 0
