#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ and runs each for a bounded time.
#
#   scripts/fuzz.sh [SECONDS] [--only TARGET] [--regen] [--build-only]
#
# SECONDS (default 60) is the -max_total_time of each target. The library sources
# (src/**/*.c except src/cuda and src/transport/ucx) and the test kit are compiled
# directly with clang -fsanitize=fuzzer,address,undefined (not through CMake) into
# $FUZZ_OUT (default build-fuzz/). Each target starts from its committed seed corpus
# fuzz/corpus/<target>/ (copied, never written) plus what earlier runs found in
# $FUZZ_OUT/corpus/<target>/; crashes, leaks, timeouts and sanitizer reports land in
# $FUZZ_OUT/artifacts/<target>/ and make the script exit non-zero.
#
# --regen rewrites fuzz/corpus/ with fuzz/gen_corpus.c (valid seeds built with the
# library's own encoders). Env: FUZZ_CC (default clang-14 or clang), FUZZ_JOBS
# (parallel compiles, default 2), FUZZ_MAX_LEN (default 8192), FUZZ_KEEP_GOING=1 (go on
# after a crash: libFuzzer -fork=1 -ignore_crashes=1, every crash saved as an artifact).
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

SECS=60
ONLY=""
REGEN=0
BUILD_ONLY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --only) ONLY=$2; shift 2 ;;
        --regen) REGEN=1; shift ;;
        --build-only) BUILD_ONLY=1; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *[!0-9]*) echo "fuzz.sh: unknown argument '$1'" >&2; exit 2 ;;
        *) SECS=$1; shift ;;
    esac
done

OUT=${FUZZ_OUT:-$ROOT/build-fuzz}
JOBS=${FUZZ_JOBS:-2}
MAX_LEN=${FUZZ_MAX_LEN:-8192}
if [ -z "${FUZZ_CC:-}" ]; then
    if command -v clang-14 >/dev/null 2>&1; then FUZZ_CC=clang-14; else FUZZ_CC=clang; fi
fi
if ! command -v "$FUZZ_CC" >/dev/null 2>&1; then
    echo "fuzz.sh: $FUZZ_CC not found (Debian: apt-get install clang-14 libclang-rt-14-dev)" >&2
    exit 2
fi

TARGETS=$(cd fuzz && ls fuzz_*.c | sed 's/\.c$//')
if [ -n "$ONLY" ]; then
    TARGETS=$ONLY
    [ -f "fuzz/$ONLY.c" ] || { echo "fuzz.sh: no target fuzz/$ONLY.c" >&2; exit 2; }
fi

COMMON="-g -O1 -fno-omit-frame-pointer -std=c11 -D_GNU_SOURCE -Iinclude -Isrc -Itools/testkit -pthread"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all"
mkdir -p "$OUT/obj" "$OUT/corpus" "$OUT/artifacts" "$OUT/logs"

# ---------------------------------------------------------------- build
LIBSRC=$(find src -name '*.c' ! -path 'src/cuda/*' ! -path 'src/transport/ucx/*' | sort)
TKSRC=$(ls tools/testkit/*.c | sort)
echo "fuzz.sh: compiling $(echo $LIBSRC $TKSRC | wc -w) library and test kit sources with $FUZZ_CC"
export FUZZ_CC COMMON SAN OUT
# Library code is compiled with warnings shown but not fatal (a clang-only warning in
# someone else's file should not stop fuzzing); the fuzz sources use -Werror.
if ! printf '%s\n' $LIBSRC $TKSRC | xargs -P "$JOBS" -I{} sh -c '
    o="$OUT/obj/$(echo {} | tr / _).o"
    if [ ! -f "$o" ] || [ {} -nt "$o" ] || [ -n "$(find src include tools/testkit -name "*.h" -newer "$o" | head -1)" ]; then
        $FUZZ_CC $COMMON $SAN -fsanitize=fuzzer-no-link -Wall -Wextra -c {} -o "$o" || exit 255
    fi'; then
    echo "fuzz.sh: library build failed" >&2
    exit 2
fi
OBJS=$(for f in $LIBSRC $TKSRC; do echo "$OUT/obj/$(echo $f | tr / _).o"; done)
for t in $TARGETS; do
    if ! $FUZZ_CC $COMMON $SAN -fsanitize=fuzzer -Wall -Wextra -Werror fuzz/$t.c $OBJS -ldl -lm \
        -o "$OUT/$t"; then
        echo "fuzz.sh: building $t failed" >&2
        exit 2
    fi
done

if [ $REGEN = 1 ]; then
    $FUZZ_CC $COMMON $SAN -Wall -Wextra -Werror fuzz/gen_corpus.c \
        $(for f in $LIBSRC $TKSRC; do echo $f; done) -ldl -lm -o "$OUT/gen_corpus" || exit 2
    rm -rf fuzz/corpus.new
    "$OUT/gen_corpus" fuzz/corpus.new || exit 2
    rm -rf fuzz/corpus
    mv fuzz/corpus.new fuzz/corpus
    echo "fuzz.sh: seed corpora rewritten: $(find fuzz/corpus -type f | wc -l) files"
fi
[ $BUILD_ONLY = 1 ] && exit 0

# ---------------------------------------------------------------- run
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
FAILED=0
SUMMARY=""
for t in $TARGETS; do
    mkdir -p "$OUT/corpus/$t" "$OUT/artifacts/$t"
    # The committed seeds are copied into the working corpus: libFuzzer only ever writes
    # to $OUT (fork mode merges into the directories it is given).
    cp -n fuzz/corpus/$t/* "$OUT/corpus/$t/" 2>/dev/null
    LOG="$OUT/logs/$t.log"
    MARK="$OUT/logs/$t.start"
    touch "$MARK"
    echo "fuzz.sh: running $t for ${SECS}s (log $LOG)"
    KEEP=""
    [ "${FUZZ_KEEP_GOING:-0}" = 1 ] && KEEP="-fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1"
    # shellcheck disable=SC2086
    "$OUT/$t" -max_total_time="$SECS" -max_len="$MAX_LEN" -timeout=20 -rss_limit_mb=2560 \
        -print_final_stats=1 -artifact_prefix="$OUT/artifacts/$t/" $KEEP \
        "$OUT/corpus/$t" >"$LOG" 2>&1
    rc=$?
    execs=$(grep -a 'stat::number_of_executed_units' "$LOG" | tail -1 | awk '{print $2}')
    # fork mode prints per-job totals: "#N: cov: ... exec/s: ... " lines; take the last count
    [ -z "$execs" ] && execs=$(grep -aoE '^#[0-9]+' "$LOG" | tail -1 | tr -d '#')
    cov=$(grep -aoE 'cov: [0-9]+' "$LOG" | tail -1 | awk '{print $2}')
    report=$(grep -aE 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error|FUZZ ORACLE|SUMMARY: ' "$LOG" | head -3)
    artifact=$(grep -aoE "Test unit written to [^ ]+" "$LOG" | tail -1 | sed 's/Test unit written to //')
    ncrash=$(find "$OUT/artifacts/$t" -type f -newer "$MARK" | wc -l)
    [ -z "$artifact" ] && artifact=$(find "$OUT/artifacts/$t" -type f -newer "$MARK" | head -1)
    if [ $rc -ne 0 ] || [ -n "$report" ] || [ "$ncrash" -gt 0 ]; then
        FAILED=1
        result="FAILED (exit $rc, $ncrash crash/timeout inputs)${artifact:+, e.g. $artifact}"
    else
        result="ok"
    fi
    line=$(printf '%-12s executions %-10s coverage %-6s result %s' "$t" "${execs:-?}" "${cov:-?}" "$result")
    SUMMARY="$SUMMARY$line"$'\n'
    echo "  $line"
    [ -n "$report" ] && echo "$report" | sed 's/^/    /'
done
echo
echo "fuzz.sh summary (${SECS}s per target):"
printf '%s' "$SUMMARY"
exit $FAILED
