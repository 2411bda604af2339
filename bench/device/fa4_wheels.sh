#!/usr/bin/env bash
# Here (with pip and the package index): fetch FlashAttention-4 and its CuTe DSL for the device machines
# (Python 3.12, x86-64, CUDA 13) and split them into two carry folders, because together they are ~73 MB and a
# device call carries at most 64 MiB, the working tree included:
#   .carry/fa4a/  the first 42 MB of the CUDA-13 CuTe DSL libraries (xz tar)   -> carried by call 1 (stash)
#   .carry/fa4b/  the rest of that tar + the small wheels                     -> carried by call 2 (install)
# On the device: call 1 runs `bash bench/device/fa4_env.sh stash`, call 2 (within the 30 s the machine stays warm)
# runs `source bench/device/fa4_env.sh install`.   Usage: bash bench/device/fa4_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
W=$(mktemp -d)
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d $W"
for plat in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64; do P="$P --platform $plat"; done
python3 -m pip download $P -q flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.11 \
    torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 einops==0.8.1
rm -rf .carry/fa4a .carry/fa4b && mkdir -p .carry/fa4a .carry/fa4b "$W/cu13"
(cd "$W/cu13" && unzip -q "$W"/nvidia_cutlass_dsl_libs_cu13-*.whl)
tar -C "$W/cu13" -cf - . | xz -9e -T0 > "$W/cu13.tar.xz"
head -c 42000000 "$W/cu13.tar.xz" > .carry/fa4a/cu13.tar.xz.part1
tail -c +42000001 "$W/cu13.tar.xz" > .carry/fa4b/cu13.tar.xz.part2
sha256sum "$W/cu13.tar.xz" | cut -d' ' -f1 > .carry/fa4b/cu13.tar.xz.sha256
ls "$W"/*.whl | grep -v libs_cu13 | xargs -I{} cp {} .carry/fa4b/
rm -rf "$W"
du -sh .carry/fa4a .carry/fa4b
