#!/usr/bin/env bash
# Device call 1 (nvidia-h100-x1, fresh; carry .carry/fa4a): keep FA4's first part in /tmp while the machine is warm.
bash bench/fa4_env.sh stash
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, torch._inductor.config as c; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'inductor enable_pdl', c.triton.enable_pdl)"
