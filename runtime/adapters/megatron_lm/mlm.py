"""The only module that imports ``megatron.training`` (Megatron-LM's training loop); the
megatron-core names it needs come from the adapter's ``compat.mcore``, megatron-core's owner.

The megatron-core wheel ships ``megatron/training`` from 0.17 on; the launcher supports the
releases of the project's ``megatron`` extra that have it, 0.17.x through 0.19.x, and refuses
0.16.x (``ReleaseError``, an ``ImportError`` so that tests can skip on it). Two shims are
needed before anything runs, on any device:

- ``typing.override`` on Python 3.11: ``megatron/training/models/*.py`` import it from
  ``typing`` (3.12+); typing_extensions has the same decorator.
- ``compile_helpers`` as a no-op: ``pretrain()`` -> ``_compile_dependencies`` runs ``make`` in
  ``megatron/core/datasets``, and the wheel ships no Makefile, so rank 0 calls ``sys.exit(1)``
  and the others wait at a barrier. The helpers only build GPTDataset's index, which a plan
  never uses.

The difference between releases this module absorbs is ``pretrain()``'s signature (0.17:
``(datasets_provider, model_provider, model_type, forward_step, ...)``; 0.18: ``(cfg_container,
datasets_provider, model_provider, model_type, forward_step, ...)``; 0.19: ``(cfg_container,
datasets_provider, model_type, forward_step, model_provider=None, ...)``): ``bind_pretrain``
binds a call by name, so the launcher reads and replaces the arguments it needs by name.
"""

from __future__ import annotations

import inspect
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

from runtime.adapters.megatron.compat import mcore
from runtime.adapters.megatron_lm import ReleaseError

MIN_VERSION = (0, 17)
MAX_VERSION = (0, 20)
SUPPORTED = "0.17.x through 0.19.x"


def check_release(version: str) -> None:
    """Refuse a megatron-core release without a supported ``megatron.training``."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        release = ()
    if not MIN_VERSION <= release[:2] < MAX_VERSION:
        why = (" (0.16 ships no megatron/training: Megatron-LM's loop is in the repository "
               "only)" if release[:2] == (0, 16) else "")
        raise ReleaseError(f"the Megatron-LM launcher supports megatron-core {SUPPORTED}, "
                           f"found {version}{why}")


def _shim_typing_override() -> None:
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]


VERSION: str = mcore.VERSION
check_release(VERSION)
_shim_typing_override()

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.training import arguments, checkpointing, global_vars, initialize, training
    from megatron.training import utils as training_utils
    from megatron.training.global_vars import get_args, get_tensorboard_writer
    from megatron.training.utils import print_rank_0

training_common_utils: types.ModuleType | None = sys.modules.get(
    "megatron.training.utils.common_utils")
"""0.19's ``megatron/training/utils/common_utils.py`` (a package there; a module before)."""
dist_utils: types.ModuleType | None = sys.modules.get("megatron.training.models.dist_utils")
"""0.19's config-container model builder (absent before: the script's model provider)."""
if dist_utils is None:
    import importlib

    try:
        dist_utils = importlib.import_module("megatron.training.models.dist_utils")
    except ImportError:
        dist_utils = None


def no_compile_helpers() -> None:
    # megatron/core/datasets/utils.py: compile_helpers() runs `make` where the wheel ships no
    # Makefile and exits the process (module docstring); imported inside _compile_dependencies,
    # so the attribute takes.
    mcore.datasets_utils.compile_helpers = lambda: None


def bind_pretrain(args: tuple[Any, ...], kwargs: dict[str, Any],
                  pretrain: Callable[..., Any] | None = None) -> inspect.BoundArguments:
    """A call of ``pretrain`` bound by name (this release's signature; module docstring)."""
    fn = pretrain or training.pretrain
    try:
        return inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"pretrain() of megatron-core {VERSION} cannot take this call: {e}"
                         ) from e


def pretrain_argument(bound: inspect.BoundArguments, name: str) -> Any:
    """A bound argument, or its default."""
    if name in bound.arguments:
        return bound.arguments[name]
    param = bound.signature.parameters.get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


__all__ = ["ReleaseError", "SUPPORTED", "VERSION", "arguments", "bind_pretrain",
           "check_release", "checkpointing", "dist_utils", "get_args", "get_tensorboard_writer",
           "global_vars", "initialize", "no_compile_helpers", "pretrain_argument",
           "print_rank_0", "training", "training_common_utils", "training_utils"]
