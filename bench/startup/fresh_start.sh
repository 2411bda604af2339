#!/usr/bin/env bash
# One bench.py run as on a fresh machine: every compile cache (Inductor's, Triton's, FlashAttention-4's, quack's)
# in folders of its own that start empty, so the run compiles everything or loads a `--compile-cache` bundle.
#   DEST=dir bash bench/startup/fresh_start.sh LABEL [bench.py flags] [-- train_gpt.py flags]
# Writes DEST/LABEL.json (and bench.py's profiles), DEST/LABEL_console.txt and the trainer's log DEST/LABEL_log.txt;
# with PROFILE=1 it runs under bench/startup/startup_profile.py (DEST/LABEL_profile/). TIMEOUT_S (default 400) cuts it.
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
cd "$(dirname "$0")/../.."
label=$1; shift
DEST=${DEST:-bench/out}; mkdir -p "$DEST/$label.tmp"
caches=/tmp/fresh_start_$label
# A fresh machine has no caches at all: earlier runs' folders go too (a bundle's kernels name the folder they were
# compiled in, and would still find what an earlier run left there).
rm -rf /tmp/fresh_start_* ~/.triton
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton \
       FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$caches/fa4 QUACK_CACHE_DIR=$caches/quack
runner=(python3)
[ "${PROFILE:-0}" = 1 ] && runner=(python3 bench/startup/startup_profile.py --out "$DEST/${label}_profile")
# bench.py writes the trainer's log beside its JSON: a folder per run keeps the logs apart.
timeout "${TIMEOUT_S:-400}" "${runner[@]}" bench/bench.py --out "$DEST/$label.tmp/$label.json" "$@" \
    > "$DEST/${label}_console.txt" 2>&1
rc=$?
mv "$DEST/$label.tmp/bench_log.txt" "$DEST/${label}_log.txt" 2>/dev/null
mv "$DEST/$label.tmp/"* "$DEST/" 2>/dev/null  # the JSON and any <LABEL>_profile_stage<N>.txt
rmdir "$DEST/$label.tmp"
echo "$label: exit $rc"
grep -E "cold start|warm-up|compile|error|Error|stage|^\|" "$DEST/${label}_console.txt" | grep -v '^step:' | tail -16 | cut -c1-240
