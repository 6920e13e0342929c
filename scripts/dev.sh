#!/usr/bin/env bash
# One entry point for the README's two commands.
#   scripts/dev.sh plan   set up .venv and run dcp-plan on the bundled sample dataset
#   scripts/dev.sh test   set up .venv and run the whole CPU test suite (slow tests included)
#   scripts/dev.sh setup  only set up .venv (the dev, megatron, torchtitan and ray extras)
# Setup is idempotent: it reinstalls only when pyproject.toml changed. torch is pinned to the
# CPU wheel these machines carry (TORCH_SPEC overrides it; an unpinned torch pulls a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

setup() {
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ needed"'
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  local stamp=.venv/.dcp-setup
  local want
  want="$(sha256sum pyproject.toml | cut -c1-64) $TORCH_SPEC"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q "$TORCH_SPEC"
    # The constraint keeps every later install from replacing that torch (megatron-core and
    # torchtitan's dependencies ask for torch too: an unpinned resolution could pull a CUDA build).
    local pin=.venv/.torch-constraint.txt
    echo "$TORCH_SPEC" > "$pin"
    local torch_before
    torch_before="$(.venv/bin/python -m pip show torch 2>/dev/null | grep '^Version:')"
    .venv/bin/python -m pip install -q -c "$pin" -e '.[dev,megatron,torchtitan,ray]'
    # The constraint is the guard; this makes a torch replaced anyway a failed setup, not a
    # multi-GB surprise later.
    if [ "$(.venv/bin/python -m pip show torch 2>/dev/null | grep '^Version:')" != "$torch_before" ]; then
      echo "setup: installing the extras replaced torch (${torch_before:-none})" >&2
      exit 1
    fi
    echo "$want" > "$stamp"
  fi
}

# The report's test renders a page in a real headless browser: Debian's chromium. Installed when
# missing where this runs as root with apt-get (CI does); elsewhere the test skips and says so.
ensure_chromium() {
  command -v chromium >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium (Debian's package) for the HTML report's browser test" >&2
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
        >/dev/null 2>&1; then
      echo "setup: chromium could not be installed; the report's browser test will skip" >&2
    fi
  else
    echo "setup: no chromium (apt-get install chromium as root): the report's browser test" \
      "will skip" >&2
  fi
}

case "${1:-}" in
  setup) setup ;;
  plan)
    setup
    shift
    .venv/bin/dcp-plan data/sample.jsonl -o plans/sample.arrow --dp 4 --cp 2 \
      --max-tokens-per-rank 4096 --global-batch-size 64 --seed 0 "$@"
    .venv/bin/dcp-plan validate plans/sample.arrow data/sample.jsonl
    ;;
  test)
    setup
    ensure_chromium
    shift
    .venv/bin/python -m pytest -q -m 'not gpu' "$@"
    ;;
  *) echo "usage: scripts/dev.sh plan|test|setup" >&2; exit 2 ;;
esac
