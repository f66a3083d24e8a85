#!/usr/bin/env bash
# GPU throughput in two parts, each against a copy of the same bytes measured in the same
# run. First the CUDA executor's kernels alone against cudaMemcpyPeer, per-run
# cudaMemcpyAsync, cudaMemcpyBatchAsync and same-GPU device-to-device copies
# (kvw_gpu_bench, see bench/gpu/gpu_bench.cu); then the whole protocol, prefill and
# decode processes over cuda_ipc, timed from post to Success with every byte of one run
# per topology verified (kvwire bench --gpu, see bench/cli/cmd_bench_gpu.c). Without
# nvcc or a GPU it prints "skipped: ..." and exits 0.
#
#   scripts/gpu-bench.sh [--tokens N] [--reps N] [--quick]     BUILD=dir, JOBS=n
#   KVW_GPU_PROTO_ARGS="--reps 9 --topo 1:4:8:8192"   options of kvwire bench --gpu (kvwire-bench --gpu)
#   KVW_GPU_PROTO_JSON=file                            its JSON (default $BUILD/bench-gpu.json)
#
# KVW_BENCH_VARIANTS="name:NVCC FLAGS;name2:FLAGS" also builds the module with each set
# of -D flags (the tunables of src/cuda/copy_core.h) and runs the bench (--quick) on each
# through KVW_CUDA_MODULE, before the full run on the default build.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
JOBS=${JOBS:-$(nproc)}

NVCC=$(command -v nvcc 2>/dev/null || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then
    echo "gpu-bench: skipped: no GPU toolchain (nvcc not found)"
    exit 0
fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVW_DEVELOPER=ON >/dev/null
fi
if ! grep -q "/kvw_gpu_bench.dir" "$BUILD/CMakeFiles/TargetDirectories.txt" 2>/dev/null; then
    echo "gpu-bench: skipped: $BUILD is configured without the CUDA module"
    exit 0
fi
if ! cmake --build "$BUILD" -j "$JOBS" --target kvwire_cuda kvw_gpu_bench kvwire_bench_cli >"$BUILD/gpu-build.log" 2>&1; then
    tail -n 40 "$BUILD/gpu-build.log"
    echo "${0##*/}: FAILED to build (log: $BUILD/gpu-build.log)"
    exit 1
fi

run() {
    set +e
    "$@"
    local rc=$?
    set -e
    [ "$rc" -eq 77 ] && exit 0 # printed "skipped: no GPU (reason)"
    return "$rc"
}

if [ -n "${KVW_BENCH_VARIANTS:-}" ]; then
    IFS=';' read -r -a variants <<<"$KVW_BENCH_VARIANTS"
    for v in "${variants[@]}"; do
        name=${v%%:*}
        flags=${v#*:}
        dir="$BUILD/variants/$name"
        mkdir -p "$dir"
        # shellcheck disable=SC2086
        "$NVCC" -O3 -arch=sm_90 -std=c++17 -shared -cudart shared -Xcompiler -fPIC,-fvisibility=hidden \
            -Iinclude -Isrc $flags src/cuda/module.cu src/cuda/copy.cu src/cuda/digest.cu -o "$dir/libkvwire_cuda.so"
        echo "=== variant $name: $flags"
        KVW_CUDA_MODULE="$dir/libkvwire_cuda.so" run "$BUILD/kvw_gpu_bench" --quick --reps 10
    done
    echo "=== default build"
fi
run "$BUILD/kvw_gpu_bench" "$@"

# The whole protocol; its table comes last.
# shellcheck disable=SC2086
run "$BUILD/kvwire-bench" --gpu --json "${KVW_GPU_PROTO_JSON:-$BUILD/bench-gpu.json}" \
    ${KVW_GPU_PROTO_ARGS:-}
