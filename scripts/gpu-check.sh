#!/usr/bin/env bash
# Verifies the CUDA executor: first its kernels' address arithmetic on the CPU
# (test_cuda_emu), then prefill and decode as two processes on two GPUs through CUDA IPC
# (kvw_gpu_check, see tests/gpu/gpu_check.c), ending with a table of cases, bytes and
# results; then, with a torch that sees a GPU, the PyTorch test, a real model decoding
# from KV moved through kvwire.sglang (python/tests/gpu_sglang_model.py) and SGLang's
# scheduler code on CUDA KV pools over cuda_ipc and tcp (python/tests/sglang_real, from
# SGLANG_SRC or ../shared/sglang-8905cbd/python). Without nvcc or without a GPU it prints
# a "skipped: ..." line and exits 0; each later step missing what it needs prints its own.
#
#   scripts/gpu-check.sh [--case SUBSTRING]      BUILD=dir (default build), JOBS=n,
#                                                SGLANG_SRC=<sglang checkout>/python
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
JOBS=${JOBS:-$(nproc)}

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "gpu-check: skipped: no GPU toolchain (nvcc not found), the CUDA module is not built"
    exit 0
fi
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVW_DEVELOPER=ON >/dev/null
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
[ "$rc" -ne 0 ] && exit "$rc"

# The whole protocol on GPUs: prefill and decode processes (GPU 0 and GPU 1), KV caches
# in GPU memory, moved by the cuda_ipc transport (fused kernel into IPC-mapped decode
# buffers); every destination byte and guard byte verified on the host.
if ! cmake --build "$BUILD" -j "$JOBS" --target kvwire_cli >>"$BUILD/gpu-build.log" 2>&1; then
    tail -n 40 "$BUILD/gpu-build.log"
    echo "gpu-check: FAILED to build the kvwire CLI"
    exit 1
fi
demo_fail=0
table=""
run_demo() {
    local name=$1
    shift
    local out
    if out=$(timeout 300 "$BUILD/kvwire" demo --gpu --layers 6 --requests 16 --max-tokens 1024 "$@" 2>&1); then
        table+=$(printf '%-34s PASS  %s' "$name" "$(tail -n 1 <<<"$out" | cut -c24-)")$'\n'
    else
        table+=$(printf '%-34s %s' "$name" "FAIL")$'\n'
        echo "$out" | tail -n 20
        demo_fail=1
    fi
}
run_demo "protocol TP1->TP4 (8 heads)" --prefill-tp 1 --decode-tp 4
run_demo "protocol TP4->TP1" --prefill-tp 4 --decode-tp 1
run_demo "protocol TP2->TP4 HND" --prefill-tp 2 --decode-tp 4 --decode-layout hnd
run_demo "protocol TP3->TP2 (6 heads)" --prefill-tp 3 --decode-tp 2 --kv-heads 6
run_demo "protocol MLA TP4->TP2" --model deepseek-v3 --prefill-tp 4 --decode-tp 2
run_demo "protocol GDN hybrid TP1->TP4" --model qwen3-next --layers 8
run_demo "protocol pages 16->64, PP2->PP1" --prefill-pp 2 --page-size 16 --decode-page-size 64
run_demo "protocol 36 layers, 2048 tokens 1->4" --layers 36 --max-tokens 2048 --requests 11 --concurrency 2
# GPU caches over host transports: gathered on GPU 0 into pinned host memory, across the
# transport into the decode's host staging, scattered on GPU 1 (small staging: many
# windows per room). GPU on both sides, on one side only.
export KVW_STAGING_MB=8
run_demo "tcp GPU->GPU TP1->TP4" --transport tcp --prefill-tp 1 --decode-tp 4
run_demo "tcp GPU->GPU TP2->TP1 HND" --transport tcp --prefill-tp 2 --decode-tp 1 --decode-layout hnd
run_demo "shm GPU->GPU MLA TP4->TP2" --transport shm --model deepseek-v3 --prefill-tp 4 --decode-tp 2
run_demo "tcp GPU->host TP1->TP2" --gpu=prefill --transport tcp --prefill-tp 1 --decode-tp 2
run_demo "shm host->GPU TP2->TP4" --gpu=decode --transport shm --prefill-tp 2 --decode-tp 4
if [ -f "$BUILD/libkvwire-ucx.so" ]; then
    run_demo "ucx GPU->GPU TP1->TP2" --transport ucx --prefill-tp 1 --decode-tp 2
fi
# KV verification on GPU buffers (every room): the digest kernel on each GPU side, the
# CPU's where a side is host memory, across reshards.
run_demo "verified cuda_ipc TP3->TP2" --verify every --prefill-tp 3 --decode-tp 2 --kv-heads 6
run_demo "verified cuda_ipc MLA TP4->TP2" --verify every --model deepseek-v3 --prefill-tp 4 --decode-tp 2
run_demo "verified cuda_ipc GDN TP1->TP4" --verify every --model qwen3-next --layers 8
run_demo "verified cuda_ipc pages 16->64 PP2" --verify every --prefill-pp 2 --page-size 16 --decode-page-size 64
run_demo "verified tcp GPU->GPU TP1->TP4" --verify every --transport tcp --prefill-tp 1 --decode-tp 4
run_demo "verified tcp GPU->host TP4->TP1" --verify every --gpu=prefill --transport tcp --prefill-tp 4 --decode-tp 1
# The GPU's digest against the CPU's on rows of XXH3's long path (256-byte llama heads,
# 1152-byte MLA latents with a block scramble, qwen3-next's 512-byte heads and state).
run_demo "verified tcp GPU->host llama TP4->TP1" --verify every --gpu=prefill --transport tcp --model llama-3.1-70b --layers 8 --prefill-tp 4 --decode-tp 1
run_demo "verified tcp GPU->host MLA TP2->TP1" --verify every --gpu=prefill --transport tcp --model deepseek-v3 --layers 8 --prefill-tp 2 --decode-tp 1
run_demo "verified shm host->GPU GDN TP1->TP2" --verify every --gpu=decode --transport shm --model qwen3-next --layers 8 --prefill-tp 1 --decode-tp 2
run_demo "verified shm host->GPU TP2->TP4" --verify every --gpu=decode --transport shm --prefill-tp 2 --decode-tp 4
unset KVW_STAGING_MB
# test_verify's faults (a corrupted byte, swapped heads, a stale page, reordered pages, a
# dropped chunk) made in GPU buffers: each must fail its room naming where, and the
# untouched room beside it must succeed. (In one process, so not over cuda_ipc: CUDA maps
# no IPC handle into the process that exported it; the verified demos above cover it.)
# One in-process test program on the real module: a table row, its output's tail on failure.
run_test() {
    local name=$1
    shift
    local out
    if out=$(timeout 600 env KVW_CUDA_MODULE="$BUILD/libkvwire_cuda.so" "$@" 2>&1); then
        table+=$(printf '%-34s PASS  %s' "$name" "$(tail -n 1 <<<"$out")")$'\n'
    else
        table+=$(printf '%-34s %s' "$name" "FAIL")$'\n'
        echo "$out" | tail -n 20
        demo_fail=1
    fi
}
# test_verify's faults, then the staged test (every kind combination, tcp/shm/ucx).
if cmake --build "$BUILD" -j "$JOBS" --target test_verify test_gpu_staged test_cuda_digest_async \
    >>"$BUILD/gpu-build.log" 2>&1; then
    for v in both:tcp prefill:tcp decode:shm; do
        run_test "test_verify GPU ${v/:/ }" KVW_VERIFY_GPU="${v%%:*}" KVW_VERIFY_TL="${v##*:}" \
            "$BUILD/test_verify"
    done
    run_test "test_gpu_staged (real GPU)" "$BUILD/test_gpu_staged"
    run_test "test_cuda_digest_async" "$BUILD/test_cuda_digest_async"
else
    table+=$(printf '%-34s %s' "test_verify, test_gpu_staged" "FAIL (build)")$'\n'
    tail -n 20 "$BUILD/gpu-build.log"
    demo_fail=1
fi
echo
echo "gpu-check: the protocol on GPUs (separate processes, GPU 0 -> GPU 1; cuda_ipc unless named)"
printf '%-34s %-5s %-9s %-9s %-12s %-9s %-8s %s\n' case result requests rooms bytes "time s" GB/s verified
printf '%s' "$table"
lib="$(cd "$BUILD" && pwd)/libkvwire.so"
if command -v python3 >/dev/null && python3 -c 'import torch' 2>/dev/null; then
    echo "gpu-check: PyTorch test (CUDA tensors, TP1->TP2 over cuda_ipc)"
    KVWIRE_LIB="$lib" PYTHONPATH=python:python/tests \
        python3 -m unittest -v test_torch_gpu || demo_fail=1
fi

# kvwire.sglang on the GPU: a real model (transformers' GPT-OSS, shrunk, random weights)
# decoding bit-identically from KV moved through it, then SGLang's own scheduler code
# (python/tests/sglang_real) over CUDA KV pools, cuda_ipc and tcp.
if ! command -v python3 >/dev/null ||
    ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: skipped: kvwire.sglang on the GPU (no python3 with a torch that sees a GPU)"
else
    echo "gpu-check: a real model decoding from KV moved through kvwire.sglang (cuda_ipc, tcp)"
    set +e
    KVWIRE_LIB="$lib" PYTHONPATH=python timeout 600 python3 python/tests/gpu_sglang_model.py
    rc=$?
    set -e
    # 77: no transformers (it has printed "skipped: ...").
    [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && demo_fail=1
    sglang_src=${SGLANG_SRC:-../shared/sglang-8905cbd/python}
    if [ ! -f "$sglang_src/sglang/srt/disaggregation/prefill.py" ]; then
        echo "gpu-check: skipped: SGLang's scheduler code on CUDA KV pools (no SGLang source at" \
             "$sglang_src; set SGLANG_SRC to an SGLang checkout's python/ directory)"
    else
        for t in cuda_ipc tcp cuda_ipc:every; do
            vf=""; [[ $t == *:* ]] && vf=${t##*:} && t=${t%%:*}
            echo "gpu-check: SGLang's scheduler code on CUDA KV pools, KVWIRE_TRANSPORT=$t" \
                 "${vf:+KVWIRE_SGLANG_VERIFY=$vf }($sglang_src)"
            KVWIRE_LIB="$lib" KVW_SGLANG_DEVICE=cuda KVWIRE_TRANSPORT=$t KVWIRE_SGLANG_VERIFY=$vf \
                timeout 600 python3 python/tests/sglang_real/run.py "$sglang_src" || demo_fail=1
        done
    fi
fi
exit "$demo_fail"
