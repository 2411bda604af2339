#!/usr/bin/env bash
# Device call 2 (nvidia-h100-x2, warm from call 1's FA4 stash): FA4 + quack installed; defaults.
# A/B in one call, alternating: the 8-GPU rank (--as-world-size 8 at W=2), this commit (the optimizers' update as a
# CUDA graph) against the previous commit (bench/out/base: update eager), three runs each; the first run of this
# commit with --check-graphs (micro-batch losses and the update, graphs against eager).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source bench/fa4_env.sh install
log="$OUT/call2_console.txt"
run() {  # run NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" | tee -a "$log"
    timeout "$limit" "$@" >> "$log" 2>&1; echo "=== $name exit $?" | tee -a "$log"
    grep -E "^(stage|extension|cold start|CUDA graphs check|update graph check)" "$log" | tail -7
}
T="torchrun --standalone --nproc_per_node=2"
run new_as8_1 230 $T bench/bench.py --commit 660af06 --stages-only --steps 16 --as-world-size 8 --check-graphs --out "$OUT/new_as8_1.json"
run base_as8_1 120 $T bench/out/base/bench/bench.py --commit e3a2c08 --stages-only --steps 16 --as-world-size 8 --out "$OUT/base_as8_1.json"
for i in 2 3; do
    run new_as8_$i 90 $T bench/bench.py --commit 660af06 --stages-only --steps 16 --as-world-size 8 --out "$OUT/new_as8_$i.json"
    run base_as8_$i 90 $T bench/out/base/bench/bench.py --commit e3a2c08 --stages-only --steps 16 --as-world-size 8 --out "$OUT/base_as8_$i.json"
done
