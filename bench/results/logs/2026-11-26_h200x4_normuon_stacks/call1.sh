#!/usr/bin/env bash
# Device call 1 (nvidia-h100-x4, fresh; carry .carry/fa4a): keep FA4's first part in /tmp while the machine is warm,
# then NCCL's bus bandwidth on these 4 GPUs at the sizes of the 8-GPU step's collectives. Comes back as one archive.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W
finish() { tar czf $OUT/call1.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
bash bench/fa4_env.sh stash
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv > $W/nvidia_smi.txt
nvidia-smi topo -m > $W/topo.txt 2>&1; cat $W/nvidia_smi.txt; head -6 $W/topo.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__)"
timeout 150 torchrun --standalone --nproc_per_node=4 bench/nccl_bandwidth.py --for-world-size 8 \
    --out $W/nccl_w4_for8.json > $W/nccl_console.txt 2>&1; echo "nccl: exit $?"; tail -25 $W/nccl_console.txt
