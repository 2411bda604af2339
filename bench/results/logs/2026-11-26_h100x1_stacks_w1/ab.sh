#!/usr/bin/env bash
# Device call 2 (warm; carry .carry/fa4b and .carry/base_nm): bench.py --stages-only on one GPU, this tree ("new",
# commit NEW) against BASE's train_gpt.py and bench.py in a copy of this tree ("base"), alternating new, base for
# ROUNDS rounds while time is left before LIMIT seconds. Everything comes back as one archive.
set -u
T0=$(date +%s); W=/tmp/w; mkdir -p $W
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
finish() { tar czf $OUT/stacks_w1.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/install.txt 2>&1; tail -1 $W/install.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/nvidia_smi.txt
mkdir -p /tmp/base && cp -r bench tests data records run.sh train_gpt.py /tmp/base/
cp .carry/base_nm/train_gpt.py /tmp/base/ && cp .carry/base_nm/bench/bench.py /tmp/base/bench/
for r in $(seq 1 ${ROUNDS:-2}); do
  for v in new base; do
    l=$(left); [ "$l" -lt "${NEED:-75}" ] && { echo "skip $v$r: ${l}s left"; continue; }
    dir=$PWD; commit=$NEW; [ $v = base ] && { dir=/tmp/base; commit=$BASE; }
    (cd $dir && timeout $((l - 5)) python3 bench/bench.py --out $W/${v}$r.json --stages-only --steps 12 \
        --commit $commit) > $W/${v}${r}_console.txt 2>&1
    echo "$v$r: exit $?"; grep -E "^stage [123]:|^extension:|^cold start \(" $W/${v}${r}_console.txt | cut -c1-150
  done
done
