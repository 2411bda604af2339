#!/usr/bin/env bash
# Device call 1 (a fresh nvidia-h100-x2 or -x4; carry .carry/fa4a): keep FA4's first part in /tmp while the machine is
# warm; then NCCL's bus bandwidth at the sizes of the 8-GPU step's collectives (bench/nccl_bandwidth.py), with NCCL's
# defaults and (SWEEP=1) with a few of its settings changed (channels, buffer size, protocol). One archive comes back.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W
finish() { tar czf $OUT/call1.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
bash bench/fa4_env.sh stash
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv > $W/nvidia_smi.txt
nvidia-smi topo -m > $W/topo.txt 2>&1; cat $W/nvidia_smi.txt; head -4 $W/topo.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__)"
N=$(nvidia-smi -L | wc -l)
sweep() {  # sweep NAME [VAR=VALUE ...]
    local name=$1; shift
    env "$@" timeout 100 torchrun --standalone --nproc_per_node=$N bench/nccl_bandwidth.py --for-world-size 8 \
        --out $W/nccl_$name.json > $W/nccl_${name}_console.txt 2>&1
    echo "$name ($*): exit $? $(grep '^per step' $W/nccl_${name}_console.txt)"
}
sweep default NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING
grep -E "NCCL_|nchannels|Channel|ncclAlgo|busBw|coll " $W/nccl_default_console.txt | head -5
grep -E "^(reduce_scatter|all_gather)" $W/nccl_default_console.txt | head -20
[ "${SWEEP:-1}" = 1 ] || exit 0
sweep ch32 NCCL_MIN_NCHANNELS=32
sweep buf16 NCCL_BUFFSIZE=16777216
sweep simple NCCL_PROTO=Simple
sweep ch32buf16 NCCL_MIN_NCHANNELS=32 NCCL_BUFFSIZE=16777216
sweep default2
