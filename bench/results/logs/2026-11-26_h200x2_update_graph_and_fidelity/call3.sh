#!/usr/bin/env bash
# Device call 3 (same warm machine as call 2): NCCL's bandwidth at the 8-GPU sizes, then W=1 and W=2 with the
# defaults, this commit against the previous one, for the 8-GPU model's one-GPU step and the W=2/W=1 ratios.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source bench/fa4_env.sh install
log="$OUT/call3_console.txt"
run() {  # run NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" | tee -a "$log"
    timeout "$limit" "$@" >> "$log" 2>&1; echo "=== $name exit $?" | tee -a "$log"
    grep -E "^(stage|extension|cold start)" "$log" | tail -5
}
T="torchrun --standalone --nproc_per_node=2"
run nccl 90 $T bench/nccl_bandwidth.py --for-world-size 8 --out "$OUT/nccl_w2_for8.json"
CUDA_VISIBLE_DEVICES=0 run new_w1 120 python3 bench/bench.py --commit 660af06 --stages-only --steps 12 --out "$OUT/new_w1.json"
CUDA_VISIBLE_DEVICES=0 run base_w1 110 python3 bench/out/base/bench/bench.py --commit e3a2c08 --stages-only --steps 12 --out "$OUT/base_w1.json"
run new_w2 100 $T bench/bench.py --commit 660af06 --stages-only --steps 12 --out "$OUT/new_w2.json"
run base_w2 100 $T bench/out/base/bench/bench.py --commit e3a2c08 --stages-only --steps 12 --out "$OUT/base_w2.json"
