#!/usr/bin/env bash
# Tests `kvwire topo`: JSON output against hand-derived route tables (DESIGN.md
# section 3), exit codes and stderr messages for bad input, and the table mode.
# KVW_CLI is the kvwire binary (set by CTest). Exit 0: pass, 1: fail, 77: skipped.
set -u

cli=${KVW_CLI:-}
if [[ -z "$cli" && -n "${KVW_BUILD_DIR:-}" ]]; then
    cli=$KVW_BUILD_DIR/kvwire
fi
if [[ -z "$cli" || ! -x "$cli" ]]; then
    echo "test_cli_topo: kvwire binary not found (set KVW_CLI)" >&2
    exit 1
fi
if ! command -v python3 >/dev/null; then
    echo "test_cli_topo: python3 not found; skipping" >&2
    exit 77
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

# Runs the CLI with the given arguments; leaves stdout, stderr and the status in
# $tmp/out, $tmp/err and $rc.
run() {
    "$cli" topo "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
}

# expect_json ARGS... -- EXPECTED: EXPECTED is a Python literal (src_tp, dst_tp,
# kv_heads, mla, [(src, dst, src_start, dst_start, n), ...]) written out by hand.
expect_json() {
    local args=()
    while [[ $1 != -- ]]; do
        args+=("$1")
        shift
    done
    shift
    local expected=$1
    run "${args[@]}" --json
    if [[ $rc -ne 0 ]]; then
        fail "topo ${args[*]} --json exited $rc: $(cat "$tmp/err")"
        return
    fi
    if ! python3 - "$tmp/out" "$expected" <<'EOF' >&2; then
import ast, json, sys
text = open(sys.argv[1]).read()
# Exactly one JSON object and nothing else on stdout.
obj = json.loads(text)
src_tp, dst_tp, heads, mla, routes = ast.literal_eval(sys.argv[2])
want = {
    "src_tp": src_tp, "dst_tp": dst_tp, "kv_heads": heads, "mla": mla,
    "routes": [dict(zip(("src_rank", "dst_rank", "src_head_start", "dst_head_start",
                         "num_heads"), r)) for r in routes],
}
if obj != want:
    print("got:  " + json.dumps(obj))
    print("want: " + json.dumps(want))
    sys.exit(1)
EOF
        fail "topo ${args[*]} --json: wrong output"
    fi
}

# expect_error STATUS ARGS...: exits with STATUS, prints nothing on stdout and a
# message on stderr.
expect_error() {
    local want=$1
    shift
    run "$@"
    if [[ $rc -ne $want ]]; then
        fail "topo $* exited $rc, expected $want"
    fi
    if [[ ! -s "$tmp/err" ]]; then
        fail "topo $*: no message on stderr"
    fi
    if [[ -s "$tmp/out" ]]; then
        fail "topo $*: unexpected stdout: $(cat "$tmp/out")"
    fi
}

# ---- JSON against hand-derived tables (DESIGN.md section 3 and the rule there)
expect_json --src-tp 4 --dst-tp 2 --kv-heads 8 -- \
    '(4, 2, 8, False, [(0,0,0,0,2), (1,0,0,2,2), (2,1,0,0,2), (3,1,0,2,2)])'
expect_json --src-tp 1 --dst-tp 4 --kv-heads 2 -- \
    '(1, 4, 2, False, [(0,0,0,0,1), (0,1,0,0,1), (0,2,1,0,1), (0,3,1,0,1)])'
expect_json --src-tp 3 --dst-tp 2 --kv-heads 6 -- \
    '(3, 2, 6, False, [(0,0,0,0,2), (1,0,0,2,1), (1,1,1,0,1), (2,1,0,1,2)])'
expect_json --src-tp 8 --dst-tp 4 --kv-heads 2 -- \
    '(8, 4, 2, False, [(0,0,0,0,1), (1,1,0,0,1), (4,2,0,0,1), (5,3,0,0,1)])'
# s0,s1 own head 0 and s2,s3 head 1; d0..d3 read head 0 from s0,s1,s0,s1.
expect_json --src-tp 4 --dst-tp 8 --kv-heads 2 -- \
    '(4, 8, 2, False, [(0,0,0,0,1), (1,1,0,0,1), (0,2,0,0,1), (1,3,0,0,1),
                       (2,4,0,0,1), (3,5,0,0,1), (2,6,0,0,1), (3,7,0,0,1)])'
expect_json --src-tp 1 --dst-tp 1 --kv-heads 8 -- '(1, 1, 8, False, [(0,0,0,0,8)])'
# The --opt=value spelling is accepted too.
expect_json --src-tp=2 --dst-tp=4 --kv-heads=8 -- \
    '(2, 4, 8, False, [(0,0,0,0,2), (0,1,2,0,2), (1,2,0,0,2), (1,3,2,0,2)])'
# MLA: destination d reads the whole latent row from source d mod S.
expect_json --src-tp 2 --dst-tp 4 --mla -- \
    '(2, 4, 1, True, [(0,0,0,0,1), (1,1,0,0,1), (0,2,0,0,1), (1,3,0,0,1)])'
expect_json --src-tp 4 --dst-tp 2 --kv-heads 8 --mla -- \
    '(4, 2, 1, True, [(0,0,0,0,1), (1,1,0,0,1)])'
expect_json --src-tp 8 --dst-tp 1 --mla -- '(8, 1, 1, True, [(0,0,0,0,1)])'

# ---- invalid input
# Incompatible topology: exit 1, and the library's message names the numbers.
expect_error 1 --src-tp 3 --dst-tp 2 --kv-heads 8
if ! grep -q 8 "$tmp/err" || ! grep -q 3 "$tmp/err"; then
    fail "incompatible topology message does not name 8 and 3: $(cat "$tmp/err")"
fi
expect_error 1 --src-tp 2 --dst-tp 3 --kv-heads 8 --json
expect_error 1 --src-tp 4 --dst-tp 6 --kv-heads 4
# Usage errors: exit 2.
expect_error 2
expect_error 2 --dst-tp 2 --kv-heads 8
expect_error 2 --src-tp 2 --kv-heads 8
expect_error 2 --src-tp 2 --dst-tp 2
expect_error 2 --src-tp 2 --dst-tp 2 --kv-heads
expect_error 2 --src-tp 0 --dst-tp 2 --kv-heads 8
expect_error 2 --src-tp 2 --dst-tp 0 --kv-heads 8
expect_error 2 --src-tp 2 --dst-tp 2 --kv-heads 0
expect_error 2 --src-tp four --dst-tp 2 --kv-heads 8
expect_error 2 --src-tp 4x --dst-tp 2 --kv-heads 8
expect_error 2 --src-tp -4 --dst-tp 2 --kv-heads 8
expect_error 2 --src-tp ' 4' --dst-tp 2 --kv-heads 8
expect_error 2 --src-tp 4 --dst-tp 2 --kv-heads 99999999999999999999
expect_error 2 --src-tp 4 --dst-tp 2 --kv-heads 8 --bogus
expect_error 2 --src-tp 4 --dst-tp 2 --mla --kv-heads zero

# ---- help
run --help
if [[ $rc -ne 0 ]] || ! grep -q -- '--src-tp' "$tmp/out"; then
    fail "topo --help: exit $rc, usage not on stdout"
fi

# ---- table mode: a header line, one line per route, the absolute head ranges.
run --src-tp 4 --dst-tp 2 --kv-heads 8
if [[ $rc -ne 0 ]]; then
    fail "topo table mode exited $rc: $(cat "$tmp/err")"
else
    if ! grep -q 'src' "$tmp/out" || ! grep -q 'dst' "$tmp/out"; then
        fail "topo table: no column header: $(cat "$tmp/out")"
    fi
    # Routes are the lines that start with two rank numbers.
    nroutes=$(grep -cE '^ *[0-9]+ +[0-9]+ ' "$tmp/out")
    if [[ $nroutes -ne 4 ]]; then
        fail "topo table: $nroutes route lines, expected 4: $(cat "$tmp/out")"
    fi
    # Source rank 3 sends absolute heads [6,8) to destination 1 at offset 2.
    if ! grep -qE '^ *3 +1 +\[6,8\) +\[0,2\) +\[2,4\) +2 *$' "$tmp/out"; then
        fail "topo table: route 3->1 heads [6,8) missing: $(cat "$tmp/out")"
    fi
fi
run --src-tp 1 --dst-tp 4 --kv-heads 2
if [[ $rc -ne 0 ]] || ! grep -qE '^ *0 +2 +\[1,2\) +\[1,2\) +\[0,1\) +1 *$' "$tmp/out"; then
    fail "topo table 1->4 H=2: route 0->2 head [1,2) missing: $(cat "$tmp/out")"
fi
run --src-tp 2 --dst-tp 4 --mla
if [[ $rc -ne 0 ]] || [[ $(grep -cE '^ *[0-9]+ +[0-9]+ ' "$tmp/out") -ne 4 ]]; then
    fail "topo table --mla: expected 4 route lines: $(cat "$tmp/out")"
fi

if [[ $failures -ne 0 ]]; then
    echo "test_cli_topo: $failures failure(s)" >&2
    exit 1
fi
echo "test_cli_topo: all checks passed"
exit 0
