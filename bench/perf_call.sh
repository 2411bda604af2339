#!/usr/bin/env bash
# One nvidia-h100-x1 call (issue 4), everything under $OUT:
#   1. attention + FP8 correctness on the GPU (our FlashAttention custom op must give torch varlen_attn's bits)
#   2. bench.py: fresh cold start, per-stage step times, optimizers, orthogonalizers, profile, cached restart
#   3. bench.py --static --stages-only: the same step times with one compiled graph per stage (A/B control)
#   OUT=dir BUDGET_S=570 bash bench/perf_call.sh
set -uo pipefail
OUT=${OUT:-bench/out}; DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 bench/gpu_checks.py --checks attention,fp8 --out "$OUT/gpu_checks.json" > "$OUT/gpu_checks_console.txt" 2>&1
echo "gpu_checks exit $?"; grep -E '"attention|bit_identical|out_rel_err|FAILED' "$OUT/gpu_checks.json"
left=$(( DEADLINE - $(date +%s) ))
timeout "$left" python3 bench/bench.py --out "$OUT/bench.json" --cached-start ${BENCH_ARGS:-} > "$OUT/bench_console.txt" 2>&1
echo "bench exit $?"; grep -vE '^step:' "$OUT/bench_console.txt" | tail -32
left=$(( DEADLINE - $(date +%s) ))
if [ "$left" -gt 150 ]; then
    timeout "$left" python3 bench/bench.py --static --stages-only --out "$OUT/bench_static.json" > "$OUT/bench_static_console.txt" 2>&1
    echo "static bench exit $?"; grep -vE '^step:' "$OUT/bench_static_console.txt" | tail -12
else
    echo "static control skipped: ${left}s left"
fi
