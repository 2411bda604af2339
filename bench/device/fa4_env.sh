# FlashAttention-4 on a device machine from the two carry folders bench/device/fa4_wheels.sh makes.
#   bash bench/device/fa4_env.sh stash     (call 1, carrying .carry/fa4a): keep part 1 in /tmp while the machine is warm
#   source bench/device/fa4_env.sh install (call 2, carrying .carry/fa4b): assemble, install into
#           /tmp/fa4_env/site-packages, and export PYTHONPATH (the CuTe DSL's .pth file is not read from PYTHONPATH,
#           so its dsl_packages folder is added by hand) and the kernel cache variables
# A later call on the same warm machine only needs `source bench/device/fa4_env.sh install` again
# (it finds the install).
# The folder must be named site-packages: quack fingerprints its fused-GEMM epilogues by source and treats
# functions from files under */site-packages/* as installed libraries (fingerprinted by name); from any other
# folder it walks into the CuTe DSL's internals and fails on an unhashable ContextVar at import.
fa4_site=/tmp/fa4_env/site-packages
case "${1:-install}" in
stash)
    mkdir -p /tmp/fa4_stash && cp .carry/fa4a/cu13.tar.xz.part1 /tmp/fa4_stash/ && echo "fa4: part 1 stashed" ;;
install)
    if [ ! -d "$fa4_site/flash_attn" ]; then
        if [ ! -f /tmp/fa4_stash/cu13.tar.xz.part1 ] || [ ! -f .carry/fa4b/cu13.tar.xz.part2 ]; then
            echo "fa4: missing a part (stash in the previous call, carry .carry/fa4b in this one)"; return 1 2>/dev/null || exit 1
        fi
        sum=$(cat /tmp/fa4_stash/cu13.tar.xz.part1 .carry/fa4b/cu13.tar.xz.part2 | sha256sum | cut -d' ' -f1)
        if [ "$sum" != "$(cat .carry/fa4b/cu13.tar.xz.sha256)" ]; then
            echo "fa4: reassembled tar has the wrong checksum"; return 1 2>/dev/null || exit 1
        fi
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$fa4_site" .carry/fa4b/*.whl
        cat /tmp/fa4_stash/cu13.tar.xz.part1 .carry/fa4b/cu13.tar.xz.part2 | xz -d | tar -C "$fa4_site" -xf -
        # Bytecode, as a plain pip install writes it (and as ./run.sh setup-gpu makes sure of): without it every
        # process compiles the CuTe DSL's and the libraries' sources again at import.
        python3 -m compileall -q -j 0 "$fa4_site" > /dev/null 2>&1
    fi
    export PYTHONPATH="$fa4_site:$fa4_site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernel_cache
    python3 -c "import flash_attn.cute.interface as f, cutlass; print('fa4: flash_attn.cute from', f.__file__, 'cutlass', cutlass.__version__)" ;;
esac
