#!/usr/bin/env bash
# Device call 2 (warm; carry .carry/fa4b and .carry/base_ea): the rank of an 8-GPU run on one GPU (bench.py
# --stages-only --as-world-size 8: one micro-batch a step, no collectives), this tree ("new", commit NEW: the graphs
# write the gradients a step starts) against BASE's train_gpt.py and bench.py in a copy of this tree ("base",
# zeroed buffers and additions), alternating new, base for ROUNDS rounds (the first profiles stages 1 and 3), then
# new's graphs against eager (--check-graphs), while time is left before LIMIT seconds. One archive comes back.
set -u
T0=$(date +%s); W=/tmp/w; mkdir -p $W
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
finish() { tar czf $OUT/writes_first.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/install.txt 2>&1; tail -1 $W/install.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/nvidia_smi.txt
mkdir -p /tmp/base && cp -r bench tests data records run.sh train_gpt.py /tmp/base/
cp .carry/base_ea/train_gpt.py /tmp/base/ && cp .carry/base_ea/bench/bench.py /tmp/base/bench/
run() {  # run NAME DIR COMMIT NEED FLAGS...
    local name=$1 dir=$2 commit=$3 need=$4; shift 4
    local l=$(left); [ "$l" -lt "$need" ] && { echo "skip $name: ${l}s left"; return; }
    (cd $dir && timeout $((l - 5)) python3 bench/bench.py --out $W/$name.json --stages-only --as-world-size 8 \
        --commit $commit "$@") > $W/${name}_console.txt 2>&1
    echo "$name: exit $?"; grep -E "^stage [123]:|^extension:|^cold start \(" $W/${name}_console.txt | cut -c1-150
}
for r in $(seq 1 ${ROUNDS:-3}); do
    prof=(); [ "$r" = 1 ] && prof=(--profile-stages 1,3)
    run new$r $PWD $NEW 60 --steps 24 "${prof[@]}"
    run base$r /tmp/base $BASE 60 --steps 24 "${prof[@]}"
done
run check_new $PWD $NEW 60 --steps 8 --check-graphs
python3 - <<'PY' 2>/dev/null
import json
r = json.load(open("/tmp/w/check_new.json")).get("cuda_graphs_check", {})
for s in r.get("stages", []):
    print(s["stage"], "losses identical:", s["losses_graphs_vs_eager"]["identical"],
          "grads rel graphs-eager %.2e eager-eager %.2e" % (s["grads_graphs_vs_eager"]["rel_norm"], s["grads_eager_vs_eager"]["rel_norm"]))
PY
true
