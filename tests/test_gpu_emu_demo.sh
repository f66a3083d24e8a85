#!/usr/bin/env bash
# GPU KV caches over host transports, between processes, without a GPU: `kvwire demo
# --gpu` with the CPU stand-in of the CUDA module (libkvwire_cuda_emu.so, see
# tests/gpu/cuda_emu_module.c), so the prefill and decode processes take the GPU paths
# (windows gathered and scattered by the kernels' own address arithmetic, through host
# staging) and the decode verifies every byte and guard byte. GPU on both sides, on the
# prefill only and on the decode only; tcp, shm, cuda_ipc, and ucx where it is built.
# scripts/gpu-check.sh runs the same configurations on real GPUs.
set -u
CLI="${KVW_CLI:-${KVW_BUILD_DIR:-build}/kvwire}"
EMU="${KVW_BUILD_DIR:-build}/libkvwire_cuda_emu.so"
source "$(dirname "${BASH_SOURCE[0]}")/timeout.sh"
if [[ ! -x "$CLI" || ! -f "$EMU" ]]; then
    echo "test_gpu_emu_demo: needs $CLI and $EMU" >&2
    exit 1
fi
export KVW_CUDA_MODULE="$EMU" KVW_STAGING_MB=2
fail=0
run() {
    local name=$1
    shift
    local out
    if out=$(timeout "$(kvt_tmo 240)" "$CLI" demo --layers 4 --requests 6 --max-tokens 700 "$@" 2>&1); then
        echo "PASS  $name: $(tail -n 1 <<<"$out")"
    else
        echo "FAIL  $name"
        tail -n 20 <<<"$out"
        fail=1
    fi
}
run "tcp GPU->GPU TP1->TP2" --gpu --transport tcp --prefill-tp 1 --decode-tp 2
run "tcp GPU->host TP2->TP1" --gpu=prefill --transport tcp --prefill-tp 2 --decode-tp 1
run "shm host->GPU TP1->TP2 HND" --gpu=decode --transport shm --decode-layout hnd --decode-tp 2
run "shm GPU->GPU pages 16->64" --gpu --transport shm --page-size 16 --decode-page-size 64
# cuda_ipc: the stand-in's IPC (memfd mappings through /proc/PID/fd) lets the prefill
# map the decode's "device" buffers and run the mapped path, small rooms launched
# together (KVW_GPU_BATCH) or one by one.
KVW_CUDA_EMU_IPC=1 run "cuda_ipc GPU->GPU TP1->TP4, small rooms launched together" --gpu \
    --transport cuda_ipc --prefill-tp 1 --decode-tp 4 --requests 24
KVW_CUDA_EMU_IPC=1 run "cuda_ipc GPU->GPU TP4->TP1 pages 16->64" --gpu --transport cuda_ipc \
    --prefill-tp 4 --decode-tp 1 --page-size 16 --decode-page-size 64 --requests 12
KVW_CUDA_EMU_IPC=1 KVW_GPU_BATCH=1 run "cuda_ipc GPU->GPU TP2->TP2, one launch per room" \
    --gpu --transport cuda_ipc --prefill-tp 2 --decode-tp 2 --requests 12
if [[ -f "${KVW_BUILD_DIR:-build}/libkvwire-ucx.so" ]]; then
    run "ucx GPU->GPU TP2->TP2" --gpu --transport ucx --prefill-tp 2 --decode-tp 2
fi
# `kvwire bench --gpu` as on the GPU machine, on the stand-in: two topologies, every byte
# of the first repetition checked, and the per-thread CPU lines naming the library's
# threads in both processes.
BENCH="${KVW_BUILD_DIR:-build}/kvwire-bench"
if [[ -x "$BENCH" ]]; then
    json=$(mktemp /tmp/kvw-emu-bench.XXXXXX.json)
    if out=$(KVW_CUDA_EMU_IPC=1 timeout "$(kvt_tmo 240)" "$BENCH" --gpu --layers 2 --reps 3 \
            --topo 1:4:16:64 --topo 2:1:8:128 --json "$json" 2>&1) &&
        [[ $(grep -c "yes: every byte and guard" <<<"$out") == 2 ]] &&
        [[ $(grep -c -E "^  prefill: .*kvw-worker .*kvw-ctrl|^  prefill: .*kvw-ctrl .*kvw-worker" \
            <<<"$out") == 2 ]] &&
        [[ $(grep -c -E "^  decode: .*kvw-rx-tcp" <<<"$out") == 2 ]] &&
        python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['topologies']; \
assert len(t)==2 and all(x['ok'] and x['verified'] and x['cpu_ms_per_rep']['prefill']['kvw-worker']['ms']>0 for x in t)" "$json"; then
        echo "PASS  kvwire bench --gpu on the stand-in (cuda_ipc, 2 topologies verified, thread CPU named)"
    else
        echo "FAIL  kvwire bench --gpu on the stand-in"
        tail -n 30 <<<"$out"
        fail=1
    fi
    rm -f "$json"
fi
exit $fail
