#!/usr/bin/env bash
# Device call 1 (nvidia-h100-x2): keep FA4's first part, then a quick check of the update's graph without FA4/quack
# (varlen attention, Inductor's MLP): the 8-GPU rank at W=2, graphs against eager.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash bench/fa4_env.sh stash
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 280 torchrun --standalone --nproc_per_node=2 bench/bench.py --commit 660af06 --stages-only --steps 6 \
    --as-world-size 8 --check-graphs --out "$OUT/varlen_as8_check.json" -- --attn-backend varlen --mlp-kernel inductor \
    > "$OUT/call1_console.txt" 2>&1
echo "exit $?"
grep -E "^(stage|extension|cold start|CUDA graphs check|update graph check)|Error|error" "$OUT/call1_console.txt" | tail -20
