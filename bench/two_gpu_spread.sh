#!/usr/bin/env bash
# Issue 6 (and issue 4's no-ML-change check) on nvidia-h200-x2, in two parts that each fit one device call:
#   PART=a  W=2 seed 1 with a profiled stage-3 step (75); then side by side: W=1 seeds 1, 2 of this script on
#           GPU 0 while GPU 1 runs seed 1 of the pre-optimisation script ($OLD, commit ac1a1bf).
#   PART=b  W=2 seeds 2, 3; then side by side: W=1 seed 3 on GPU 0, $OLD seeds 2, 3 on GPU 1; the kill test.
# Every run: the 90+6-step proxy schedule. Runs collect in $RUNS/<label>/ (machine-local, so part b on the same
# warm machine adds to part a's); the end of each part packs $RUNS into $OUT/runs_<part>.tgz (8 files come back).
#   OUT=dir PART=a OLD=.carry/old/train_gpt_ac1a1bf.py bash bench/two_gpu_spread.sh
set -uo pipefail
OUT=${OUT:-bench/out}; PART=${PART:-a}; OLD=${OLD:-.carry/old/train_gpt_ac1a1bf.py}; CORPUS=${CORPUS:-.carry/corpus}
RUNS=${RUNS:-/tmp/speedrun_runs}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT" "$RUNS"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
[ -f data/proxy/fineweb_train_000001.bin ] || timeout 120 ./run.sh proxy "$CORPUS" > "$RUNS/proxy_build.txt" 2>&1
ARGS="--data-path data/proxy --num-scheduled-iterations 90 --num-extension-iterations 6 --val-loss-every 30
      --val-batch-size 524288 --val-tokens 1572864"

run() {  # run LABEL SEED GPUS NPROC SCRIPT [extra args]: one training run, console and log in $RUNS/LABEL/
    local label=$1 seed=$2 gpus=$3 nproc=$4 script=$5; shift 5
    mkdir -p "$RUNS/$label"
    local t=$(date +%s)
    CUDA_VISIBLE_DEVICES=$gpus timeout "${RUN_TIMEOUT:-420}" python3 -m torch.distributed.run --standalone \
        --nproc_per_node="$nproc" "$script" $ARGS --seed "$seed" --run-id "${label}_seed$seed" --log-dir "$RUNS/$label" "$@" \
        > "$RUNS/$label/console_seed$seed.txt" 2>&1
    local rc=$?
    echo "$label seed $seed: exit $rc after $(( $(date +%s) - t ))s; $(grep -h 'Kernel warm-up' "$RUNS/$label/${label}_seed$seed.txt" 2>/dev/null | cut -c1-60); $(grep -h 'val_loss' "$RUNS/$label/${label}_seed$seed.txt" 2>/dev/null | tail -1)"
}

if [ "$PART" = a ]; then
    run w2 1 0,1 2 train_gpt.py --profile-step 75
    ( run w1 1 0 1 train_gpt.py; run w1 2 0 1 train_gpt.py ) &
    run old_w1 1 1 1 "$OLD"
    wait
else
    run w2 2 0,1 2 train_gpt.py
    run w2 3 0,1 2 train_gpt.py
    run w1 3 0 1 train_gpt.py &
    ( run old_w1 2 1 1 "$OLD"; run old_w1 3 1 1 "$OLD" )
    wait
    OUT="$RUNS" bash bench/kill_test.sh 2>&1 | tail -6 || true
fi
for d in w2 w1 old_w1; do [ -d "$RUNS/$d" ] && ls "$RUNS/$d" | tr '\n' ' '; echo; done
echo "== W=2 vs W=1 (this script)"; python3 bench/val_steps.py "$RUNS/w2" "$RUNS/w1" 2>&1 | tail -14
echo "== W=1: this script vs $OLD"; python3 bench/val_steps.py "$RUNS/w1" "$RUNS/old_w1" 2>&1 | tail -14
tar czf "$OUT/runs_$PART.tgz" -C "$RUNS" .
