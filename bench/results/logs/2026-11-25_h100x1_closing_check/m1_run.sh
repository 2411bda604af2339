#!/bin/bash
# Device machine M1, call 2: FA4 + quack installed; a fresh cold start at HEAD that writes a compile-cache bundle;
# the GPU checks of quack's gemm_add plan; HEAD against the previous commit without CUDA graphs (host-bound stage 1).
set -u
C=$1; BASE=$2; T0=$(date +%s); W=/tmp/w; mkdir -p $W
left() { echo $(( 545 - ($(date +%s) - T0) )); }
finish() { tar czf $OUT/M1.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/M1_install.txt 2>&1; tail -1 $W/M1_install.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/M1_nvidia_smi.txt
DEST=$W TIMEOUT_S=260 bash bench/fresh_start.sh M1_fresh --stages-only --steps 16 --commit $C -- --compile-cache $OUT/bundle.zip
# Later runs reuse the fresh run's caches (warm starts), as a second run on a user's machine would.
export TORCHINDUCTOR_CACHE_DIR=/tmp/fresh_start_M1_fresh/inductor TRITON_CACHE_DIR=/tmp/fresh_start_M1_fresh/triton \
       FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fresh_start_M1_fresh/fa4 QUACK_CACHE_DIR=/tmp/fresh_start_M1_fresh/quack
SPEEDRUN_GPU_JSON=$W/M1_gpu_checks.json timeout 150 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
    -k "gemm_add_plan or residual_linear or quack_plans" > $W/M1_gpu_checks_console.txt 2>&1
tail -2 $W/M1_gpu_checks_console.txt
mkdir -p /tmp/base && cp -r bench tests data train_gpt.py /tmp/base/ && cp .carry/base/train_gpt.py /tmp/base/
for r in 1 2; do
  for v in new base; do
    l=$(left); [ "$l" -lt 100 ] && { echo "skip $v$r: ${l}s left"; continue; }
    dir=$PWD; commit=$C; [ $v = base ] && { dir=/tmp/base; commit=$BASE; }
    mkdir -p $W/M1_${v}_off$r
    (cd $dir && timeout $((l - 15)) python3 bench/bench.py --out $W/M1_${v}_off$r/M1_${v}_off$r.json --stages-only \
        --steps 16 --commit $commit -- --cuda-graphs off) > $W/M1_${v}_off${r}_console.txt 2>&1
    echo "$v$r: exit $?"; grep -E "^stage [123]:|^cold start" $W/M1_${v}_off${r}_console.txt | cut -c1-150
  done
done
