#!/usr/bin/env bash
# speedrun launcher. Usage:
#   ./run.sh                    install requirements, fetch 9 FineWeb train shards + val, train on all visible GPUs
#   ./run.sh test               run the CPU test suite (no GPU, no network needed)
#   ./run.sh proxy [CORPUS_DIR] build proxy shards in data/proxy from the shared stand-in corpus (offline)
#   ./run.sh record NAME N [ARGS...]  run the trainer N times and collect the logs into records/<date>_NAME
# Extra arguments after the default form go to train_gpt.py, e.g. ./run.sh --data-path data/proxy
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

num_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; else echo 0; fi
}

launch() {  # launch [train_gpt.py args...]
    local n; n=$(num_gpus)
    if [ "$n" -lt 1 ]; then
        echo "run.sh: no NVIDIA GPU visible. For a CPU smoke run: torchrun --standalone --nproc_per_node=2 train_gpt.py --smoke --data-path data/proxy" >&2
        exit 1
    fi
    # 1, 2, 4 or 8 GPUs use gradient accumulation to keep the global batch; more than 8 must be a multiple of 8.
    if [ "$n" -gt 8 ] || [ $((8 % n)) -ne 0 ]; then
        for k in 8 4 2 1; do if [ "$n" -ge $k ]; then n=$k; break; fi; done
        echo "run.sh: using $n of the visible GPUs (the trainer supports 1, 2, 4 or 8 per node)" >&2
    fi
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
        NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
    "$PY" -m torch.distributed.run --standalone --nproc_per_node="$n" train_gpt.py "$@"
}

case "${1:-}" in
    test)
        shift
        exec "$PY" -m pytest -q tests "$@"
        ;;
    proxy)
        corpus=${2:-../shared/corpus}
        exec "$PY" data/fineweb.py --input "$corpus/train.jsonl.xz" --val-input "$corpus/val.jsonl.xz" \
            --out-dir data/proxy
        ;;
    record)
        shift
        exec "$PY" records/compare.py run "$@"
        ;;
    *)
        # Installs into the current Python environment (activate a venv first if you want isolation).
        echo "run.sh: installing requirements into $("$PY" -c 'import sys; print(sys.prefix)')"
        "$PY" -m pip install -q -r requirements.txt
        "$PY" data/cached_fineweb10B.py 9
        launch "$@"
        ;;
esac
