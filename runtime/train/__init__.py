"""Training loops: this project's small GPT (``model``) replayed by ``Trainer`` (``trainer``),
its single-process oracle (``oracle``), what both share: the run's config (``config``), its
log records (``runlog``), the model and optimizer they build (``build``) and the process group
(``procgroup``); attention backends (``backends``), the per-token loss (``loss``), checkpoints
(``checkpoint``) and ``dcp-train`` (``cli``; ``python -m runtime.train``).

The names load lazily (PEP 562) and ``main`` answers ``--version`` before importing torch
(issue 29: ``dcp-train --version`` costs a tenth of a second, not two).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.lazy import lazy_exports

_EXPORTS = {
    "StepLog": "runtime.train.runlog",
    "TrainConfig": "runtime.train.config",
    "TrainResult": "runtime.train.runlog",
    "Trainer": "runtime.train.trainer",
    "train_reference": "runtime.train.oracle",
}

__all__ = ["StepLog", "TrainConfig", "TrainResult", "Trainer", "main", "train_reference"]
assert sorted(__all__) == sorted([*_EXPORTS, "main"])

if TYPE_CHECKING:
    from runtime.train.config import TrainConfig
    from runtime.train.oracle import train_reference
    from runtime.train.runlog import StepLog, TrainResult
    from runtime.train.trainer import Trainer


def main(argv: Sequence[str] | None = None) -> int:
    """``dcp-train`` (``runtime.train.cli.main``); returns the process exit status."""
    from planner.cli.args import exit_on_version

    exit_on_version("dcp-train", None if argv is None else list(argv))
    from planner.cli.oom import reporting

    def run() -> int:
        from runtime.train.cli import main as cli_main

        return cli_main(argv)

    return reporting("dcp-train", run)


__getattr__ = lazy_exports(__name__, _EXPORTS)
