"""Training loops: this project's small GPT (``model``) replayed by ``Trainer`` (``trainer``),
its single-process oracle (``oracle``), what both share: the run's config (``config``), its
log records (``runlog``), the model and optimizer they build (``build``) and the process group
(``procgroup``); attention backends (``backends``), the per-token loss (``loss``), checkpoints
(``checkpoint``) and ``dcp-train`` (``cli``; ``python -m runtime.train``).
"""

from __future__ import annotations

from runtime.train.cli import main
from runtime.train.config import TrainConfig
from runtime.train.oracle import train_reference
from runtime.train.runlog import StepLog, TrainResult
from runtime.train.trainer import Trainer

__all__ = ["StepLog", "TrainConfig", "TrainResult", "Trainer", "main", "train_reference"]
