#!/usr/bin/env bash
# The CLI's option checks and its messages: every bad value of `kvwire demo` is refused
# with exit status 2 and one line naming the option, its valid range and the value given;
# layouts are accepted in any case; a configuration refused at the handshake exits 3 with
# the reason; the demo registers at an external bootstrap endpoint (kvwire bootstrap),
# which logs the registrations and the lookup; a decode waiting for absent prefill ranks
# prints progress lines naming the address; kvwire bootstrap, info and plan check their
# arguments too.
# KVW_CLI is the kvwire binary (set by CTest). Exit 0: pass, 1: fail.
set -u

name=test_cli_opts
cli=${KVW_CLI:-}
if [[ -z "$cli" && -n "${KVW_BUILD_DIR:-}" ]]; then
    cli=$KVW_BUILD_DIR/kvwire
fi
if [[ -z "$cli" || ! -x "$cli" ]]; then
    echo "$name: kvwire binary not found (set KVW_CLI)" >&2
    exit 1
fi
source "$(dirname "${BASH_SOURCE[0]}")/timeout.sh"

tmp=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
failures=0
fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

# run ARGS...: the CLI with a time limit; stdout, stderr and the status in $tmp/out,
# $tmp/err and $rc.
run() {
    timeout -k 5 "$(kvt_tmo 120)" "$cli" "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
}

# expect_usage "MESSAGE" ARGS...: exit 2, MESSAGE (a fixed string) on stderr, nothing on
# stdout and no usage dump (the message alone says what is wrong).
expect_usage() {
    local msg=$1
    shift
    run "$@"
    [[ $rc -eq 2 ]] || fail "kvwire $*: exit $rc, expected 2 ($(head -3 "$tmp/err"))"
    grep -qF -- "$msg" "$tmp/err" || fail "kvwire $*: stderr lacks '$msg': $(head -3 "$tmp/err")"
    [[ ! -s $tmp/out ]] || fail "kvwire $*: printed on stdout: $(head -3 "$tmp/out")"
    if grep -q '^usage:' "$tmp/err"; then fail "kvwire $*: printed the whole usage"; fi
}

# ---------------------------------------------------------------- demo options
expect_usage "demo: --requests takes a whole number from 1 to 100000, not '0'" demo --requests 0
expect_usage "demo: --role takes both, prefill or decode, not 'foo'" demo --role foo
expect_usage "demo: --prefill-tp takes a whole number from 1 to 256, not 'abc'" demo --prefill-tp abc
expect_usage "demo: --prefill-tp takes a whole number from 1 to 256, not '-1'" demo --prefill-tp -1
expect_usage "demo: --decode-tp takes a whole number from 1 to 256, not '4x'" demo --decode-tp 4x
expect_usage "demo: --decode-tp takes a whole number from 1 to 256, not '257'" demo --decode-tp 257
expect_usage "demo: --layers takes a whole number from 0 to 36 (the layers of gpt-oss-120b; 0 keeps them all), not '100'" \
    demo --layers 100
expect_usage "demo: --kv-heads takes a whole number from 1 to 4096, not '0'" demo --kv-heads 0
expect_usage "demo: --timeout-ms takes a whole number from 1 to 86400000, not '0'" demo --timeout-ms 0
expect_usage "demo: --concurrency takes a whole number from 1 to 1024, not '0'" demo --concurrency 0
expect_usage "demo: --page-size takes a whole number from 1 to 65536, not ' 64'" demo --page-size ' 64'
expect_usage "demo: --decode-page-size takes a whole number from 1 to 65536, not '0'" \
    demo --decode-page-size 0
expect_usage "demo: --max-tokens takes a whole number from 1 to 1048576, not '99999999999999999999999'" \
    demo --max-tokens 99999999999999999999999
expect_usage "demo: --seed takes a whole number from 0 to 18446744073709551615, not '-3'" demo --seed -3
expect_usage "demo: --prefill-pp takes a whole number from 1 to 128, not '999'" demo --prefill-pp 999
expect_usage "demo: --decode-pp takes a whole number from 1 to 128, not '0'" demo --decode-pp 0
expect_usage "demo: --decode-layout takes nhd or hnd, not 'xyz'" demo --decode-layout xyz
expect_usage "demo: --prefill-layout takes nhd or hnd, not ''" demo --prefill-layout ''
expect_usage "demo: --gpu= takes both, prefill or decode, not 'x'" demo --gpu=x
expect_usage "demo: --bootstrap takes HOST:PORT (a host name or address, a port from 0 to 65535), not 'localhost'" \
    demo --bootstrap localhost
expect_usage "demo: --bootstrap takes HOST:PORT (a host name or address, a port from 0 to 65535), not '127.0.0.1:70000'" \
    demo --bootstrap 127.0.0.1:70000
expect_usage "demo: unknown model 'nope'; the presets are: gpt-oss-120b" demo --model nope
expect_usage "demo: --transport takes one of the transports of this library, tcp, shm, " \
    demo --transport foo
expect_usage "cuda_ipc (with --gpu) or fault:NAME, not 'foo' (kvwire info says why one is missing)" \
    demo --transport foo
expect_usage "demo: unrecognized option '--no-such-option'" demo --no-such-option
expect_usage "demo: option '--requests' requires an argument" demo --requests
expect_usage "demo: unexpected argument 'extra'" demo extra
expect_usage "demo: --external-bootstrap needs --bootstrap HOST:PORT" demo --external-bootstrap
expect_usage "demo: --role decode needs --bootstrap host:port" demo --role decode

# The README spells the layouts in capitals: both cases work, and an HND side verifies.
run demo --decode-layout HND --prefill-layout Nhd --requests 3 --layers 2 --decode-tp 2
[[ $rc -eq 0 ]] && grep -q "verified\|every byte and guard" "$tmp/out" ||
    fail "demo --decode-layout HND: exit $rc: $(tail -3 "$tmp/out") $(tail -3 "$tmp/err")"
grep -q "3 requests x 2 decode ranks = 6" "$tmp/out" ||
    fail "demo does not explain its room count: $(cat "$tmp/out")"

# ---------------------------------------------------------------- handshake refusal
# A prefill instance of 4 layers and a decode instance of 6: the prefill rank refuses the
# decode's registration, and the decode exits 3 with the reason.
timeout -k 5 "$(kvt_tmo 60)" "$cli" demo --role prefill --bootstrap 127.0.0.1:0 --layers 4 \
    --requests 1 --timeout-ms "$(kvt_tmo 4000)" >"$tmp/pre.out" 2>"$tmp/pre.err" &
pids+=($!)
addr=
for _ in $(seq 1 "$(kvt_tmo 100)"); do
    addr=$(sed -n 's/.*bootstrap endpoint at \([0-9.]*:[0-9]*\);.*/\1/p' "$tmp/pre.out")
    [[ -n $addr ]] && break
    sleep 0.1
done
if [[ -z $addr ]]; then
    fail "the prefill instance printed no bootstrap address: $(cat "$tmp/pre.out" "$tmp/pre.err")"
else
    run demo --role decode --bootstrap "$addr" --layers 6 --requests 1
    [[ $rc -eq 3 ]] || fail "a decode refused at the handshake exits $rc, expected 3: $(cat "$tmp/err")"
    grep -qF "layer count is 4 on the source, 6 on the destination" "$tmp/err" ||
        fail "the refusal does not give the reason: $(cat "$tmp/err")"
    grep -qF "refused at the handshake" "$tmp/out" ||
        fail "the decode side does not say it was refused: $(cat "$tmp/out")"
fi

# ---------------------------------------------------------------- external bootstrap
"$cli" bootstrap --listen 127.0.0.1:0 >"$tmp/bs.out" 2>"$tmp/bs.err" &
bspid=$!
pids+=($bspid)
bs=
for _ in $(seq 1 "$(kvt_tmo 100)"); do
    bs=$(sed -n 's/^kvwire bootstrap listening on \([0-9.]*:[0-9]*\).*/\1/p' "$tmp/bs.out")
    [[ -n $bs ]] && break
    sleep 0.1
done
if [[ -z $bs ]]; then
    fail "kvwire bootstrap printed no address: $(cat "$tmp/bs.out" "$tmp/bs.err")"
else
    # Beside a running endpoint, hosting one at its address fails naming the way out.
    run demo --bootstrap "$bs" --requests 1
    [[ $rc -eq 1 ]] && grep -qF -- "--external-bootstrap registers at it" "$tmp/err" ||
        fail "demo hosting at a used address: exit $rc: $(cat "$tmp/err")"
    run demo --bootstrap "$bs" --external-bootstrap --requests 4 --prefill-tp 2 --decode-tp 1
    [[ $rc -eq 0 ]] && grep -q "every byte and guard" "$tmp/out" ||
        fail "demo --external-bootstrap: exit $rc: $(tail -3 "$tmp/out") $(tail -3 "$tmp/err")"
    sleep 0.5
    for want in "prefill rank dp0/tp0/pp0 of TP2/PP1/DP1 registered at" \
                "prefill rank dp0/tp1/pp0 of TP2/PP1/DP1 registered at" \
                "lookup from 127.0.0.1 answered with 2 entries" \
                "a prefill rank's connection closed"; do
        grep -qF "$want" "$tmp/bs.out" || fail "kvwire bootstrap did not log '$want': $(cat "$tmp/bs.out")"
    done
    # A decode with no prefill instance says what it waits for, and where, while it waits.
    run demo --role decode --bootstrap "$bs" --requests 1 --timeout-ms 6000
    [[ $rc -eq 1 ]] || fail "a decode without prefill ranks exits $rc, expected 1"
    grep -qF "decode rank 0 waiting for the prefill ranks at $bs" "$tmp/err" &&
        grep -qF "5 s of 6 s" "$tmp/err" ||
        fail "no progress line while the decode waited: $(cat "$tmp/err")"
    grep -qF "no prefill rank registered" "$tmp/err" ||
        fail "the decode's timeout does not say why: $(cat "$tmp/err")"
fi

# ---------------------------------------------------------------- bench options
expect_usage "bench: --reps takes a whole number from 1 to 64, not '0'" bench --reps 0
expect_usage "bench: --layers takes a whole number from 0 to 36 (the layers of gpt-oss-120b; 0 keeps them all), not '99'" \
    bench --layers 99
expect_usage "bench: --decode-mem takes shared or anon, not 'foo'" bench --decode-mem foo
expect_usage "bench --latency: --rooms takes a whole number from 1 to 5000, not '0'" bench --latency --rooms 0
expect_usage "bench --latency: --inflight takes a whole number from 1 to 1024, not '-2'" \
    bench --latency --inflight -2
expect_usage "bench --stream: --prefill-tp takes a whole number from 1 to 8, not '9'" bench --stream --prefill-tp 9
expect_usage "bench --gpu: --reps takes a whole number from 1 to 64, not 'x'" bench --gpu --reps x

# ---------------------------------------------------------------- a bad bootstrap address
# A prefill rank whose bootstrap host does not resolve fails at once, naming the address
# (a refused connection is waited for: engines start their ranks before the endpoint).
t0=$(date +%s)
run demo --role prefill --external-bootstrap --bootstrap nosuch.invalid:9 --requests 1
t1=$(date +%s)
[[ $rc -ne 0 ]] && grep -q "bootstrap endpoint nosuch.invalid:9" "$tmp/err" &&
    [[ $((t1 - t0)) -lt 10 ]] ||
    fail "a prefill at an unresolvable bootstrap: exit $rc after $((t1 - t0)) s: $(tail -1 "$tmp/err")"

# ---------------------------------------------------------------- other commands
expect_usage "bootstrap: --listen takes HOST:PORT (a host name or address, a port from 0 to 65535), not 'nowhere'" \
    bootstrap --listen nowhere
expect_usage "bootstrap: unknown argument '--bogus'" bootstrap --bogus
run bootstrap --help
[[ $rc -eq 0 ]] && grep -q "^usage: kvwire bootstrap" "$tmp/out" || fail "kvwire bootstrap --help: exit $rc"
run info --help
[[ $rc -eq 0 ]] && grep -q "^usage: kvwire info" "$tmp/out" && ! grep -q "^transports" "$tmp/out" ||
    fail "kvwire info --help: exit $rc, $(head -2 "$tmp/out")"
expect_usage "info: unknown argument 'extra'" info extra
expect_usage "kvwire plan: unknown model 'nope'; the presets are: gpt-oss-120b" \
    plan --model nope --src-tp 1 --dst-tp 2
run plan --model llama-3.1-70b --src-tp 3 --dst-tp 1 --kv-heads 6 --tokens 64
[[ $rc -eq 0 ]] && grep -q "^total:" "$tmp/out" ||
    fail "kvwire plan --kv-heads 6 on TP 3: exit $rc: $(cat "$tmp/err")"
expect_usage "kvwire plan: --kv-heads: 0 is outside [1, 4096]" \
    plan --model llama-3.1-70b --src-tp 1 --dst-tp 2 --kv-heads 0

if [[ $failures -ne 0 ]]; then
    echo "$name: $failures check(s) FAILED" >&2
    exit 1
fi
echo "$name: all checks passed"
exit 0
