#!/usr/bin/env bash
# Device call 2 of 2 (warm nvidia-h100-x2 or -x4 after `bash bench/fa4_env.sh stash` with .carry/fa4a; carry
# .carry/fa4b): the rank of an 8-GPU run with its collectives (one micro-batch a step, the graphs write the gradients
# a step starts, DistAdam's reduce-scatters inside the graphs), each stage's graphs against eager (bench.py
# --check-graphs). One archive comes back.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W
finish() { tar czf $OUT/check.tgz -C $W . ; ls -la $OUT; }
trap finish EXIT
source bench/fa4_env.sh install > $W/install.txt 2>&1; tail -1 $W/install.txt
N=$(nvidia-smi -L | wc -l)
timeout 500 torchrun --standalone --nproc_per_node=$N bench/bench.py --stages-only --as-world-size 8 --steps 8 \
    --check-graphs --commit $NEW --out $W/check_as8.json > $W/check_as8_console.txt 2>&1
echo "check: exit $?"; tail -5 $W/check_as8_console.txt
python3 - <<'PY'
import json
r = json.load(open("/tmp/w/check_as8.json")).get("cuda_graphs_check", {})
for s in r.get("stages", []):
    print(s["stage"], "losses identical:", s["losses_graphs_vs_eager"]["identical"],
          "grads rel graphs-eager %.2e eager-eager %.2e" % (s["grads_graphs_vs_eager"]["rel_norm"], s["grads_eager_vs_eager"]["rel_norm"]),
          {k: v for k, v in s.items() if "reduce" in k or "replica" in k})
PY
true
