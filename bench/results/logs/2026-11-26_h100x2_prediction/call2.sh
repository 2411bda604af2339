#!/usr/bin/env bash
# Device call 2 (warm; carry .carry/fa4b): the 8-GPU model's inputs at commit C with the defaults: NCCL's bandwidth
# at the 8-GPU sizes, one GPU's stage times (W=1), then the rank of an 8-GPU run (--as-world-size 8 at W=2) up to
# three times and W=2, each started only with time left before LIMIT seconds. Everything comes back as one archive.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s); W=/tmp/w; mkdir -p $W
finish() { tar czf $OUT/prediction_inputs.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/install.txt 2>&1; tail -1 $W/install.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/nvidia_smi.txt
run() {  # run NAME SECONDS COMMAND...: skipped unless SECONDS fit before LIMIT
    local name=$1 limit=$2; shift 2
    local left=$(( LIMIT - ($(date +%s) - T0) ))
    [ "$left" -lt "$limit" ] && { echo "=== $name skipped: ${left}s left"; return; }
    echo "=== $name: $*"
    timeout "$limit" "$@" > $W/${name}_console.txt 2>&1; echo "=== $name exit $?"
    grep -E "^(stage|extension|cold start \()" $W/${name}_console.txt | cut -c1-140
}
T="torchrun --standalone --nproc_per_node=2"
run nccl 90 $T bench/nccl_bandwidth.py --for-world-size 8 --out $W/nccl_w2_for8.json
CUDA_VISIBLE_DEVICES=0 run w1 170 python3 bench/bench.py --commit $C --stages-only --steps 12 --out $W/w1.json
for i in 1 2 3; do
    run as8_$i 130 $T bench/bench.py --commit $C --stages-only --steps 16 --as-world-size 8 --out $W/as8_$i.json
done
run w2 90 $T bench/bench.py --commit $C --stages-only --steps 12 --out $W/w2.json
