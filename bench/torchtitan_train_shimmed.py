"""``python -m torchtitan.train`` where the installed torch lacks names torchtitan 0.3.0 imports.

torchtitan's own entry point imports ``torchtitan.trainer`` before it parses ``--module``, and
that imports ``torch.distributed.fsdp.DataParallelMeshDims``, which the H200 machines' torch 2.11
does not have: ``python -m torchtitan.train`` stops with an ImportError there before any config
is read. This runs ``runtime.adapters.torchtitan.compat.install`` (which supplies such names only
where torch lacks them) and then torchtitan's ``torchtitan.train`` module itself as
``__main__``, command line untouched: ``torchrun ... -m bench.torchtitan_train_shimmed --module
... --config ...`` is ``torchrun ... -m torchtitan.train --module ... --config ...``.
``bench/torchtitan_registry_gpu.py`` uses it only when ``import torchtitan.train`` fails.
"""

from __future__ import annotations

import runpy

from runtime.adapters.torchtitan import compat

if __name__ == "__main__":
    compat.install()
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
