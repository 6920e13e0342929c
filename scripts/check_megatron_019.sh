#!/usr/bin/env bash
# The Megatron adapter's tests against megatron-core 0.19.2 (the GPU machines' release) on
# this project's Python 3.11, where the `megatron` extra resolves 0.16.1.
#   scripts/check_megatron_019.sh [DIR]     (default .mcore-0.19.2, an ignored folder)
# 0.17+ declare Python >= 3.12, but their cp311 wheels are ready-built (nothing compiles), so
# 0.19.2 goes into a scratch directory with --ignore-requires-python --no-deps (its hard
# dependencies, torch, numpy and packaging, are the venv's already) and shadows the venv's
# 0.16.1 through PYTHONPATH for the test processes only: the venv itself is not touched.
# .ci/run calls it after the test suite (about 5 minutes on 2 cores for the adapter, plus about
# 10 for the Megatron-LM launcher's tests: tests/runtime/adapters/megatron_lm).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(realpath -m "${1:-.mcore-0.19.2}")  # absolute: the launcher tests run from other folders
VERSION=0.19.2
# 0.19's package_info appends "+<git short sha>" of whatever git repository holds the package
# directory: DIR is inside this clone, so it would read this project's HEAD (0.19.2+68e103e).
# NO_VCS_VERSION=1 is Megatron's own switch for a plain release version.
export NO_VCS_VERSION=1
./scripts/dev.sh setup
if ! PYTHONPATH="$DIR" .venv/bin/python -c \
    "import megatron.core as m, sys; sys.exit(m.__version__ != '$VERSION')" 2>/dev/null; then
  rm -rf "$DIR"
  .venv/bin/python -m pip install -q --no-deps --ignore-requires-python --target "$DIR" \
    "megatron-core==$VERSION"
fi
PYTHONPATH="$DIR" .venv/bin/python -c "
import megatron.core as m
from runtime.adapters.megatron.compat import mcore
assert m.__version__ == '$VERSION' == mcore.VERSION, (m.__version__, mcore.VERSION)
print('megatron-core', m.__version__, 'from', m.__file__)"
PYTHONPATH="$DIR" .venv/bin/python -m pytest -q -m 'not gpu' \
  tests/runtime/adapters/megatron tests/runtime/adapters/megatron_lm \
  tests/reliability/test_adapter_faults.py -k 'megatron' "$@"
