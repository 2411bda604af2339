#!/usr/bin/env bash
# Device call 3 (nvidia-h100-x2, warm): the 90+6 proxy at W=2, seeds 1-3, defaults (loss, replicas); the kill test
# with graphs on; FA4's launch replay and quack's plans off against on, graphs on, W=2 and W=1.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source bench/fa4_env.sh install
log="$OUT/call3_console.txt"
bash bench/proxy_runs.sh --nproc 2 --seeds "1 2 3" --label w2 --out "$OUT/p" --corpus .carry/corpus \
    --budget 330 --min-left 60 2>&1 | tee -a "$log"
OUT="$OUT/k" NPROC=2 FAULT_RANK=1 FAULT_STEP=20 FAULT_KIND=kill KILL_TIMEOUT=150 bash bench/kill_test.sh >> "$log" 2>&1
tail -3 "$log"; cp "$OUT/k/kill/kill_test.json" "$OUT/kill_test.json" 2>/dev/null; rm -rf "$OUT/k"
T="torchrun --standalone --nproc_per_node=2"
off="--fa4-launch-replay false --quack-plans false"
timeout 90 $T bench/bench.py --stages-only --steps 12 --out "$OUT/w2_noreplay.json" -- $off >> "$log" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 80 python3 bench/bench.py --stages-only --steps 12 --out "$OUT/w1_noreplay.json" -- $off >> "$log" 2>&1
grep -E "^(stage|extension)" "$log" | tail -8
