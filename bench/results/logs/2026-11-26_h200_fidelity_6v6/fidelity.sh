#!/usr/bin/env bash
# Device calls 2.. (warm, the first of them carrying .carry/fa4b .carry/corpus_b): the 300+10 proxy schedule
# (--train-epochs 3) on the one GPU, one run after another in the order RUNS gives ("defaults:3 record_path:1 ..."),
# each started only with time left before LIMIT (seconds from this script's start). The defaults against the
# path closest to the record's arithmetic (FA2 varlen attention, Inductor's MLP, the unfused FP8 head).
# Logs stay on the machine (/tmp/f) and every call returns all of them so far in one archive.
export PYTHONUNBUFFERED=1
t0=$(date +%s)
source bench/fa4_env.sh install
if [ ! -f data/proxy/fineweb_val_000000.bin ]; then
    cat /tmp/corpus/train.part1 .carry/corpus_b/train.part2 > /tmp/corpus/train.jsonl.xz
    cp .carry/corpus_b/val.jsonl.xz /tmp/corpus/
    [ "$(sha256sum /tmp/corpus/train.jsonl.xz | cut -d' ' -f1)" = "$(cat .carry/corpus_b/train.sha256)" ] || { echo "corpus: bad checksum"; exit 1; }
    t=$(date +%s); ./run.sh proxy /tmp/corpus > /tmp/proxy_build.txt 2>&1; echo "proxy build exit $? in $(( $(date +%s) - t ))s"
fi
schedule="--num-scheduled-iterations 300 --num-extension-iterations 10 --val-loss-every 100 --train-epochs 3"
mkdir -p /tmp/f
for run in $RUNS; do
    label=${run%%:*}; seed=${run##*:}
    [ -f "/tmp/f/$label/${label}_seed$seed.txt" ] && grep -q "step:310/310 val_loss" "/tmp/f/$label/${label}_seed$seed.txt" && continue
    extra=""; [ "$label" = record_path ] && extra="--attn-backend varlen --mlp-kernel inductor --fused-fp8-head false"
    budget=$(( LIMIT - ($(date +%s) - t0) ))
    bash bench/proxy_runs.sh --seeds "$seed" --label "$label" --out /tmp/f --budget "$budget" --min-left "${MIN_LEFT:-200}" \
        -- $schedule $extra 2>&1 | tee -a /tmp/f/lanes.txt
done
tar -C /tmp -czf "$OUT/fidelity_logs.tgz" f && ls -la "$OUT"
