#!/usr/bin/env bash
# Device call 1 (a fresh nvidia-h100-x2; carry .carry/fa4a): keep FA4's first part in /tmp while the machine is warm;
# the GPU check of read_after_gather (its wait for a late all-gather's event, eagerly and in a CUDA graph).
bash bench/fa4_env.sh stash
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu tests/gpu -k read_after_gather -p no:cacheprovider 2>&1 | tail -3
