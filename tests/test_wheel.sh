#!/usr/bin/env bash
# The Python package as a user installs it: a fresh venv (python3 -m venv), then
# `pip install ./python` offline (--no-index --no-build-isolation), which builds the C
# library with CMake (-DKVW_LIBRARY_ONLY=ON: the library and its run-time modules only)
# and puts libkvwire.so and its modules inside the package. Then, from a directory
# outside the source tree, with no KVWIRE_LIB and no PYTHONPATH:
#  * the package, the library and its modules are the installed ones (and the modules
#    the project's build made are in the package: libkvwire-ucx.so, libkvwire_cuda.so);
#  * a room between two processes (prefill TP1 -> decode TP2) over tcp, shm and, when
#    the package has the module, ucx: every decode byte and guard byte checked against
#    the arithmetic that made the prefill bytes (tests/wheel_room.py).
# Env: KVW_BUILD_DIR = the project's build directory (which modules to expect);
# KVW_PYTHON = interpreter (default python3, else /usr/bin/python3).
# Exit: 0 pass, 1 fail, 77 skipped.
set -u

name=test_wheel
src=${KVW_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
build=${KVW_BUILD_DIR:-$src/build}
source "$(dirname "${BASH_SOURCE[0]}")/timeout.sh"

# The wheel builds its own release library; the release run covers it, and a sanitized
# pass would only build the same thing again.
if [[ -n ${KVW_SANITIZED:-} && ${KVW_SANITIZED} != 0 ]] ||
   { [[ -f $build/CMakeCache.txt ]] && grep -Eq '^KVW_SANITIZE:[A-Z]+=.+' "$build/CMakeCache.txt"; }; then
    echo "$name: SKIP: sanitized build (the release build's run covers the wheel)"
    exit 77
fi
PY=${KVW_PYTHON:-$(command -v python3 || true)}
[[ -z $PY && -x /usr/bin/python3 ]] && PY=/usr/bin/python3
if [[ -z $PY ]] || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 8))' 2>/dev/null; then
    echo "$name: SKIP: no python3 (3.8 or newer) found"
    exit 77
fi
for tool in cmake cc; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "$name: SKIP: '$tool' not found (scripts/install-deps.sh installs it)"
        exit 77
    fi
done

tmp=$(mktemp -d /tmp/kvw-wheel.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
unset KVWIRE_LIB PYTHONPATH PYTHONHOME KVW_TL_MODULE_DIR KVW_CUDA_MODULE
export PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

if ! "$PY" -m venv "$tmp/venv" >"$tmp/venv.log" 2>&1; then
    echo "$name: SKIP: '$PY -m venv' fails (Debian: the python3-venv package," \
         "scripts/install-deps.sh): $(tail -2 "$tmp/venv.log")"
    exit 77
fi
vpy=$tmp/venv/bin/python
if ! "$vpy" -m pip --version >/dev/null 2>&1; then
    echo "$name: SKIP: the venv has no pip (Debian: python3-venv)"
    exit 77
fi

# The build output goes to the log; pip shows the backend's lines with -v.
t0=$(date +%s)
if ! KVWIRE_BUILD_JOBS=$(nproc) timeout -k 5 "$(kvt_tmo 420)" "$vpy" -m pip install -v \
    --no-index --no-build-isolation "$src/python" >"$tmp/pip.log" 2>&1; then
    tail -40 "$tmp/pip.log" >&2
    echo "$name: FAIL: pip install $src/python failed (log above)" >&2
    exit 1
fi
echo "$name: pip install ./python took $(($(date +%s) - t0)) s:" \
     "$(grep -o 'packaged .*' "$tmp/pip.log" | head -1)"

failures=0
fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

mkdir -p "$tmp/run"
cp "$src/tests/wheel_room.py" "$tmp/run/"
cd "$tmp/run" || exit 1
pkg=$("$vpy" -I -c 'import os, kvwire; print(os.path.dirname(kvwire.__file__))' 2>"$tmp/imp.err")
if [[ -z $pkg || $pkg != "$tmp/venv/"* ]]; then
    echo "$name: FAIL: the installed kvwire does not import from the venv ('$pkg'):" \
         "$(cat "$tmp/imp.err")" >&2
    exit 1
fi
for f in libkvwire.so "$([[ -f $build/libkvwire-ucx.so ]] && echo libkvwire-ucx.so)" \
         "$([[ -f $build/libkvwire_cuda.so ]] && echo libkvwire_cuda.so)"; do
    [[ -z $f ]] && continue
    [[ -f $pkg/$f ]] || fail "$f is not in the installed package ($(ls "$pkg" | tr '\n' ' '))"
done
if [[ -f $pkg/libkvwire.so ]] && command -v readelf >/dev/null 2>&1; then
    readelf -d "$pkg/libkvwire.so" | grep -Eq 'NEEDED.*(libucp|libcuda)' &&
        fail "the packaged libkvwire.so links UCX or CUDA"
fi
ls "$tmp"/venv/lib/python3*/site-packages/kvwire-*.dist-info/LICENSE >/dev/null 2>&1 ||
    fail "the installed package has no LICENSE"

out=$(timeout -k 5 "$(kvt_tmo 60)" "$vpy" -I wheel_room.py check "$pkg" 2>&1) ||
    fail "installed package check: $out"
echo "$out" | sed "s/^/$name: /"
transports=(tcp shm)
[[ -f $pkg/libkvwire-ucx.so ]] && transports+=(ucx)
for t in "${transports[@]}"; do
    out=$(timeout -k 5 "$(kvt_tmo 90)" "$vpy" -I wheel_room.py decode "$t" 2>&1) ||
        fail "room over $t: $out"
    echo "$out" | sed "s/^/$name: /"
done

if [[ $failures -ne 0 ]]; then
    echo "$name: $failures check(s) FAILED" >&2
    exit 1
fi
echo "$name: passed"
exit 0
