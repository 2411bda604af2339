#!/usr/bin/env bash
# Second of two back-to-back nvidia-h100-x1 calls (issue 4, FlashAttention-4 lever), carrying .carry/fa4b;
# the first ran `bash bench/fa4_env.sh stash` carrying .carry/fa4a. Everything under $OUT:
#   1. install FA4 (bench/fa4_env.sh), its first-call JIT time, correctness vs the reference and vs our FA2 op
#      (gpu_checks attention), and the kernels' speed on a stage-3 micro-batch (gpu_checks attention_speed)
#   2. bench.py --attn-backend fa4 --stages-only: per-stage step times with FA4 in the whole model
#   OUT=dir BUDGET_S=570 bash bench/fa4_call.sh
set -uo pipefail
OUT=${OUT:-bench/out}; DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t=$(date +%s); source bench/fa4_env.sh install || exit 3; echo "fa4 install $(( $(date +%s) - t ))s"
timeout 240 python3 bench/gpu_checks.py --checks attention,attention_speed --out "$OUT/gpu_checks_fa4.json" > "$OUT/gpu_checks_fa4_console.txt" 2>&1
echo "gpu_checks exit $?"; tail -4 "$OUT/gpu_checks_fa4_console.txt" | cut -c1-300
python3 - "$OUT/gpu_checks_fa4.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k, v in r.items():
    if k.startswith("attention"):
        print(k, json.dumps(v)[:400])
PY
left=$(( DEADLINE - $(date +%s) ))
if [ "$left" -gt 150 ]; then
    timeout "$left" python3 bench/bench.py --attn-backend fa4 --stages-only --out "$OUT/bench_fa4.json" > "$OUT/bench_fa4_console.txt" 2>&1
    echo "fa4 bench exit $?"; grep -vE '^step:' "$OUT/bench_fa4_console.txt" | tail -14 | cut -c1-300
fi
