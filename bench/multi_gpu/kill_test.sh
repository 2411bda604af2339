#!/usr/bin/env bash
# Fault test on GPUs: one rank of a multi-GPU proxy run (bench/loss/proxy_runs.sh with tests/fault_launcher.py as the
# entry point) dies at a timed step; measures how long the whole job takes to end after that, i.e. whether torchrun
# stops the other ranks instead of leaving them hung in a collective.
#
#   OUT=dir NPROC=2 FAULT_RANK=1 FAULT_STEP=5 FAULT_KIND=kill bash bench/multi_gpu/kill_test.sh \
#       [-- extra train_gpt.py flags]
#   (DATA: the shards, default data/proxy, built from ../shared/corpus when missing, as bench/loss/proxy_runs.sh does)
#
# FAULT_KIND: kill (SIGKILL, a crashed process) or raise (an exception in the training step). KILL_TIMEOUT (default
# 400 s) cuts a hung job. Writes OUT/kill/console_seed1.txt and OUT/kill/kill_test.json: fault (rank, step, kind),
# job_exit_status, seconds_from_fault_to_job_end (null when the fault never fired), date, commit.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/out}; NPROC=${NPROC:-2}; DATA=${DATA:-data/proxy}
export FAULT_RANK=${FAULT_RANK:-1} FAULT_STEP=${FAULT_STEP:-5} FAULT_KIND=${FAULT_KIND:-kill}
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT/kill"
bash bench/loss/proxy_runs.sh --script tests/fault_launcher.py --nproc "$NPROC" --seeds 1 --label kill --out "$OUT" \
    --data "$DATA" --budget "${KILL_TIMEOUT:-400}" --min-left 0 -- "$@" > "$OUT/kill/status.txt" 2>&1
end=$(date +%s.%N)
cat "$OUT/kill/status.txt"
rc=$(sed -n 's/^kill seed 1: exit \([0-9]*\).*/\1/p' "$OUT/kill/status.txt")
fired=$(grep -ho 'unix time [0-9.]*' "$OUT/kill/console_seed1.txt" 2>/dev/null | awk '{print $3}' | head -1)
after=$( [ -n "$fired" ] && awk -v a="$end" -v b="$fired" 'BEGIN { printf "%.2f", a - b }' || echo null)
fmt='{"fault": {"rank": %s, "step": %s, "kind": "%s"}, "nproc": %s, "job_exit_status": %s,\n'
fmt+=' "seconds_from_fault_to_job_end": %s, "date": "%s", "commit": "%s"}\n'
printf "$fmt" \
    "$FAULT_RANK" "$FAULT_STEP" "$FAULT_KIND" "$NPROC" "${rc:-null}" "$after" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    "$(git rev-parse --short HEAD 2>/dev/null)" > "$OUT/kill/kill_test.json"
echo "kill test: rank $FAULT_RANK $FAULT_KIND at step $FAULT_STEP; job exit ${rc:-?}; ended ${after}s after the fault"
grep -vE '^step:[0-9]+/96 train_time' "$OUT/kill/console_seed1.txt" | tail -25
