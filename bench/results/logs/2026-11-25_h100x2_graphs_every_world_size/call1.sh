#!/usr/bin/env bash
# Device call 1 (nvidia-h100-x2): stash FA4 part 1; NCCL bandwidth at the 8-GPU step's sizes; W=2 CUDA graphs with
# NCCL inside on the varlen/Inductor path (no FA4 yet): graphs vs eager losses and gradients, stage times.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash bench/fa4_env.sh stash
nvidia-smi -L; nvidia-smi topo -m | head -5
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
timeout 120 torchrun --standalone --nproc_per_node=2 bench/nccl_bandwidth.py --for-world-size 8 \
    --out "$OUT/nccl_w2_for8.json" 2>&1 | grep -v "^W1125\|Warning" | tail -25
timeout 360 torchrun --standalone --nproc_per_node=2 bench/bench.py --stages-only --steps 8 --check-graphs \
    --out "$OUT/w2_varlen_graphs.json" -- --attn-backend varlen --mlp-kernel inductor > "$OUT/w2_varlen_graphs.txt" 2>&1
echo "bench exit $?"; grep -v "^W1125" "$OUT/w2_varlen_graphs.txt" | tail -30
