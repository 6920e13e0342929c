#!/usr/bin/env bash
# The torchtitan adapter under torch 2.11.0, the GPU machines' torch, on this CPU machine.
# Not part of CI (it downloads torch 2.11's CUDA wheel and its nvidia-* dependencies from PyPI,
# about 4.6 GB installed; the CUDA build runs on a CPU). About 8 minutes on 2 cores.
#   scripts/check_torchtitan_torch211.sh [VENV]     (default /tmp/dcp-torch211)
# 1. a venv with torch==2.11.0 and the project's dev + torchtitan extras (torch constrained);
# 2. runtime.adapters.torchtitan.compat installs its two shims there;
# 3. the adapter's tests (4 gloo ranks, CP 1/2/4, FSDP vs the oracle, resume, eval, shims);
# 4. torchtitan's compiled FlexAttention document mask through the create_block_mask shim;
# 5. the GPU machine's install: torchtitan and the packages bench/torchtitan_gpu.py carries are
#    removed and reinstalled from the wheels `prepare` downloads (--no-deps --no-index, as `run`
#    does there), then `run --smoke` (1 and 2 ranks, gloo, tiny model) must pass.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/dcp-torch211}
WORK="$VENV/work"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"
mkdir -p "$WORK"
echo "torch==2.11.0" > "$VENV/torch-constraint.txt"
"$PY" -m pip install -q torch==2.11.0
"$PY" -m pip install -q -c "$VENV/torch-constraint.txt" -e '.[dev,torchtitan]'

echo "== 2. shims"
"$PY" - <<'PY'
import torch
from runtime.adapters.torchtitan import titan
assert torch.__version__.startswith("2.11."), torch.__version__
want = ["torch.distributed.fsdp.DataParallelMeshDims",
        "torch.nn.attention.flex_attention.create_block_mask(separate_full_blocks=)"]
assert titan.compat.INSTALLED == want, titan.compat.INSTALLED
print(torch.__version__, titan.torchtitan.__version__, titan.compat.INSTALLED)
PY

echo "== 3. tests"
timeout 1500 "$PY" -m pytest -q -p no:cacheprovider tests/runtime/adapters/torchtitan

echo "== 4. compiled document mask"
timeout 900 "$PY" - <<'PY'
import torch
import torch.nn.attention.flex_attention as flex
from runtime.adapters.torchtitan import titan  # noqa: F401 - installs the shims first
from torchtitan.models.common.attention import create_attention_mask

positions = torch.cat([torch.arange(n) for n in (100, 37, 700, 75, 400)])[None]
doc = torch.cumsum((positions == 0).int(), dim=1) - 1
def mask_mod(b, h, q, kv):
    return (doc[b, q] == doc[b, kv]) & (kv <= q)
n = positions.shape[1]
# As torchtitan's decoder calls it (torch.compile'd, separate_full_blocks passed).
got = create_attention_mask(mask_mod, 1, None, n, n, device="cpu", BLOCK_SIZE=128,
                            separate_full_blocks=True)
want = flex.create_block_mask(mask_mod, 1, None, n, n, device="cpu")  # the shim, eager
for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
    assert torch.equal(getattr(got, name), getattr(want, name)), name
print("compiled create_block_mask through the shim: same mask, full blocks",
      int(got.full_kv_num_blocks.sum()))
PY

echo "== 5. the GPU machine's install, then run --smoke"
"$PY" bench/torchtitan_gpu.py prepare --dir "$WORK/ttg" --samples 60 --capacity 256 \
    --global-batch-tokens 2048 --wheel-python "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
carried=$("$PY" -c "from bench.torchtitan_gpu import WHEELS; print(' '.join(w.split('==')[0] for w in WHEELS))")
"$PY" -m pip uninstall -q -y $carried
if "$PY" -c "import torchtitan" 2>/dev/null; then echo "torchtitan still importable"; exit 1; fi
"$PY" bench/torchtitan_gpu.py run --smoke --gpus 1 --dir "$WORK/ttg" --out "$WORK/out1"
"$PY" bench/torchtitan_gpu.py run --smoke --gpus 2 --dir "$WORK/ttg" --out "$WORK/out2"
echo "torch 2.11 check: PASS"
