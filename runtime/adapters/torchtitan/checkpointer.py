"""torchtitan's checkpointer, loading a checkpoint as data.

``PlanCheckpointManager`` is torchtitan's ``CheckpointManager`` with one change, in
``dcp_load`` (every path a load takes: ``--resume`` into the save directory, or from another
one): before torch reads ``step-N/.metadata`` with ``pickle.load`` it is read through the
allow-list unpickler the Megatron adapter uses (``runtime.train.dcpsafe``), and the objects
stored in the ``.distcp`` shards load with ``weights_only=True``. A crafted checkpoint is
refused by name before any of its code runs; a genuine one loads as before.

And one check after every load: torchtitan restores the optimizer's parameter groups and the lr
scheduler's base rates from the checkpoint, so a resume with another lr or weight decay would
train at the saved ones silently; ``load`` refuses it (``runtime.train.build.
check_saved_settings``, the native trainer's rule and wording), naming the saved value and the
flag (``resume_flags``: torchtitan's ``--optimizer.param-groups.0.optimizer-kwargs.lr``,
or dcp-train's ``--lr``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from runtime.adapters.torchtitan.titan import CheckpointManager
from runtime.train.build import check_saved_settings, optimizer_settings
from runtime.train.dcpsafe import (
    check_metadata_pickle,
    objects_load_as_data,
    refused_shard_object,
)


class PlanCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose loads run no code from the checkpoint."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        resume_flags: tuple[str, str] = ("--optimizer.param-groups.0.optimizer-kwargs.lr",
                                         "--optimizer.param-groups.0.optimizer-kwargs.weight-decay")
        """The flags a refused resume names for the lr and the weight decay (torchtitan's, as
        its ``--help`` spells them; its llama3 configs hold one catch-all group, 0)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.resume_flags = config.resume_flags
        self.loaded_from = ""

    def _param_groups(self) -> list[dict[str, Any]]:
        optimizers = self.states["optimizer"]
        return [g for o in getattr(optimizers, "optimizers", [optimizers]) for g in o.param_groups]

    def load(self, step: int = -1) -> bool:
        if not self.enable:
            return False
        built = optimizer_settings(self._param_groups())
        loaded = bool(super().load(step))
        if loaded and self.loaded_from:  # a whole checkpoint, not model-only weights
            check_saved_settings(self.loaded_from, built=built, flags=self.resume_flags,
                                 loaded=optimizer_settings(self._param_groups()))
        return loaded

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if not from_hf:
            if "optimizer" in state_dict:
                self.loaded_from = checkpoint_id
            check_metadata_pickle(os.path.join(checkpoint_id, ".metadata"))
        try:
            with objects_load_as_data():
                super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if why := refused_shard_object(e):
                raise ValueError(f"{checkpoint_id}: {why}") from None
            raise
