#!/usr/bin/env bash
# Tests scripts/sweep.sh: each outcome of a demo run lands in its class (verified,
# refused, failed, crashed, hung), only the first two pass, failing runs are printed as
# command lines, a hung run's whole process group is killed, and a seed always draws the
# same runs. A stand-in for kvwire answers `demo --help` and `info` with the real binary
# and plays the outcome named by SWEEP_FAKE for every demo run; a short sweep of the real
# demo closes. KVW_CLI is the kvwire binary (set by CTest). Exit 0: pass, 1: fail, 77: skip.
set -u

cli=${KVW_CLI:-}
if [[ -z "$cli" && -n "${KVW_BUILD_DIR:-}" ]]; then
    cli=$KVW_BUILD_DIR/kvwire
fi
if [[ -z "$cli" || ! -x "$cli" ]]; then
    echo "test_sweep: kvwire binary not found (set KVW_CLI)" >&2
    exit 1
fi
if ! command -v python3 >/dev/null; then
    echo "test_sweep: python3 not found; skipping" >&2
    exit 77
fi
sweep="$(cd "$(dirname "$0")/.." && pwd)/scripts/sweep.sh"
source "$(dirname "${BASH_SOURCE[0]}")/timeout.sh"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

fake=$tmp/kvwire
cat >"$fake" <<EOF
#!/usr/bin/env bash
if [[ "\$1" != demo || "\${2:-}" == --help ]]; then
    exec "$cli" "\$@"
fi
case "\$SWEEP_FAKE" in
verified) echo "TP1/PP1->TP4/PP1  2  8  1000  0.01  0.1  yes: every byte and guard"; exit 0 ;;
no-verdict) echo "TP1/PP1->TP4/PP1  2  8  1000  0.01  0.1  NO"; exit 0 ;;
refused) echo "demo: decode TP 6: linear-attention state 0 group 0: 16 heads cannot be split over TP 6 (need heads % TP == 0 or TP % heads == 0)" >&2; exit 3 ;;
refused-silent) exit 3 ;;
failed) echo "demo: room 1000 failed on decode rank 0: closed the connection" >&2
        echo "demo: FAILED (decode exit 1, prefill exit 0, 0 of 2 requests verified)" >&2; exit 1 ;;
wrong) echo "demo: decode rank 1: WRONG BYTES: buffer 3 page 2 byte 17" >&2; exit 1 ;;
crash) kill -SEGV \$\$ ;;
child-crash) echo "demo: FAILED (decode killed by signal 11 (Segmentation fault), prefill exit 0, 0 of 2 requests verified)" >&2; exit 1 ;;
hang) sleep 300 &
      echo \$! >"$tmp/hang.pid"
      wait ;;
esac
exit 99
EOF
chmod +x "$fake"

# run_fake MODE RUNS [ARGS...]: runs the sweep against the stand-in; leaves its output in
# $tmp/out and its status in $rc.
run_fake() {
    local mode=$1 runs=$2
    shift 2
    SWEEP_FAKE=$mode "$sweep" --cli "$fake" --seed 11 --runs "$runs" --timeout "$(kvt_tmo 3)" "$@" \
        >"$tmp/out" 2>&1
    rc=$?
}

# expect MODE CLASS STATUS: one run of MODE is counted as CLASS, the sweep exits STATUS,
# and a failing run is printed with the command line that reproduces it.
expect() {
    local mode=$1 class=$2 want=$3
    run_fake "$mode" 1
    if [[ $rc -ne $want ]]; then
        fail "$mode: sweep exited $rc, expected $want: $(tail -n 20 "$tmp/out")"
    fi
    if ! grep -qE "^$class +1( |$)" "$tmp/out"; then
        fail "$mode: no '$class 1' line: $(tail -n 20 "$tmp/out")"
    fi
    if [[ $want -ne 0 ]]; then
        if ! grep -qE "^    $fake demo --model [a-z0-9.-]+ --layers [0-9]+ " "$tmp/out"; then
            fail "$mode: the failing run's command line is not printed: $(tail -n 20 "$tmp/out")"
        fi
    elif grep -q "failing runs" "$tmp/out"; then
        fail "$mode: a passing run is listed as failing: $(tail -n 20 "$tmp/out")"
    fi
}

expect verified verified 0
expect refused refused 0
expect no-verdict failed 1
expect refused-silent failed 1
expect failed failed 1
expect wrong failed 1
expect crash crashed 1
expect child-crash crashed 1
expect hang hung 1

# The refusal reason is counted with its numbers folded.
run_fake refused 2
if ! grep -qF "   2  decode TP N: linear-attention state N group N: N heads cannot be split over TP N" "$tmp/out"; then
    fail "refusal reasons not counted: $(cat "$tmp/out")"
fi
# A hung run's process group is killed: its sleeping child is gone, or a zombie not yet
# reaped by init (it held the run's output pipes, so the sweep went on only once it died).
if [[ ! -s "$tmp/hang.pid" ]]; then
    fail "the hang stand-in did not record its child"
else
    hpid=$(cat "$tmp/hang.pid")
    hstat=$(ps -o stat= -p "$hpid" 2>/dev/null)
    if [[ -n "$hstat" && "$hstat" != Z* ]]; then
        fail "the hung run's child $hpid survived the sweep (state $hstat)"
        kill "$hpid"
    fi
fi
# Wrong bytes are named among the failing runs.
run_fake wrong 1
if ! grep -qF "exit 1: demo: decode rank 1: WRONG BYTES" "$tmp/out"; then
    fail "wrong bytes not named: $(cat "$tmp/out")"
fi

# A seed always draws the same runs; another seed draws others. Per-run lines are
# "[   i] class  time  arguments".
draws() {
    SWEEP_FAKE=verified "$sweep" --cli "$fake" --seed "$1" --runs 6 2>&1 |
        grep -E '^\[ *[0-9]+\]' | awk '{$4 = ""; print}'
}
a=$(draws 5)
b=$(draws 5)
c=$(draws 6)
if [[ -z "$a" || "$a" != "$b" ]]; then
    fail "seed 5 drew different runs twice: '$a' vs '$b'"
fi
if [[ "$a" == "$c" ]]; then
    fail "seeds 5 and 6 drew the same runs"
fi
# --only N runs exactly run N of the seed.
third=$(sed -n 3p <<<"$a")
only=$(SWEEP_FAKE=verified "$sweep" --cli "$fake" --seed 5 --only 3 2>&1 |
    grep -E '^\[ *[0-9]+\]' | awk '{$4 = ""; print}')
if [[ "$only" != "$third" ]]; then
    fail "--only 3 ran '$only', not run 3 '$third'"
fi

# The real demo: a few runs of a fixed seed, all verified or refused.
"$sweep" --cli "$cli" --seed 3 --runs 4 >"$tmp/out" 2>&1
rc=$?
if [[ $rc -ne 0 ]]; then
    fail "real sweep (seed 3, 4 runs) exited $rc: $(cat "$tmp/out")"
fi
n=$(awk '/^(verified|refused) +[0-9]+$/ {s += $2} END {print s + 0}' "$tmp/out")
if [[ $n -ne 4 ]]; then
    fail "real sweep: $n of 4 runs verified or refused: $(cat "$tmp/out")"
fi

if [[ $failures -ne 0 ]]; then
    echo "test_sweep: $failures failure(s)" >&2
    exit 1
fi
echo "test_sweep: all checks passed"
exit 0
