#!/usr/bin/env bash
# Issue 6, fault case on GPUs: rank 1 SIGKILLs itself at timed step FAULT_STEP of a 2-GPU proxy run; measures
# how long the job takes to end after the kill and keeps the console.   OUT=dir bash bench/kill_test.sh
set -uo pipefail
OUT=${OUT:-bench/out}; CORPUS=${CORPUS:-.carry/corpus}; FAULT_STEP=${FAULT_STEP:-5}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/kill"
[ -f data/proxy/fineweb_train_000001.bin ] || timeout 120 ./run.sh proxy "$CORPUS" > "$OUT/proxy_build.txt" 2>&1
FAULT_RANK=1 FAULT_STEP=$FAULT_STEP FAULT_KIND=kill timeout "${KILL_TIMEOUT:-400}" \
    python3 -m torch.distributed.run --standalone --nproc_per_node=2 tests/fault_launcher.py \
    --data-path data/proxy --num-scheduled-iterations 90 --num-extension-iterations 6 --val-loss-every 30 \
    --val-batch-size 524288 --val-tokens 1572864 --seed 1 --log-dir "$OUT/kill" > "$OUT/kill/console.txt" 2>&1
rc=$?
end=$(date +%s.%N)
killed=$(grep -o 'unix time [0-9.]*' "$OUT/kill/console.txt" | awk '{print $3}')
echo "kill test: job exit $rc; ended $(python3 -c "print(f'{$end - ${killed:-0}:.1f}')")s after rank 1 was killed"
grep -vE '^step:[0-9]+/96 train_time' "$OUT/kill/console.txt" | tail -25
