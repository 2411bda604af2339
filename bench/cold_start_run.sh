#!/usr/bin/env bash
# A fresh cold start and per-stage step times for one attention backend, with compile caches of its own (Inductor,
# Triton, FA4's CuTe DSL) that start empty, so several backends can be compared on one machine as if each ran on a
# fresh one; then the cached restart with those caches.  OUT=dir bash bench/cold_start_run.sh varlen|fa4 [bench args]
# (fa4 needs `source bench/fa4_env.sh install` first)
set -uo pipefail
backend=$1; shift
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
caches=/tmp/cold_start_$backend
rm -rf "$caches"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton \
       FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$caches/fa4
timeout "${TIMEOUT_S:-420}" python3 bench/bench.py --attn-backend "$backend" --stages-only --cached-start \
    --out "$OUT/bench_$backend.json" "$@" > "$OUT/bench_${backend}_console.txt" 2>&1
echo "$backend bench exit $?"; grep -vE '^step:' "$OUT/bench_${backend}_console.txt" | tail -9 | cut -c1-250
