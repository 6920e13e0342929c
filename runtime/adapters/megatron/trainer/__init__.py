"""``dcp-train --framework megatron``: the training loop built on ``PlanJob`` (``train``), its
evaluation (``evaluate``), the one-process oracle (``oracle``, ``--reference``) and the entry
``launch`` that ``runtime.adapters.FRAMEWORKS`` names.

Only the command line's loop lives here: a Megatron user's own loop, or Megatron-LM's, uses
``PlanJob`` or ``binding`` and never imports this package.
"""

__all__: list[str] = []
