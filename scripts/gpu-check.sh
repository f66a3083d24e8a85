#!/usr/bin/env bash
# Verifies the CUDA executor: first its kernels' address arithmetic on the CPU
# (test_cuda_emu), then prefill and decode as two processes on two GPUs through CUDA IPC
# (kvw_gpu_check, see tests/gpu/gpu_check.c), ending with a table of cases, bytes and
# results. Without nvcc or without a GPU it prints a "skipped: ..." line and exits 0.
#
#   scripts/gpu-check.sh [--case SUBSTRING]      BUILD=dir (default build), JOBS=n
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
JOBS=${JOBS:-$(nproc)}

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "gpu-check: skipped: no GPU toolchain (nvcc not found), the CUDA module is not built"
    exit 0
fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
if ! grep -q "/kvw_gpu_check.dir" "$BUILD/CMakeFiles/TargetDirectories.txt" 2>/dev/null; then
    echo "gpu-check: skipped: $BUILD is configured without the CUDA module (KVW_WITH_CUDA=OFF?)"
    exit 0
fi
if ! cmake --build "$BUILD" -j "$JOBS" --target kvwire_cuda test_cuda_emu kvw_gpu_check >"$BUILD/gpu-build.log" 2>&1; then
    tail -n 40 "$BUILD/gpu-build.log"
    echo "${0##*/}: FAILED to build (log: $BUILD/gpu-build.log)"
    exit 1
fi

log="$BUILD/test_cuda_emu.log"
if ! "$BUILD/test_cuda_emu" >"$log" 2>&1; then
    cat "$log"
    echo "gpu-check: FAILED: the CPU emulation of the kernels (log above)"
    exit 1
fi
echo "gpu-check: CPU emulation of the kernels: $(tail -n 1 "$log")"

set +e
"$BUILD/kvw_gpu_check" "$@"
rc=$?
set -e
# 77: no GPU; kvw_gpu_check has printed "skipped: no GPU (reason)".
[ "$rc" -eq 77 ] && exit 0
exit "$rc"
