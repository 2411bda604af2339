#!/usr/bin/env bash
# The final nvidia-h100-x1 benchmark (issue 4): FlashAttention-4 + the fused ReLU² MLP, on a machine whose
# compile caches are empty. Second of back-to-back calls: the first ran `bash bench/fa4_env.sh stash` (carrying
# .carry/fa4a) and bench/relu2_mm_bench.py with throwaway cache folders, leaving /tmp/relu2_mm.json; this one
# carries .carry/fa4b.  OUT=dir BUDGET_S=570 bash bench/final_fa4_call.sh
#   1. install FA4 (not part of the cold start: an environment step, like pip install)
#   2. bench.py --cached-start with the winning MLP path (--fused-mlp with its best tile, or the unfused default)
#   3. bench.py --stages-only with the other MLP path (A/B control), if time is left
set -uo pipefail
OUT=${OUT:-bench/out}; DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
source bench/fa4_env.sh install || exit 3
best=$(python3 -c "import json; print(json.load(open('/tmp/relu2_mm.json'))['best'])" 2>/dev/null || echo default)
case "$best" in
    unfused) main=""; control="--fused-mlp" ;;
    default) main="--fused-mlp"; control="" ;;
    *) export SPEEDRUN_RELU2_MM_CONFIG=$best; main="--fused-mlp"; control="" ;;
esac
echo "MLP: relu2_mm_bench best=$best; main run ${main:-unfused}, control ${control:-unfused}"
left=$(( DEADLINE - $(date +%s) ))
timeout "$left" python3 bench/bench.py --out "$OUT/bench.json" --cached-start $main > "$OUT/bench_console.txt" 2>&1
echo "bench exit $?"; grep -vE '^step:' "$OUT/bench_console.txt" | tail -16 | cut -c1-250
head -3 "$OUT/bench_profile.txt" | cut -c1-250
left=$(( DEADLINE - $(date +%s) ))
if [ "$left" -gt 140 ]; then
    timeout "$left" python3 bench/bench.py --stages-only --out "$OUT/bench_control.json" $control > "$OUT/bench_control_console.txt" 2>&1
    echo "control (${control:-unfused}) exit $?"; grep -vE '^step:' "$OUT/bench_control_console.txt" | tail -7 | cut -c1-250
else
    echo "control skipped: ${left}s left"
fi
