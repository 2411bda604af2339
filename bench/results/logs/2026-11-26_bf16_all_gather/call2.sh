#!/usr/bin/env bash
# Device calls 2.. (warm; carry .carry/fa4b in the first, .carry/base_ea in each): the rank of an 8-GPU run on the
# machine's N GPUs (bench.py --stages-only --as-world-size 8), this tree ("new", commit NEW) against BASE's
# train_gpt.py and bench.py in a copy of this tree ("base"), alternating for rounds FIRST..ROUNDS; ENV="VAR=VALUE ..."
# adds a third arm, this tree under those NCCL settings ("env"); PROFILE=1 profiles stages 1 and 3 in the first
# round; W1=1 then times one GPU (new); NCCL=1 reruns bench/nccl_bandwidth.py (under ENV too if given). Each only
# with time left before LIMIT seconds. One archive comes back.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s); W=/tmp/w; mkdir -p $W
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
finish() { tar czf $OUT/call${CALL:-2}.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/install.txt 2>&1; tail -1 $W/install.txt
if [ ! -d /tmp/base ]; then
    mkdir -p /tmp/base && cp -r bench tests data records run.sh train_gpt.py /tmp/base/
    cp .carry/base_ea/train_gpt.py /tmp/base/ && cp .carry/base_ea/bench/bench.py /tmp/base/bench/
fi
N=$(nvidia-smi -L | wc -l)
TN="torchrun --standalone --nproc_per_node=$N"
bench() {  # bench NAME DIR COMMIT NEEDS_S LAUNCH... -- BENCH_FLAGS...
    local name=$1 dir=$2 commit=$3 need=$4; shift 4
    local l=$(left); [ "$l" -lt "$need" ] && { echo "=== $name skipped: ${l}s left"; return; }
    local launch=(); while [ "$1" != "--" ]; do launch+=("$1"); shift; done; shift
    echo "=== $name"
    (cd $dir && timeout $((l - 5)) "${launch[@]}" bench/bench.py --stages-only --commit $commit \
        --out $W/$name.json "$@") > $W/${name}_console.txt 2>&1
    echo "$name: exit $?"; grep -E "^(stage [123]|extension|cold start \()" $W/${name}_console.txt | cut -c1-150
}
for r in $(seq ${FIRST:-1} ${ROUNDS:-3}); do
    prof=(); [ "$r" = 1 ] && [ "${PROFILE:-0}" = 1 ] && prof=(--profile-stages 1,3)
    bench as8_new$r $PWD $NEW 75 $TN -- --steps 16 --as-world-size 8 "${prof[@]}"
    bench as8_base$r /tmp/base $BASE 75 $TN -- --steps 16 --as-world-size 8 "${prof[@]}"
    [ -n "${ENV:-}" ] && bench as8_env$r $PWD $NEW 75 env $ENV $TN -- --steps 16 --as-world-size 8 "${prof[@]}"
done
[ "${W1:-0}" = 1 ] && CUDA_VISIBLE_DEVICES=0 bench w1_new $PWD $NEW 100 python3 -- --steps 12
if [ "${NCCL:-0}" = 1 ] && [ "$(left)" -gt 40 ]; then
    env ${ENV:-} timeout $(( $(left) - 5 )) $TN bench/nccl_bandwidth.py --for-world-size 8 --out $W/nccl_new${ENV:+_env}.json \
        > $W/nccl_new_console.txt 2>&1; grep '^per step' $W/nccl_new_console.txt
fi
true
