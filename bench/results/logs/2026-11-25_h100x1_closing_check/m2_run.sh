#!/bin/bash
# Device machine M2, call 2: FA4 + quack installed; a fresh machine given M1's compile-cache bundle (cold start and
# stage times), a second run on its caches, and one profiled eager stage-3 step.
set -u
C=$1; T0=$(date +%s); W=/tmp/w; mkdir -p $W
left() { echo $(( 545 - ($(date +%s) - T0) )); }
trap 'tar czf $OUT/M2.tgz -C $W . ; ls -la $OUT' EXIT
source bench/fa4_env.sh install > $W/M2_install.txt 2>&1; tail -1 $W/M2_install.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/M2_nvidia_smi.txt
cp .carry/bundle/bundle.zip /tmp/bundle_M1.zip; sha256sum /tmp/bundle_M1.zip > $W/M2_bundle_sha256.txt
DEST=$W TIMEOUT_S=220 bash bench/fresh_start.sh M2_bundle --stages-only --steps 16 --commit $C -- --compile-cache /tmp/bundle_M1.zip
grep -h "compile cache" $W/M2_bundle_console.txt | head -3 | cut -c1-300
export TORCHINDUCTOR_CACHE_DIR=/tmp/fresh_start_M2_bundle/inductor TRITON_CACHE_DIR=/tmp/fresh_start_M2_bundle/triton \
       FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fresh_start_M2_bundle/fa4 QUACK_CACHE_DIR=/tmp/fresh_start_M2_bundle/quack
for run in "M2_warm --steps 16" "M2_prof --steps 4 --profile-stages 3 -- --cuda-graphs off"; do
  set -- $run; label=$1; shift
  l=$(left); [ "$l" -lt 100 ] && { echo "skip $label: ${l}s left"; continue; }
  mkdir -p $W/$label
  timeout $((l - 15)) python3 bench/bench.py --out $W/$label/$label.json --stages-only --commit $C "$@" \
      > $W/${label}_console.txt 2>&1
  echo "$label: exit $?"; grep -E "^stage [123]:|^cold start" $W/${label}_console.txt | cut -c1-150
done
