#!/usr/bin/env bash
# The 90+6-step proxy schedule once per seed, under torchrun, on a GPU machine (run-to-run spread, A/B checks).
#
#   bash bench/loss/proxy_runs.sh [options] [-- extra train_gpt.py flags]
#     --seeds "1 2 3"    seeds, one run each, in this order             (default "1 2 3")
#     --nproc N          processes (GPUs) per run: --nproc_per_node     (default 1)
#     --label NAME       run ids NAME_seedS, logs in OUT/NAME/           (default run)
#     --out DIR          output folder                                  (default bench/out)
#     --corpus DIR       corpus for ./run.sh proxy when data/proxy has no shards (default ../shared/corpus)
#     --data DIR         shards passed as --data-path                   (default data/proxy)
#     --script FILE      torchrun entry point, e.g. an older or upstream trainer for an A/B (default train_gpt.py)
#     --deadline EPOCH   stop at this unix time: a run starts only with --min-left seconds to go and is
#                        cut at the deadline (an unfinished log is skipped, and named, by val_steps.py)
#     --budget SECONDS   the same as --deadline now+SECONDS
#     --min-left SECONDS (default 100)
#
# Relative paths are taken from the repository root (the script works from there, like run.sh). Per seed:
# OUT/LABEL/LABEL_seedS.txt (the trainer's log) and OUT/LABEL/console_seedS.txt (stdout and stderr). One line per
# seed on stdout: exit status, seconds, last validation line. Exit status 0 when every seed ran and exited 0.
# PYTHON (default python3) is the interpreter; CUDA_VISIBLE_DEVICES and other variables pass through. Compare
# sets with `python3 bench/loss/val_steps.py OUT/A OUT/B` and `python3 bench/loss/run_summary.py OUT/A`.
set -uo pipefail

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }

seeds="1 2 3"; nproc=1; label=run; out=bench/out; corpus=../shared/corpus; data=data/proxy
script=train_gpt.py; deadline=""; min_left=100
while [ $# -gt 0 ]; do
    case "$1" in
        --seeds) seeds=$2; shift 2 ;;
        --nproc) nproc=$2; shift 2 ;;
        --label) label=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --corpus) corpus=$2; shift 2 ;;
        --data) data=$2; shift 2 ;;
        --script) script=$2; shift 2 ;;
        --deadline) deadline=$2; shift 2 ;;
        --budget) deadline=$(( $(date +%s) + $2 )); shift 2 ;;
        --min-left) min_left=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) echo "proxy_runs.sh: unknown option $1 (train_gpt.py flags go after --)" >&2; exit 2 ;;
    esac
done
for n in $seeds $nproc $min_left $deadline; do
    case "$n" in ''|*[!0-9]*) echo "proxy_runs.sh: '$n' is not a whole number" >&2; exit 2 ;; esac
done
[ -n "$seeds" ] || { echo "proxy_runs.sh: no seeds" >&2; exit 2; }

cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One OpenMP thread, as torchrun gives each rank of a multi-GPU run: runs side by side on one host were host-bound
# at stage 3 with a thread per core each.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -f "$script" ] || { echo "proxy_runs.sh: no script $script" >&2; exit 2; }
mkdir -p "$out/$label"

if [ ! -f "$data/fineweb_train_000001.bin" ]; then
    if [ "$data" != data/proxy ]; then
        echo "proxy_runs.sh: no shards in $data (only data/proxy is built here, by ./run.sh proxy)" >&2; exit 2
    fi
    echo "building data/proxy from $corpus (log: $out/proxy_build.txt)"
    if ! PYTHON=$PY ./run.sh proxy "$corpus" > "$out/proxy_build.txt" 2>&1; then
        echo "proxy_runs.sh: ./run.sh proxy $corpus failed:" >&2; tail -3 "$out/proxy_build.txt" >&2; exit 2
    fi
fi

status=0
for seed in $seeds; do
    limit=()
    if [ -n "$deadline" ]; then
        left=$(( deadline - $(date +%s) ))
        if [ "$left" -lt "$min_left" ]; then
            echo "$label: seed $seed and later not started, ${left}s left"; status=1; break
        fi
        limit=(timeout "$left")
    fi
    t=$(date +%s)
    "${limit[@]}" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" "$script" \
        --data-path "$data" --num-scheduled-iterations 90 --num-extension-iterations 6 --val-loss-every 30 \
        --val-batch-size 524288 --val-tokens 1572864 --seed "$seed" --run-id "${label}_seed$seed" \
        --log-dir "$out/$label" "$@" > "$out/$label/console_seed$seed.txt" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    last=$(grep -h 'val_loss' "$out/$label/${label}_seed$seed.txt" 2>/dev/null | tail -1)
    echo "$label seed $seed: exit $rc after $(( $(date +%s) - t ))s; ${last:-no validation line}"
done
exit $status
