#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (issue 6): the 90+6-step proxy schedule on 2 GPUs (with a profiled
# stage-3 step and the end-of-run replica check), then the same schedule on 1 GPU of the same machine with
# the same seed (same initialisation, same data order). Results land in $OUT/w2 and $OUT/w1.
set -uo pipefail
OUT=${OUT:-bench/out}; CORPUS=${CORPUS:-.carry/corpus}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[ -f data/proxy/fineweb_train_000001.bin ] || timeout 120 ./run.sh proxy "$CORPUS" > "$OUT/proxy_build.txt" 2>&1
ARGS="--data-path data/proxy --num-scheduled-iterations 90 --num-extension-iterations 6 --val-loss-every 30
      --val-batch-size 524288 --val-tokens 1572864 --seed 1234"
t=$(date +%s)
timeout "${W2_TIMEOUT:-320}" python3 -m torch.distributed.run --standalone --nproc_per_node=2 train_gpt.py $ARGS \
    --profile-step 75 --log-dir "$OUT/w2" 2>&1 | grep -vE '^step:[0-9]+/96 train_time'
echo "w2 exit ${PIPESTATUS[0]} after $(( $(date +%s) - t ))s"
t=$(date +%s)
timeout "${W1_TIMEOUT:-150}" python3 -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt.py $ARGS \
    --log-dir "$OUT/w1" 2>&1 | grep -vE '^step:[0-9]+/96 train_time'
echo "w1 exit ${PIPESTATUS[0]} after $(( $(date +%s) - t ))s"
