#!/usr/bin/env bash
# Tests `cmake --install`: installs the build into a scratch prefix, then checks what a
# user of the installed library gets:
#  * the files: headers, libkvwire.so with its SONAME links, the UCX transport module,
#    kvwire.pc, the CMake package, the CLI;
#  * the ABI hygiene: no UCX or CUDA among the library's NEEDED entries, SONAME
#    libkvwire.so.MAJOR, every exported symbol a public kvw_ one under the
#    KVWIRE_MAJOR.MINOR version node, no internal kvw__ symbol, no fault-injection code
#    in the library or the CLI, no benchmark or test-only kit code in the CLI (kvwire
#    bench says to run the build tree's kvwire-bench);
#  * two consumers, built exactly as the README says: one with
#    `cc app.c $(pkg-config --cflags --libs kvwire)`, one with a CMake project that calls
#    find_package(kvwire) (built, then installed into a second scratch prefix); both run
#    from a prefix outside the loader's path, with no LD_LIBRARY_PATH (the rpath that
#    kvwire.pc and the CMake package give finds the library), and check kvw_version()
#    and real results of the topology API.
# KVW_BUILD_DIR is the build directory (set by CTest). Exit 0: pass, 1: fail, 77: skipped.
set -u

name=test_install
build=${KVW_BUILD_DIR:-}
src=${KVW_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if [[ -z "$build" || ! -f "$build/CMakeCache.txt" ]]; then
    echo "$name: no build directory (set KVW_BUILD_DIR)" >&2
    exit 1
fi
for tool in cmake pkg-config cc readelf nm; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "$name: SKIP: '$tool' not found (scripts/install-deps.sh installs it)"
        exit 77
    fi
done
# A sanitizer build's library needs its runtime loaded first in every consumer; the
# release build's run covers the installed library.
if grep -Eq '^KVW_SANITIZE:[A-Z]+=.+' "$build/CMakeCache.txt"; then
    echo "$name: SKIP: $build is a sanitizer build ($(grep -E '^KVW_SANITIZE:' "$build/CMakeCache.txt"))"
    exit 77
fi

tmp=$(mktemp -d /tmp/kvw-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
failures=0
fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

if ! cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1; then
    cat "$tmp/install.log" >&2
    echo "$name: FAIL: cmake --install failed" >&2
    exit 1
fi

# The version the headers declare: every other check compares with it.
hdr=$prefix/include/kvwire/version.h
if [[ ! -f "$hdr" ]]; then
    echo "$name: FAIL: $hdr not installed" >&2
    exit 1
fi
ver_part() { sed -n "s/^#define KVW_VERSION_$1 \\([0-9]*\\)\$/\\1/p" "$hdr"; }
major=$(ver_part MAJOR)
minor=$(ver_part MINOR)
patch=$(ver_part PATCH)
version=$major.$minor.$patch
echo "$name: installed version $version into $prefix"

# ---------------------------------------------------------------- files
for h in kvwire.h xfer.h mem.h cuda.h version.h; do
    [[ -f $prefix/include/kvwire/$h ]] || fail "include/kvwire/$h not installed"
done
real=$(find "$prefix" -name "libkvwire.so.$version" -type f | head -1)
if [[ -z "$real" ]]; then
    echo "$name: FAIL: libkvwire.so.$version not installed" >&2
    find "$prefix" >&2
    exit 1
fi
libdir=$(dirname "$real")
[[ "$(readlink "$libdir/libkvwire.so.$major")" == "libkvwire.so.$version" ]] ||
    fail "libkvwire.so.$major does not link to libkvwire.so.$version"
[[ -L "$libdir/libkvwire.so" && -e "$libdir/libkvwire.so" ]] ||
    fail "no libkvwire.so development link"
[[ -e "$libdir/libkvwire.a" ]] && fail "the static library (with internal symbols) is installed"
[[ -f "$libdir/pkgconfig/kvwire.pc" ]] || fail "kvwire.pc not installed"
for f in kvwireConfig.cmake kvwireConfigVersion.cmake kvwireTargets.cmake; do
    [[ -f "$libdir/cmake/kvwire/$f" ]] || fail "lib/cmake/kvwire/$f not installed"
done
if [[ -x "$prefix/bin/kvwire" ]]; then
    "$prefix/bin/kvwire" info >"$tmp/info" 2>&1 || fail "installed kvwire info failed"
    head -1 "$tmp/info" | grep -qx "kvwire $version" ||
        fail "kvwire info says '$(head -1 "$tmp/info")', expected 'kvwire $version'"
    # The CLI is a client of the installed shared library, through its public API only.
    readelf -d "$prefix/bin/kvwire" | grep -q 'NEEDED.*libkvwire\.so\.0' ||
        fail "the installed CLI does not link libkvwire.so.0"
    if nm "$prefix/bin/kvwire" 2>/dev/null | grep -qE ' [TtDdBb] kvw__'; then
        fail "the installed CLI carries internal kvw__ symbols (a copy of the library)"
    fi
else
    fail "bin/kvwire not installed"
fi

# The UCX transport is a module: installed next to the library when the build made one,
# and found from there by the installed CLI (bin/ -> lib/).
if [[ -f "$build/libkvwire-ucx.so" ]]; then
    [[ -f "$libdir/libkvwire-ucx.so" ]] || fail "libkvwire-ucx.so built but not installed"
    sed -n '/^transports/,/^$/p' "$tmp/info" | grep -qE '^  ucx +usable$' ||
        fail "the installed CLI does not find the ucx module: $(cat "$tmp/info")"
    # The installed libkvwire.so loads it from its own directory: a context over ucx
    # (through the Python binding, which opens one on a one-byte rank).
    if command -v python3 >/dev/null 2>&1; then
        if ! KVWIRE_LIB=$libdir/libkvwire.so PYTHONPATH=$src/python python3 -c '
import kvwire, sys
sys.exit(0 if kvwire.transport_available("ucx") else 1)' >"$tmp/py.log" 2>&1; then
            fail "the installed libkvwire.so cannot open a ucx context: $(tail -3 "$tmp/py.log")"
        fi
    else
        echo "$name: note: no python3, ucx context through the installed library not checked"
    fi
fi

# ---------------------------------------------------------------- ABI
# The core links no transport library: UCX is loaded with its module, CUDA likewise.
if readelf -d "$real" | grep -E 'NEEDED.*(libucp|libucs|libuct|libcuda|libcudart)'; then
    fail "libkvwire.so links UCX or CUDA"
fi
soname=$(readelf -d "$real" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[[ "$soname" == "libkvwire.so.$major" ]] || fail "SONAME is '$soname', expected libkvwire.so.$major"
nm -D --defined-only "$real" >"$tmp/syms" || fail "nm -D failed on $real"
nsyms=$(grep -c ' kvw_' "$tmp/syms")
[[ "$nsyms" -ge 20 ]] || fail "only $nsyms kvw_ symbols exported"
grep -q ' kvw_version@@KVWIRE_'"$major.$minor"'$' "$tmp/syms" ||
    fail "kvw_version is not exported under the version node KVWIRE_$major.$minor"
# Adapters ask what memory an address is before describing buffers (kvwire/cuda.h).
grep -q ' kvw_cuda_pointer_kind@@KVWIRE_' "$tmp/syms" ||
    fail "kvw_cuda_pointer_kind is not exported under a KVWIRE_ version node"
if grep -q ' kvw__' "$tmp/syms"; then
    fail "internal symbols exported: $(grep ' kvw__' "$tmp/syms" | awk '{print $3}' | head -5 | tr '\n' ' ')"
fi
# The fault-injection transport belongs to the tests and the soak's CLI, not to the
# shipped library or CLI (their symbol tables must exist for this to mean anything).
for f in "$real" "$prefix/bin/kvwire"; do
    nm "$f" >"$tmp/all-syms" 2>/dev/null
    if ! grep -qE ' (kvw__error|main)$' "$tmp/all-syms"; then
        echo "$name: note: $(basename "$f") has no symbol table; fault code not checked"
    elif grep -qE ' (kvw__tl_fault_[a-z_]+|fault_[a-z_]+)$' "$tmp/all-syms"; then
        fail "$(basename "$f") contains fault-injection code"
    fi
done
# No benchmark or test-only code in the installed CLI: `kvwire bench` is the build
# tree's kvwire-bench (not installed), and of the test kit the CLI links only what demo
# and plan run with (tools/testkit/check.c is the tests' own). Every global symbol that
# the build's bench/cli and check.c objects define must be absent from the installed CLI.
[[ -e "$prefix/bin/kvwire-bench" ]] && fail "kvwire-bench is installed (a build-tree tool)"
nm "$prefix/bin/kvwire" >"$tmp/cli-syms" 2>/dev/null
nm --defined-only $(find "$build/CMakeFiles" -name '*.c.o' \( -path '*/bench/cli/*' \
        -o -path '*/tools/testkit/check.c.o' \) ! -name main.c.o) 2>/dev/null |
    awk 'NF == 3 && $2 ~ /^[TDBR]$/ {print $3}' | sort -u >"$tmp/dev-syms"
if ! grep -qE ' T main$' "$tmp/cli-syms"; then
    echo "$name: note: the installed CLI has no symbol table; bench and test-kit code not checked"
elif ! grep -qx kvw_bench_gpu "$tmp/dev-syms" || ! grep -qx kvt_expect_failure "$tmp/dev-syms"; then
    fail "the bench and check.c objects were not found under $build/CMakeFiles to compare with"
else
    carried=$(awk '{print $NF}' "$tmp/cli-syms" | sort -u | comm -12 - "$tmp/dev-syms" | head -5)
    [[ -z "$carried" ]] || fail "the installed CLI carries bench or test-only code: $carried"
    grep -qE ' [TtDdBb] [a-z_]*bench' "$tmp/cli-syms" &&
        fail "the installed CLI has bench symbols: $(grep -E ' [TtDdBb] [a-z_]*bench' "$tmp/cli-syms" | head -3)"
fi
# ... and says so, naming the build tree's program, when asked for it.
"$prefix/bin/kvwire" bench --quick >"$tmp/bench.out" 2>&1
rc=$?
[[ $rc -eq 2 ]] && grep -q "kvwire bench is not part of the installed CLI; run build/kvwire-bench" \
    "$tmp/bench.out" || fail "installed kvwire bench: exit $rc, $(head -2 "$tmp/bench.out")"

# Everything exported is the public API or the version node itself.
others=$(awk '$3 !~ /^kvw_[a-z]/ && $3 !~ /^KVWIRE_/ {print $3}' "$tmp/syms" | head -5)
[[ -z "$others" ]] || fail "non-API symbols exported: $others"
# ... and declared in an installed header: the library exports nothing its headers do not
# offer (the CUDA runtime helpers of the tools and tests, for one, live in the test kit).
undeclared=$(awk '$3 ~ /^kvw_[a-z]/ {sub(/@.*/, "", $3); print $3}' "$tmp/syms" |
    while read -r s; do
        grep -qE "\\b$s\\(" "$prefix"/include/kvwire/*.h || echo "$s"
    done | head -5 | tr '\n' ' ')
[[ -z "$undeclared" ]] || fail "exported but declared in no installed header: $undeclared"

# ---------------------------------------------------------------- consumers
mkdir -p "$tmp/app"
cat >"$tmp/app/app.c" <<'EOF'
/* A user of the installed library: its version and two topology results. */
#include <kvwire/cuda.h>
#include <kvwire/mem.h>
#include <kvwire/xfer.h>

#include <stdio.h>
#include <string.h>

int main(void)
{
    if (strcmp(kvw_version(), KVW_VERSION_STRING) != 0) {
        printf("library %s, headers %s\n", kvw_version(), KVW_VERSION_STRING);
        return 1;
    }
    uint32_t first = 0, count = 0;
    if (kvw_topo_heads(2, 1, 8, &first, &count) != KVW_OK || first != 4 || count != 4) {
        printf("kvw_topo_heads(2, 1, 8): %s first %u count %u\n", kvw_last_error(), first,
               count);
        return 1;
    }
    kvw_route_t routes[8];
    size_t n = 0;
    if (kvw_topo_routes(4, 2, 8, routes, 8, &n) != KVW_OK || n != 4 || routes[3].src_rank != 3 ||
        routes[3].dst_rank != 1 || routes[3].dst_head_start != 2 || routes[3].num_heads != 2) {
        printf("kvw_topo_routes(4, 2, 8): %s, %zu routes\n", kvw_last_error(), n);
        return 1;
    }
    if (kvw_topo_heads(3, 0, 8, &first, &count) != KVW_ERR_INCOMPATIBLE ||
        kvw_last_error()[0] == '\0') {
        printf("kvw_topo_heads(3, 0, 8) did not fail with a message\n");
        return 1;
    }
    printf("kvwire %s ok\n", kvw_version());
    return 0;
}
EOF

# The consumers run as a user's would: no LD_LIBRARY_PATH, and a prefix the loader does
# not search (ldconfig's cache and default paths know nothing of $tmp).
unset LD_LIBRARY_PATH
if ldconfig -p 2>/dev/null | grep -q "$tmp"; then
    fail "the scratch prefix $tmp is in the loader's cache"
fi
# The README's line, word for word: cc app.c $(pkg-config --cflags --libs kvwire).
export PKG_CONFIG_PATH=$libdir/pkgconfig
pcver=$(pkg-config --modversion kvwire 2>&1)
[[ "$pcver" == "$version" ]] || fail "pkg-config --modversion kvwire says '$pcver'"
if flags=$(pkg-config --cflags --libs kvwire 2>"$tmp/pc.err"); then
    # shellcheck disable=SC2046 # the flags are words, as in the README
    if (cd "$tmp/app" && cc app.c $(pkg-config --cflags --libs kvwire) -o "$tmp/app-pc") \
        2>"$tmp/pc-cc.err"; then
        out=$("$tmp/app-pc" 2>&1) || fail "pkg-config consumer failed: $out"
        [[ "$out" == "kvwire $version ok" ]] || fail "pkg-config consumer printed '$out'"
        readelf -d "$tmp/app-pc" | grep -q "NEEDED.*\[libkvwire.so.$major\]" ||
            fail "the pkg-config consumer does not record libkvwire.so.$major"
        readelf -d "$tmp/app-pc" | grep -E '(RPATH|RUNPATH)' | grep -q "$prefix" ||
            fail "the pkg-config consumer has no rpath into $prefix ($flags)"
    else
        fail "pkg-config consumer does not build ($flags): $(cat "$tmp/pc-cc.err")"
    fi
    # The same program with warnings as errors: the headers compile cleanly.
    # shellcheck disable=SC2086 # the flags are words
    cc -std=c11 -Wall -Wextra -Werror "$tmp/app/app.c" $flags -o "$tmp/app-pc-w" \
        2>"$tmp/pc-w.err" || fail "the headers warn under -Wall -Wextra: $(cat "$tmp/pc-w.err")"
else
    fail "pkg-config --cflags --libs kvwire: $(cat "$tmp/pc.err")"
fi

# The README's CMake lines (find_package, target_link_libraries), and an install() so
# that the program runs from its own prefix too (CMake drops its build-tree rpath there).
cat >"$tmp/app/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.18)
project(kvwire_consumer LANGUAGES C)
find_package(kvwire $major.$minor REQUIRED)
add_executable(app app.c)
target_link_libraries(app PRIVATE kvwire::kvwire)
install(TARGETS app)
EOF
if cmake -S "$tmp/app" -B "$tmp/app-build" -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" >"$tmp/cm.log" 2>&1 &&
    cmake --build "$tmp/app-build" >>"$tmp/cm.log" 2>&1 &&
    cmake --install "$tmp/app-build" --prefix "$tmp/app-prefix" >>"$tmp/cm.log" 2>&1; then
    for exe in "$tmp/app-build/app" "$tmp/app-prefix/bin/app"; do
        out=$("$exe" 2>&1) || fail "find_package consumer $exe failed: $out"
        [[ "$out" == "kvwire $version ok" ]] || fail "find_package consumer $exe printed '$out'"
    done
    readelf -d "$tmp/app-prefix/bin/app" | grep -E '(RPATH|RUNPATH)' | grep -q "$libdir" ||
        fail "the installed find_package consumer has no rpath to $libdir"
    grep -q "kvwire_DIR:PATH=$libdir/cmake/kvwire" "$tmp/app-build/CMakeCache.txt" ||
        fail "find_package found another kvwire: $(grep kvwire_DIR "$tmp/app-build/CMakeCache.txt")"
else
    cat "$tmp/cm.log" >&2
    fail "find_package(kvwire) consumer does not build"
fi
# A request for another minor version must not match (0.x may break the ABI in a minor).
cat >"$tmp/app/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.18)
project(kvwire_consumer LANGUAGES C)
find_package(kvwire $major.$((minor + 1)) CONFIG)
if(kvwire_FOUND)
  message(FATAL_ERROR "kvwire $version accepted for $major.$((minor + 1))")
endif()
EOF
cmake -S "$tmp/app" -B "$tmp/app-build2" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/cm2.log" 2>&1 ||
    fail "find_package(kvwire $major.$((minor + 1))) matched $version: $(tail -3 "$tmp/cm2.log")"

if [[ $failures -ne 0 ]]; then
    echo "$name: $failures check(s) FAILED" >&2
    exit 1
fi
echo "$name: all checks passed"
exit 0
