#!/usr/bin/env bash
# Device call 1 (nvidia-h200, fresh; carry .carry/fa4a .carry/corpus_a): keep FA4's first part and the corpus's
# first part in /tmp while the machine is warm.
bash bench/fa4_env.sh stash
mkdir -p /tmp/corpus && cp .carry/corpus_a/train.part1 /tmp/corpus/ && echo "corpus: part 1 stashed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__)"
