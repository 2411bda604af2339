#!/bin/bash
# Device machine M3, call 2: the trainer itself (train_gpt.py under torchrun, not bench.py) at HEAD on a fresh
# machine given M1's bundle, on synthetic shards, a 30+3-step schedule: the log's Host paths line and a whole run;
# then the GPU check of the gemm_add plan again (its summary).
set -u
C=$1; W=/tmp/w; mkdir -p $W
trap 'tar czf $OUT/M3.tgz -C $W . ; ls -la $OUT' EXIT
source bench/fa4_env.sh install > $W/M3_install.txt 2>&1; tail -1 $W/M3_install.txt
export TORCHINDUCTOR_CACHE_DIR=/tmp/m3/inductor TRITON_CACHE_DIR=/tmp/m3/triton \
       FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/m3/fa4 QUACK_CACHE_DIR=/tmp/m3/quack PYTHONUNBUFFERED=1
rm -rf /tmp/m3 ~/.triton; cp .carry/bundle/bundle.zip /tmp/m3_bundle.zip
python3 -c "import sys; sys.path.insert(0, 'tests'); from proxy_shards import build_shards
build_shards('/tmp/synth', train_shards=1, tokens_per_train_shard=2_000_000, val_tokens=1_100_000)"
timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt.py --data-path /tmp/synth \
    --num-scheduled-iterations 30 --num-extension-iterations 3 --val-loss-every 0 --val-batch-size 524288 \
    --val-tokens 1048576 --train-epochs 10 --seed 1 --compile-cache /tmp/m3_bundle.zip --run-id M3_synth \
    --log-dir $W > $W/M3_synth_console.txt 2>&1
echo "train_gpt.py exit $?"
grep -E "^Run config|^compile cache|^Host paths|^Kernel warm-up|^step:33|^summary|^peak" $W/M3_synth_console.txt | cut -c1-400
SPEEDRUN_GPU_JSON=$W/M3_gpu_checks.json timeout 120 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
    -k "gemm_add_plan" > $W/M3_gpu_checks_console.txt 2>&1
tail -1 $W/M3_gpu_checks_console.txt
