#!/bin/bash
# Device machine M5, call 2: a stale bundle (M1's, written by bench.py from an earlier version of the script) is
# rewritten after the warm-up (E), and the next fresh start with the rewritten bundle (F) compiles nothing.
set -u
W=/tmp/w; mkdir -p $W
trap 'tar czf $OUT/M5.tgz -C $W . ; ls -la $OUT' EXIT
source bench/fa4_env.sh install > $W/M5_install.txt 2>&1; tail -1 $W/M5_install.txt
python3 -c "import sys; sys.path.insert(0, 'tests'); from proxy_shards import build_shards
build_shards('/tmp/synth', train_shards=1, tokens_per_train_shard=2_000_000, val_tokens=1_100_000)"
cp .carry/bundle/bundle.zip /tmp/bundle_M1.zip
run() {
  label=$1; bundle=$2; shift 2
  rm -rf /tmp/c_* ~/.triton
  export TORCHINDUCTOR_CACHE_DIR=/tmp/c_$label/inductor TRITON_CACHE_DIR=/tmp/c_$label/triton \
         FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/c_$label/fa4 QUACK_CACHE_DIR=/tmp/c_$label/quack PYTHONUNBUFFERED=1
  timeout 280 "$@" train_gpt.py --data-path /tmp/synth --num-scheduled-iterations 30 --num-extension-iterations 3 \
      --val-loss-every 0 --val-batch-size 524288 --val-tokens 1048576 --train-epochs 10 --seed 1 \
      --compile-cache $bundle --run-id M5_$label --log-dir $W > $W/M5_${label}_console.txt 2>&1
  echo "$label: exit $?"
  grep -E "^compile cache|^warm-up: (compiled|train steps for batch 131072)|^Kernel warm-up|^summary" \
      $W/M5_${label}_console.txt | cut -c1-330
}
cp /tmp/bundle_M1.zip /tmp/bundle_E.zip
run E /tmp/bundle_E.zip python3 -m torch.distributed.run --standalone --nproc_per_node=1
run F /tmp/bundle_E.zip python3 -m torch.distributed.run --standalone --nproc_per_node=1
ls -la /tmp/bundle_E.zip
