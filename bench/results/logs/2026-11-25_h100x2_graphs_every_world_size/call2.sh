#!/usr/bin/env bash
# Device call 2 (nvidia-h100-x2, warm from call 1): FA4 + quack installed; defaults. A/B in one call: the 8-GPU rank
# (--as-world-size 8 at W=2) with graphs and eager; W=2 with graphs (and the graphs-vs-eager check) and eager;
# W=1 with graphs on one of the two GPUs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source bench/fa4_env.sh install
log="$OUT/call2_console.txt"
run() {  # run NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" | tee -a "$log"
    timeout "$limit" "$@" >> "$log" 2>&1; echo "=== $name exit $?" | tee -a "$log"
    grep -E "^(stage|extension|cold start|CUDA graphs check|world size)" "$log" | tail -8
}
T="torchrun --standalone --nproc_per_node=2"
run w2as8_graphs 200 $T bench/bench.py --stages-only --steps 12 --as-world-size 8 --out "$OUT/w2as8_graphs.json"
run w2as8_eager 120 $T bench/bench.py --stages-only --steps 12 --as-world-size 8 --out "$OUT/w2as8_eager.json" -- --cuda-graphs off
run w2_graphs 120 $T bench/bench.py --stages-only --steps 12 --check-graphs --out "$OUT/w2_graphs.json"
run w2_eager 100 $T bench/bench.py --stages-only --steps 12 --out "$OUT/w2_eager.json" -- --cuda-graphs off
CUDA_VISIBLE_DEVICES=0 run w1_graphs 100 python3 bench/bench.py --stages-only --steps 12 --out "$OUT/w1_graphs.json"
