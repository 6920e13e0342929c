#!/usr/bin/env bash
# One call on the 2-GPU machine (nvidia-h200-x2), after the Transformer Engine parts were copied
# to ~/te (one call per .gpu-te/part_N): install TE, train the same data with the dynamic and the
# static CP=2 plans (long-tail mix and all-long guard; TE and torch attention), then run the GPU
# tests. Plans and data are made on the CPU machine (bench/train_compare.py prepare) and carried
# in out/tc. Logs go to $OUT/logs.tgz; the tables print last. NVLink multicast stays off: this
# script does not touch NCCL's environment.
#   carry: [".gpu-te/small", "out/tc"]   command: bash bench/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
work=/tmp/gpu_session
mkdir -p "$work" "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/gpus.txt"
if [ -d "$HOME/te" ]; then
  bash .gpu-te/small/install-te.sh "$HOME/te" .gpu-te/small 2>&1 | tail -n 3 | tee "$work/te_install.txt"
fi
steps=${STEPS:-10}
workloads=${WORKLOADS:-wikipedia all-long}
attentions=${ATTENTIONS:-te,torch}
timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider --timeout 120 \
  tests/runtime/attention/test_te_gpu.py tests/runtime/train/test_gpu_paths.py tests/runtime/data/test_shard.py \
  > "$work/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"
for w in $workloads; do
  python3 bench/train_compare.py run --dir "out/tc/$w" --out "$work/$w" --steps "$steps" \
    --warmup 4 --timeout 200 --attention "$attentions" --lr "${LR:-3e-4}" 2>&1 \
    | tee "$work/$w.table.txt"
done
if [ -n "${CALIBRATE:-}" ]; then
  timeout 150 python3 -m runtime.calibrate --nproc 2 --quick --device cuda --attention te \
    --layers 8 --hidden-size 2048 --heads 16 --query-groups 4 --ffn-hidden-size 8192 \
    --vocab-size 32000 --dtype bf16 --output "$OUT/h200-8x2048-te.json" > "$work/calibrate.txt" 2>&1
  echo "calibrate rc=$?"; tail -n 12 "$work/calibrate.txt"
fi
tar czf "$OUT/logs.tgz" -C "$work" .
tail -n 25 "$work/gpu_tests.txt"
for w in wikipedia all-long; do echo "== $w"; tail -n 6 "$work/$w.table.txt"; done
