#!/usr/bin/env bash
# One device session: build, verify every byte on the GPU (scripts/gpu-check.sh), then
# measure the GPU protocol over cuda_ipc and over tcp (kvwire bench --gpu), tables last.
#   OUT=dir scripts/device-run.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvw-out}
B=${BUILD:-/tmp/b}
mkdir -p "$OUT"
nvidia-smi -L
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVW_DEVELOPER=ON >"$OUT/cmake.log" 2>&1
if ! cmake --build "$B" -j"$(nproc)" >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; exit 1
fi
BUILD="$B" JOBS="$(nproc)" scripts/gpu-check.sh >"$OUT/gpu-check.log" 2>&1
echo "gpu-check exit $?"
tail -35 "$OUT/gpu-check.log"
REPS=${REPS:-3}
"$B/kvwire" bench --gpu --transport tcp --reps "$REPS" --json "$OUT/gpu-tcp.json" >"$OUT/bench-tcp.log" 2>&1
echo "bench tcp exit $?"
"$B/kvwire" bench --gpu --reps "$REPS" --json "$OUT/gpu-ipc.json" >"$OUT/bench-ipc.log" 2>&1
echo "bench ipc exit $?"
tail -12 "$OUT/bench-ipc.log"
grep -A12 "where the time goes" "$OUT/bench-tcp.log" | head -12
tail -12 "$OUT/bench-tcp.log"
