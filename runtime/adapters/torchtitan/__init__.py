"""torchtitan integration: replay a dynamic-CP plan in torchtitan's own trainer, with FSDP.

torchtitan (pinned 0.3.0, ``pip install '.[torchtitan]'``) has one fixed "cp" mesh dimension;
this package gives its ``Trainer`` per-microbatch CP groups from a plan:

- ``PlanDataLoader``: a ``BaseDataLoader`` yielding this rank's packed microbatches in plan
  order (positions reset per document), checkpointed as a plan position;
- ``PlanAttention``: llama3's ``inner_attention`` replaced by the microbatch's CP attention
  (``with_plan_attention`` does it for any llama3 config);
- ``PlanTrainer``: torchtitan's ``Trainer`` with the step's microbatch count, the attention
  bound per microbatch and FSDP over the whole dp x cp pool;
- ``PlanValidator``: evaluation of an eval plan through torchtitan's validation hook;
- ``trainer_config`` / ``launch``: what ``dcp-train --framework torchtitan`` runs;
  ``train_reference`` its one-process oracle.
- ``registry``: a ``config_registry`` for torchtitan's own entry point (``torchrun -m
  torchtitan.train --module runtime.adapters.torchtitan.registry --config llama3_debugmodel
  --plan.path PLAN --plan.dataset DATA``): torchtitan's llama3 configs replaying a plan, the
  ``plan`` section (``section.py``) filled in and checked after tyro parses the flags;
  ``oracle.reference_of_config`` its oracle.

torchtitan itself is imported only by ``titan`` (with the CPU workarounds).
"""

from runtime.adapters.torchtitan.attention import PlanAttention, PlanMasks
from runtime.adapters.torchtitan.config import trainer_config
from runtime.adapters.torchtitan.data import PlanDataLoader, PlanTokenizer
from runtime.adapters.torchtitan.launch import build_trainer, launch
from runtime.adapters.torchtitan.model import llama3_config, model_spec, with_plan_attention
from runtime.adapters.torchtitan.oracle import train_reference
from runtime.adapters.torchtitan.trainer import PlanMetrics, PlanTrainer
from runtime.adapters.torchtitan.validate import PlanValidator

__all__ = [
    "PlanAttention",
    "PlanDataLoader",
    "PlanMasks",
    "PlanMetrics",
    "PlanTokenizer",
    "PlanTrainer",
    "PlanValidator",
    "build_trainer",
    "launch",
    "llama3_config",
    "model_spec",
    "train_reference",
    "trainer_config",
    "with_plan_attention",
]
