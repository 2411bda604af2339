#!/usr/bin/env bash
# Device call 5 (warm from call 4): the fidelity runs of the 300+10 proxy schedule (--train-epochs 3), one process
# per GPU: GPU 0 the defaults, GPU 1 the path closest to the record's arithmetic (FA2 varlen attention, Inductor's
# MLP, the unfused FP8 head). SEEDS and LIMIT (seconds from this script's start) from the environment.
export PYTHONUNBUFFERED=1
t0=$(date +%s)
# logs an earlier call left on this machine (a call's output folder may keep only a few files)
find / -path /proc -prune -o -name "*_seed[0-9].txt" -path "*/f/*" -print 2>/dev/null | grep -v "^$OUT" | head -20 \
    | tar -czf "$OUT/earlier_logs.tgz" -T - 2>/dev/null; ls -la "$OUT"
source bench/fa4_env.sh install
if [ ! -f data/proxy/fineweb_val_000000.bin ]; then
    cat /tmp/corpus/train.part1 .carry/corpus_b/train.part2 > /tmp/corpus/train.jsonl.xz
    cp .carry/corpus_b/val.jsonl.xz /tmp/corpus/
    [ "$(sha256sum /tmp/corpus/train.jsonl.xz | cut -d' ' -f1)" = "$(cat .carry/corpus_b/train.sha256)" ] || { echo "corpus: bad checksum"; exit 1; }
    t=$(date +%s); ./run.sh proxy /tmp/corpus > "$OUT/proxy_build.txt" 2>&1; echo "proxy build exit $? in $(( $(date +%s) - t ))s"
fi
BUDGET=$(( LIMIT - ($(date +%s) - t0) )); echo "lanes: ${BUDGET}s"
schedule="--num-scheduled-iterations 300 --num-extension-iterations 10 --val-loss-every 100 --train-epochs 3"
CUDA_VISIBLE_DEVICES=0 bash bench/proxy_runs.sh --seeds "${SEEDS0:-$SEEDS}" --label defaults --out "$OUT/f" --budget "$BUDGET" \
    --min-left 165 -- $schedule > "$OUT/lane0.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=1 bash bench/proxy_runs.sh --seeds "${SEEDS1:-$SEEDS}" --label record_path --out "$OUT/f" --budget "$BUDGET" \
    --min-left 180 -- $schedule --attn-backend varlen --mlp-kernel inductor --fused-fp8-head false > "$OUT/lane1.txt" 2>&1 &
wait
cat "$OUT/lane0.txt" "$OUT/lane1.txt"
# a result comes back as few files: the logs in one archive
tar -C "$OUT" -czf "$OUT/fidelity_logs.tgz" f lane0.txt lane1.txt && rm -rf "$OUT/f"
