#!/usr/bin/env bash
# Device call 4 (nvidia-h200-x2, fresh): keep FA4's first part and the corpus's first part.
bash bench/fa4_env.sh stash
mkdir -p /tmp/corpus && cp .carry/corpus_a/train.part1 /tmp/corpus/ && echo "corpus: part 1 stashed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
