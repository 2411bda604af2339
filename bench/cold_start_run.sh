#!/usr/bin/env bash
# Cold start of one attention backend as if on a fresh machine, several backends comparable on one machine:
# bench/bench.py --stages-only --cached-start with compile caches of its own (Inductor, Triton, FA4's CuTe DSL)
# that start empty, so the first process compiles everything and the second (--cached-start) reuses them.
#
#   OUT=dir bash bench/cold_start_run.sh varlen|fa4|auto [more train_gpt.py flags]
#
# Writes OUT/bench_BACKEND.json (bench.py's JSON: cold_start.this_process_s is the fresh start, cold_start.cached_s
# the restart with the caches; stages as usual) and OUT/bench_BACKEND_console.txt. TIMEOUT_S (default 420) cuts it.
# The OS file cache is not cleared: the second backend run on a machine may start faster for that reason alone,
# so alternate the order across machines. fa4 needs FlashAttention-4 installed (see bench/README.md).
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
cd "$(dirname "$0")/.."
backend=$1; shift
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
caches=/tmp/cold_start_$backend
rm -rf "$caches"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton \
       FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$caches/fa4
timeout "${TIMEOUT_S:-420}" python3 bench/bench.py --stages-only --cached-start --out "$OUT/bench_$backend.json" \
    -- --attn-backend "$backend" "$@" > "$OUT/bench_${backend}_console.txt" 2>&1
echo "$backend bench exit $?"; grep -vE '^step:' "$OUT/bench_${backend}_console.txt" | tail -9 | cut -c1-250
