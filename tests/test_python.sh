#!/usr/bin/env bash
# Python bindings: the unittest suite in python/tests (struct layouts against the C
# headers, topology, errors, a local plan, and end-to-end transfers between a prefill
# process and a decode process checked byte for byte against a Python reference).
#
# Env: KVW_BUILD_DIR = CMake build directory holding libkvwire.so (set by CTest);
# KVW_SOURCE_DIR = repository root (default: this script's parent); KVW_PYTHON =
# interpreter (default: python3 on PATH, else /usr/bin/python3); KVW_SANITIZED=1 =
# the library is built with AddressSanitizer/ThreadSanitizer (skip: see below).
# Exit: 0 pass, 1 fail, 77 skipped.
set -u

SRC="${KVW_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
BUILD="${KVW_BUILD_DIR:-$SRC/build}"
LIB="$BUILD/libkvwire.so"
source "$(dirname "${BASH_SOURCE[0]}")/timeout.sh"

# An ASan/TSan-instrumented libkvwire.so cannot be loaded into an uninstrumented
# python3 unless the sanitizer runtime is preloaded; the release build's run covers
# the bindings.
skip_sanitized() {
    echo "test_python: SKIP: $1; loading a sanitizer-instrumented libkvwire.so into python3" \
         "needs the sanitizer runtime preloaded (the release build's run covers the bindings)"
    exit 77
}
if [[ "${KVW_SANITIZED:-0}" == 1 ]]; then
    skip_sanitized "KVW_SANITIZED=1"
fi
if [[ -f "$BUILD/CMakeCache.txt" ]] &&
   grep -Eq '^KVW_SANITIZE:[A-Z]+=.*(address|thread)' "$BUILD/CMakeCache.txt"; then
    skip_sanitized "$BUILD is a sanitizer build ($(grep -E '^KVW_SANITIZE:' "$BUILD/CMakeCache.txt"))"
fi
if [[ -f "$LIB" ]] && command -v readelf >/dev/null 2>&1 &&
   readelf -d "$LIB" 2>/dev/null | grep -Eq 'NEEDED.*lib(asan|tsan)'; then
    skip_sanitized "$LIB links a sanitizer runtime"
fi

PY="${KVW_PYTHON:-}"
if [[ -z "$PY" ]]; then
    PY="$(command -v python3 || true)"
    [[ -z "$PY" && -x /usr/bin/python3 ]] && PY=/usr/bin/python3
fi
if [[ -z "$PY" ]] || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 8))' 2>/dev/null; then
    echo "test_python: SKIP: no python3 (3.8 or newer) found"
    exit 77
fi
if [[ ! -f "$LIB" ]]; then
    echo "test_python: $LIB not found (set KVW_BUILD_DIR to the CMake build directory)" >&2
    exit 1
fi

export KVWIRE_LIB="$LIB"
export KVW_INCLUDE_DIR="$SRC/include"
export PYTHONPATH="$SRC/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

echo "test_python: $("$PY" --version 2>&1) ($PY), KVWIRE_LIB=$LIB"
# The suite takes a few seconds; a stuck transfer is killed rather than hanging CTest.
timeout -k 5 "$(kvt_tmo 120)" "$PY" -m unittest discover -s "$SRC/python/tests" -t "$SRC/python/tests" -v
rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "test_python: FAILED: the suite did not finish within 120 s" >&2
    exit 1
fi
if [[ $rc -ne 0 ]]; then
    echo "test_python: FAILED" >&2
    exit 1
fi
echo "test_python: passed"
exit 0
