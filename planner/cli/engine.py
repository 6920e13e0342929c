"""``dcp-plan``'s engine flags: ``--workers``, ``--engine``, ``--ray-address``.

Checked before anything is read (a 20M-sample dataset takes a while): ``--ray-address`` needs
``--engine ray``; ``--engine ray`` needs Ray installed and, with an address, a cluster that
answers. Ray itself is imported only then (solver/ray_engine.py), never for ``--engine local``.
"""

from __future__ import annotations

import argparse
from typing import Any

from planner.cli.args import positive_int
from planner.config import ENGINES


def add_engine_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--workers", type=positive_int, default=None, metavar="N",
                       help="processes that plan steps in parallel (default 1), or with "
                       "--engine ray CPU slots (default: every CPU of the Ray cluster); the "
                       "plan is the same for any N")
    group.add_argument("--engine", choices=ENGINES, default="local",
                       help="where steps are planned: local (this machine, --workers "
                       "processes) or ray (Ray tasks on a local Ray or the cluster at "
                       "--ray-address); the plan is byte-identical")
    group.add_argument("--ray-address", default="", metavar="ADDR",
                       help="with --engine ray: the cluster (HOST:PORT, ray://HOST:PORT, auto); "
                       "default: a new local Ray of --workers CPUs")


def engine_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """PlannerConfig's ``workers``, ``engine`` and ``ray_address``, once the flags are checked."""
    if args.ray_address and args.engine != "ray":
        parser.error("--ray-address needs --engine ray")
    if args.engine == "ray":
        from planner.solver.ray_engine import check_address, import_ray

        import_ray()
        check_address(args.ray_address)
    return {"workers": args.workers or (0 if args.engine == "ray" else 1),
            "engine": args.engine, "ray_address": args.ray_address}
