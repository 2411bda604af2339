#!/usr/bin/env bash
# Device call 2 (warm, after call1.sh; carry .carry/fa4b .carry/base_hd): the rank of an 8-GPU run on the machine's
# GPUs (bench.py --stages-only --as-world-size 8), NorMuon's last all-gather left to the forward ("new", this tree,
# commit NEW) against BASE's train_gpt.py and bench.py in a copy of this tree ("base"), alternating for ROUNDS rounds
# (the first profiles stages 1 and 3 unless PROFILE=0), each only with time left before LIMIT seconds; ENV="VAR=VALUE
# ..." runs both arms under those settings (NCCL_MAX_NCHANNELS=2: collectives slow enough to stand out from the update
# work, as at 8 GPUs), TAG prefixes the runs' names. One archive comes back.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s); W=/tmp/w; mkdir -p $W
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
finish() { tar czf $OUT/ab.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/install.txt 2>&1; tail -1 $W/install.txt
mkdir -p /tmp/base && cp -r bench tests records run.sh train_gpt.py /tmp/base/
cp .carry/base_hd/train_gpt.py /tmp/base/ && cp .carry/base_hd/bench/bench.py /tmp/base/bench/
N=$(nvidia-smi -L | wc -l)
run() {  # run NAME DIR COMMIT [FLAGS...]
    local name=$1 dir=$2 commit=$3; shift 3
    local l=$(left); [ "$l" -lt 80 ] && { echo "=== $name skipped: ${l}s left"; return; }
    (cd $dir && env ${ENV:-} timeout $((l - 5)) torchrun --standalone --nproc_per_node=$N bench/bench.py --stages-only --steps 16 \
        --as-world-size 8 --commit $commit --out $W/$name.json "$@") > $W/${name}_console.txt 2>&1
    echo "$name: exit $?"; grep -E "^(stage [123]:|extension:|replicas)" $W/${name}_console.txt | cut -c1-120
}
for r in $(seq 1 ${ROUNDS:-3}); do
    prof=(); [ "$r" = 1 ] && [ "${PROFILE:-1}" = 1 ] && prof=(--profile-stages 1,3)
    run ${TAG:-}new$r $PWD $NEW "${prof[@]}"
    run ${TAG:-}base$r /tmp/base $BASE "${prof[@]}"
done
true
