#!/usr/bin/env bash
# One device call (issue 3): build the proxy shards, run the GPU checks, then the 90+6-step proxy schedule.
#   OUT=/some/dir NPROC=1 bash bench/proxy_run.sh [extra train_gpt.py args]
# Everything it measures lands in $OUT (proxy build log, gpu_checks.json, the training log and console).
set -uo pipefail
OUT=${OUT:-bench/out}; NPROC=${NPROC:-1}; CORPUS=${CORPUS:-.carry/corpus}; CHECKS=${CHECKS:-1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ ! -f data/proxy/fineweb_train_000001.bin ]; then
    ( time timeout 120 ./run.sh proxy "$CORPUS" ) 2>&1 | tee "$OUT/proxy_build.txt" | tail -3
fi
if [ "$CHECKS" = 1 ]; then
    timeout ${CHECK_TIMEOUT:-240} python3 bench/gpu_checks.py --out "$OUT/gpu_checks.json" > "$OUT/gpu_checks_console.txt" 2>&1
    echo "gpu_checks exit $?"; tail -3 "$OUT/gpu_checks_console.txt"
fi
timeout ${TRAIN_TIMEOUT:-560} python3 -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_gpt.py --data-path data/proxy \
    --num-scheduled-iterations 90 --num-extension-iterations 6 --val-loss-every 30 \
    --val-batch-size 524288 --val-tokens 1572864 --log-dir "$OUT" "$@" 2>&1 | tee "$OUT/train_console.txt" | grep -vE '^step:[0-9]+/96 train_time' 
echo "train exit ${PIPESTATUS[0]}"
