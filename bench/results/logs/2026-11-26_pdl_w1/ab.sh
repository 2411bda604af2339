#!/usr/bin/env bash
# Device call 2 (warm; carry .carry/fa4b): bench.py --stages-only on one GPU at commit NEW, Inductor's Triton kernels
# launched with programmatic dependent launch (TORCHINDUCTOR_ENABLE_PDL=1, "on") against without ("off"),
# alternating on, off for ROUNDS rounds while time is left before LIMIT seconds. One archive comes back.
set -u
T0=$(date +%s); W=/tmp/w; mkdir -p $W
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
finish() { tar czf $OUT/pdl_w1.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/install.txt 2>&1; tail -1 $W/install.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/nvidia_smi.txt
for r in $(seq 1 ${ROUNDS:-3}); do
  for v in on off; do
    l=$(left); [ "$l" -lt "${NEED:-75}" ] && { echo "skip $v$r: ${l}s left"; continue; }
    pdl=0; [ $v = on ] && pdl=1
    TORCHINDUCTOR_ENABLE_PDL=$pdl timeout $((l - 5)) python3 bench/bench.py --out $W/${v}$r.json --stages-only \
        --steps 12 --commit $NEW > $W/${v}${r}_console.txt 2>&1
    echo "$v$r: exit $?"; grep -E "^stage [123]:|^extension:|^cold start \(" $W/${v}${r}_console.txt | cut -c1-150
  done
done
