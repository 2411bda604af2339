#!/usr/bin/env bash
# Last nvidia-h100-x1 call (issue 4): time the fused CE-backward kernel's tile variants against the unfused path,
# then run the full benchmark with the winner (fused with the best tile, or --unfused-head).  OUT=dir bash bench/final_call.sh
set -uo pipefail
OUT=${OUT:-bench/out}; DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 bench/ce_kernel_bench.py --out "$OUT/ce_kernel.json" 2>&1 | tail -12
best=$(python3 -c "import json; print(json.load(open('$OUT/ce_kernel.json'))['best'])" 2>/dev/null || echo unfused)
if [ "$best" = unfused ]; then extra="--unfused-head"; else export SPEEDRUN_CE_BWD_CONFIG=$best; extra=""; fi
echo "benchmark with: ${extra:-fused head, tile $best}"
left=$(( DEADLINE - $(date +%s) ))
timeout "$left" python3 bench/bench.py --out "$OUT/bench.json" --cached-start $extra > "$OUT/bench_console.txt" 2>&1
echo "bench exit $?"; grep -vE '^step:' "$OUT/bench_console.txt" | tail -14
