#!/usr/bin/env bash
# One device session: build, verify every byte on the GPU (scripts/gpu-check.sh), then
# measure: the GPU protocol over cuda_ipc and tcp (kvwire bench --gpu) and layer-wise
# streaming on CUDA events (gpu_stream), tables last.
#   OUT=dir [STAGES="check bench stream"] [REPS=3] scripts/device-run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvw-out}
B=${BUILD:-/tmp/b}
STAGES=${STAGES:-check bench stream}
REPS=${REPS:-3}
mkdir -p "$OUT"
nvidia-smi -L
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVW_DEVELOPER=ON >"$OUT/cmake.log" 2>&1
if ! cmake --build "$B" -j"$(nproc)" >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; exit 1
fi
if [[ " $STAGES " == *" check "* ]]; then
    BUILD="$B" JOBS="$(nproc)" scripts/gpu-check.sh >"$OUT/gpu-check.log" 2>&1
    echo "gpu-check exit $?"
    tail -40 "$OUT/gpu-check.log"
fi
if [[ " $STAGES " == *" bench "* ]]; then
    "$B/kvwire-bench" --gpu --transport tcp --reps "$REPS" --json "$OUT/gpu-tcp.json" >"$OUT/bench-tcp.log" 2>&1
    echo "bench tcp exit $?"
    "$B/kvwire-bench" --gpu --reps "$REPS" --json "$OUT/gpu-ipc.json" >"$OUT/bench-ipc.log" 2>&1
    echo "bench ipc exit $?"
    tail -12 "$OUT/bench-ipc.log"
    tail -12 "$OUT/bench-tcp.log"
fi
if [[ " $STAGES " == *" stream "* ]]; then
    for run in ${STREAM_RUNS:-cuda_ipc:spin tcp:spin tcp:memset}; do
        tl=${run%%:*} sim=${run##*:}
        "$B/gpu_stream" --transport "$tl" --reps 5 --sim "$sim" --json "$OUT/gpu-stream-$tl-$sim.json" >"$OUT/stream-$tl-$sim.log" 2>&1
        echo "gpu_stream $tl $sim exit $?"
        tail -9 "$OUT/stream-$tl-$sim.log"
    done
fi
