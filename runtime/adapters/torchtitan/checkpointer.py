"""torchtitan's checkpointer, loading a checkpoint as data.

``PlanCheckpointManager`` is torchtitan's ``CheckpointManager`` with one change, in
``dcp_load`` (every path a load takes: ``--resume`` into the save directory, or from another
one): before torch reads ``step-N/.metadata`` with ``pickle.load`` it is read through the
allow-list unpickler the Megatron adapter uses (``runtime.train.dcpsafe``), and the objects
stored in the ``.distcp`` shards load with ``weights_only=True``. A crafted checkpoint is
refused by name before any of its code runs; a genuine one loads as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from runtime.adapters.torchtitan.titan import CheckpointManager
from runtime.train.dcpsafe import (
    check_metadata_pickle,
    objects_load_as_data,
    refused_shard_object,
)


class PlanCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose loads run no code from the checkpoint."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if not from_hf:
            check_metadata_pickle(os.path.join(checkpoint_id, ".metadata"))
        try:
            with objects_load_as_data():
                super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if why := refused_shard_object(e):
                raise ValueError(f"{checkpoint_id}: {why}") from None
            raise
