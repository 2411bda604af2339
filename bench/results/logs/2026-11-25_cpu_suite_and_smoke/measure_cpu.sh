#!/usr/bin/env bash
# CPU measurements for bench/results/2026-11-25_cpu_suite_and_smoke.json: README's smoke command and ./run.sh test,
# natively (AVX-512 BF16) and with only the AVX2 code paths; each with its own Inductor cache (Inductor's CPU cache
# does not key on ATEN_CPU_CAPABILITY: sharing one poisons the other).
cd /work/main
out=/tmp/cpu_measure; rm -rf $out; mkdir -p $out
lscpu > $out/lscpu.txt
for mode in avx2 native; do
  if [ $mode = avx2 ]; then export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2; else unset ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA; fi
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_$mode
  rm -rf /tmp/inductor_$mode
  python3 /tmp/bf16lin.py > $out/${mode}_bf16_linear.txt 2>&1
  s=$(date +%s.%N)
  torchrun --standalone --nproc_per_node=2 train_gpt.py --smoke --data-path data/proxy --log-dir $out/smoke_$mode > $out/${mode}_smoke_console.txt 2>&1
  echo "rc=$? wall=$(echo "$(date +%s.%N) - $s" | bc)" > $out/${mode}_smoke_time.txt
  s=$(date +%s.%N)
  ./run.sh test --durations=25 -p no:cacheprovider > $out/${mode}_suite.txt 2>&1
  echo "rc=$? wall=$(echo "$(date +%s.%N) - $s" | bc)" > $out/${mode}_suite_time.txt
done
echo done > $out/DONE
