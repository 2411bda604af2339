#!/usr/bin/env bash
# The 90+6-step proxy schedule once per seed, for the run-to-run spread (issues 4 and 6).
#   SCRIPT=train_gpt.py LABEL=new SEEDS="1 2 3" NPROC=1 OUT=dir DEADLINE=<epoch s> bash bench/seed_runs.sh [args]
# Logs land in $OUT/$LABEL/. A run is only started while at least MIN_LEFT seconds remain before DEADLINE,
# and is cut at DEADLINE: an unfinished log is then skipped (and named) by bench/val_steps.py.
set -uo pipefail
SCRIPT=${SCRIPT:-train_gpt.py}; LABEL=${LABEL:-new}; SEEDS=${SEEDS:-"1 2 3"}; NPROC=${NPROC:-1}
OUT=${OUT:-bench/out}; CORPUS=${CORPUS:-.carry/corpus}; DEADLINE=${DEADLINE:-$(( $(date +%s) + 560 ))}
MIN_LEFT=${MIN_LEFT:-100}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/$LABEL"
[ -f data/proxy/fineweb_train_000001.bin ] || timeout 120 ./run.sh proxy "$CORPUS" > "$OUT/proxy_build.txt" 2>&1
for seed in $SEEDS; do
    left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt "$MIN_LEFT" ]; then echo "$LABEL: seed $seed not started, ${left}s left"; break; fi
    t=$(date +%s)
    timeout "$left" python3 -m torch.distributed.run --nproc_per_node="$NPROC" --standalone "$SCRIPT" \
        --data-path data/proxy --num-scheduled-iterations 90 --num-extension-iterations 6 --val-loss-every 30 \
        --val-batch-size 524288 --val-tokens 1572864 --seed "$seed" --run-id "${LABEL}_seed$seed" \
        --log-dir "$OUT/$LABEL" "$@" > "$OUT/$LABEL/console_seed$seed.txt" 2>&1
    echo "$LABEL seed $seed: exit $? after $(( $(date +%s) - t ))s; $(grep -h 'val_loss' "$OUT/$LABEL/${LABEL}_seed$seed.txt" 2>/dev/null | tail -1)"
done
