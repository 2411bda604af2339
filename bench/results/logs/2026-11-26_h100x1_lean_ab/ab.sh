#!/usr/bin/env bash
# Device calls 2.. (warm; carry .carry/fa4b in the first, .carry/base33 in each): the GPU checks (CALL_TESTS=1), then
# bench.py --stages-only on the one GPU, this tree ("new", commit NEW) against BASE's train_gpt.py and bench.py in a
# copy of this tree ("base"), alternating new, base, new, base, ... for ROUNDS rounds while time is left before
# LIMIT seconds. Everything comes back as one archive.
set -u
T0=$(date +%s); W=/tmp/w; mkdir -p $W
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
finish() { tar czf $OUT/lean_ab.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/install.txt 2>&1; tail -1 $W/install.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/nvidia_smi.txt
if [ "${CALL_TESTS:-0}" = 1 ]; then
    t=$(date +%s)
    SPEEDRUN_GPU_JSON=$W/gpu_checks.json timeout 300 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
        > $W/gpu_checks_console.txt 2>&1
    echo "gpu checks: exit $? in $(( $(date +%s) - t ))s"; tail -3 $W/gpu_checks_console.txt
fi
if [ ! -d /tmp/base ]; then
    mkdir -p /tmp/base && cp -r bench tests data records run.sh train_gpt.py /tmp/base/
    cp .carry/base33/train_gpt.py /tmp/base/ && cp .carry/base33/bench/bench.py /tmp/base/bench/
fi
for r in $(seq ${FIRST:-1} ${ROUNDS:-2}); do
  for v in new base; do
    l=$(left); [ "$l" -lt 110 ] && { echo "skip $v$r: ${l}s left"; continue; }
    dir=$PWD; commit=$NEW; [ $v = base ] && { dir=/tmp/base; commit=$BASE; }
    mkdir -p $W/${v}$r
    (cd $dir && timeout $((l - 10)) python3 bench/bench.py --out $W/${v}$r/${v}$r.json --stages-only \
        --steps 16 --commit $commit) > $W/${v}${r}_console.txt 2>&1
    echo "$v$r: exit $?"; grep -E "^stage [123]:|^extension:|^cold start \(" $W/${v}${r}_console.txt | cut -c1-150
  done
done
