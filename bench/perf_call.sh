#!/usr/bin/env bash
# One nvidia-h100-x1 call (issue 4), everything under $OUT:
#   1. FP8 head, fused FP8 head and attention correctness on the GPU (gpu_checks.py)
#   2. bench.py: fresh cold start, per-stage step times, optimizers, orthogonalizers, profile, cached restart
#   3. bench.py --unfused-head --stages-only: step times with the unfused FP8 head (A/B control)
#   4. bench.py --static --stages-only: one compiled graph per stage (A/B control), if time is left
#   OUT=dir BUDGET_S=570 bash bench/perf_call.sh
set -uo pipefail
OUT=${OUT:-bench/out}; DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 bench/gpu_checks.py --checks fused_head,attention,fp8 --out "$OUT/gpu_checks.json" > /tmp/gpu_checks_console.txt 2>&1
echo "gpu_checks exit $?"; tail -3 /tmp/gpu_checks_console.txt; grep -E '"attention|identical|rel_diff|out_rel_err|_ms_|FAILED' "$OUT/gpu_checks.json"
left=$(( DEADLINE - $(date +%s) ))
timeout "$left" python3 bench/bench.py --out "$OUT/bench.json" --cached-start ${BENCH_ARGS:-} > "$OUT/bench_console.txt" 2>&1
echo "bench exit $?"; grep -vE '^step:' "$OUT/bench_console.txt" | tail -32
left=$(( DEADLINE - $(date +%s) ))
if [ "$left" -gt 120 ]; then
    timeout "$left" python3 bench/bench.py --unfused-head --stages-only --out "$OUT/bench_unfused.json" > /tmp/bench_unfused_console.txt 2>&1
    echo "unfused-head bench exit $?"; grep -vE '^step:' /tmp/bench_unfused_console.txt | tail -7
fi
left=$(( DEADLINE - $(date +%s) ))
if [ "$left" -gt 200 ]; then
    timeout "$left" python3 bench/bench.py --static --stages-only --out "$OUT/bench_static.json" > /tmp/bench_static_console.txt 2>&1
    echo "static bench exit $?"; grep -vE '^step:' /tmp/bench_static_console.txt | tail -12
else
    echo "static control skipped: ${left}s left"
fi
