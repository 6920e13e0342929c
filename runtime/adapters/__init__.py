"""Framework adapters: a plan replayed inside an existing training engine.

One room per framework (``runtime/adapters/<name>/``), the only place that imports it; the rest
of the runtime never knows which engine runs. ``FRAMEWORKS`` is the single table of names that
``dcp-train --framework`` chooses from: ``native`` is this project's own loop
(``runtime.train``); every other entry names a module with
``launch(cfg: TrainConfig, model_config: GPTConfig, *, reference: bool) -> int`` that owns the
run from parsed flags to exit status (``reference=True``: that framework's oracle).
An adapter that runs evaluation (``cfg.eval_plan``, through ``runtime.data.evaluation``) sets
``SUPPORTS_EVAL = True`` in that module; ``dcp-train`` refuses ``--eval-plan`` for one that does
not, rather than ignoring it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

FRAMEWORKS: dict[str, str] = {
    "native": "runtime.train.cli",
    "megatron": "runtime.adapters.megatron.trainer.launch",
    "torchtitan": "runtime.adapters.torchtitan.launch",
}

__all__ = ["FRAMEWORKS", "load_launcher"]


def load_launcher(name: str) -> Callable[..., int]:
    """The ``launch`` function of framework ``name``; ValueError if it cannot be loaded."""
    module_name = FRAMEWORKS.get(name)
    if module_name is None or name == "native":
        raise ValueError(f"--framework {name}: not an adapter (choose from "
                         f"{', '.join(n for n in FRAMEWORKS if n != 'native')})")
    try:
        module: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"--framework {name}: not available here ({e}); install the "
                         f"project's '{name}' extra") from e
    except ImportError as e:  # installed, but a release the adapter does not support
        raise ValueError(f"--framework {name}: {e}") from e
    launch: Callable[..., int] = module.launch
    return launch
