#!/usr/bin/env bash
# No-ML-change check (issue 4) on a warm nvidia-h100-x1 that already has FA4 installed (bench/fa4_env.sh) and
# /tmp/relu2_mm.json: the 90+6-step proxy schedule per seed, alternating the optimized default (FA4, fused ReLU²,
# fused FP8 head) and the unoptimized path (FA2 varlen, Inductor's ReLU², unfused FP8 head), so that a deadline
# cut leaves both with the same number of seeds. Carries .carry/corpus.  OUT=dir BUDGET_S=580 bash bench/ml_check_call.sh
set -uo pipefail
OUT=${OUT:-bench/out}; export DEADLINE=$(( $(date +%s) + ${BUDGET_S:-580} )) MIN_LEFT=${MIN_LEFT:-75}
source bench/fa4_env.sh install || exit 3
best=$(python3 -c "import json; print(json.load(open('/tmp/relu2_mm.json'))['best'])" 2>/dev/null || echo default)
case "$best" in unfused|default) ;; *) export SPEEDRUN_RELU2_MM_CONFIG=$best ;; esac
for seed in ${SEEDS:-1 2 3}; do
    OUT=$OUT SEEDS=$seed LABEL=optimized bash bench/seed_runs.sh
    OUT=$OUT SEEDS=$seed LABEL=unoptimized bash bench/seed_runs.sh --attn-backend varlen --fused-relu2 false --fused-fp8-head false
done
python3 bench/val_steps.py "$OUT/optimized" "$OUT/unoptimized" --json "$OUT/val_steps.json" 2>&1 | tail -24
python3 bench/run_summary.py "$OUT/optimized" "$OUT/unoptimized" --json "$OUT/run_summary.json" > /dev/null 2>&1
