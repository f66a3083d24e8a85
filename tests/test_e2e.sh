#!/usr/bin/env bash
# End to end: `kvwire demo` runs a prefill and a decode instance as separate processes
# and verifies every destination byte (and the guard bytes around every buffer)
# against the test kit's independent reference. This script runs it over shm and tcp
# for the topologies, models and layouts below and fails if any run fails. It also checks
# the help text, and that configurations the library refuses exit 3 with the reason.
#
# Env: KVW_CLI = path of the kvwire binary (set by CTest); KVW_E2E_ONLY = a substring
# that selects cases by name (for debugging).
set -u

CLI="${KVW_CLI:-}"
if [[ -z "$CLI" && -n "${KVW_BUILD_DIR:-}" ]]; then
    CLI="$KVW_BUILD_DIR/kvwire"
fi
if [[ -z "$CLI" || ! -x "$CLI" ]]; then
    echo "test_e2e: KVW_CLI is not set to the kvwire binary" >&2
    exit 1
fi
if ! "$CLI" demo --help >/dev/null 2>&1; then
    echo "test_e2e: $CLI has no demo command" >&2
    exit 1
fi

# The help names every transport the demo accepts (shm, tcp and ucx, whether or not
# this build has UCX), every transport `kvwire info` says is built in, and both layout
# options.
help=$("$CLI" demo --help 2>&1)
help_bad=0
tl_line=$(grep -E '^ +--transport ' <<<"$help")
for word in shm tcp ucx fault:; do
    if ! grep -qF -- "$word" <<<"$tl_line"; then
        echo "test_e2e: 'kvwire demo --help' --transport line does not name '$word': $tl_line" >&2
        help_bad=1
    fi
done
for word in --prefill-layout --decode-layout; do
    if ! grep -qF -- "$word" <<<"$help"; then
        echo "test_e2e: 'kvwire demo --help' does not mention '$word'" >&2
        help_bad=1
    fi
done
# `kvwire info` lists the transports under "transports", one "  NAME  usable" (or "not
# usable: WHY") line each; cuda_ipc the demo's help names apart (--gpu).
built=$("$CLI" info | awk '/^transports/ {on = 1; next} on && /^  [a-z_]+ +usable$/ {print $1; next} on && /^  / {next} {on = 0}' | grep -vx cuda_ipc)
if [[ -z "$built" ]]; then
    echo "test_e2e: no transports in 'kvwire info'" >&2
    help_bad=1
fi
for t in $built; do
    if ! grep -F 'Built into this library:' <<<"$help" | grep -qw -- "$t"; then
        echo "test_e2e: 'kvwire demo --help' does not list built-in transport '$t'" >&2
        help_bad=1
    fi
done
# An unknown layout is a usage error (exit 2), not a silent NHD.
err=$("$CLI" demo --prefill-layout nhx 2>&1 >/dev/null)
rc=$?
if [[ $rc -ne 2 ]] || ! grep -qF -- "--prefill-layout takes nhd or hnd, not 'nhx'" <<<"$err"; then
    echo "test_e2e: --prefill-layout nhx: exit $rc, '$err'" >&2
    help_bad=1
fi
[[ $help_bad -eq 0 ]] || exit 1

# Each run is a few seconds; a stuck run is killed rather than hanging CTest.
source "$(dirname "${BASH_SOURCE[0]}")/timeout.sh"
PER_RUN_TIMEOUT=$(kvt_tmo 60)
COMMON=(--layers 4 --requests 12 --max-tokens 512 --timeout-ms "$(kvt_tmo 20000)" --quiet)

# name | demo arguments
CASES=(
    "1->4 gpt-oss-120b|--prefill-tp 1 --decode-tp 4"
    "4->1 gpt-oss-120b|--prefill-tp 4 --decode-tp 1"
    "2->4 gpt-oss-120b|--prefill-tp 2 --decode-tp 4"
    "4->2 gpt-oss-120b|--prefill-tp 4 --decode-tp 2"
    "8->2 gpt-oss-120b|--prefill-tp 8 --decode-tp 2"
    "1->4 qwen3-next (2 heads, GDN)|--model qwen3-next --prefill-tp 1 --decode-tp 4"
    "3->2 6 heads|--kv-heads 6 --prefill-tp 3 --decode-tp 2"
    "4->2 deepseek-v3 (MLA)|--model deepseek-v3 --prefill-tp 4 --decode-tp 2"
    "2->4 deepseek-v3 (MLA)|--model deepseek-v3 --prefill-tp 2 --decode-tp 4"
    "PP2 TP1 -> PP1 TP2|--prefill-tp 1 --prefill-pp 2 --decode-tp 2 --decode-pp 1"
    "page 16 -> page 64|--prefill-tp 1 --decode-tp 4 --page-size 16 --decode-page-size 64"
    "NHD -> HND 2->4|--prefill-tp 2 --decode-tp 4 --decode-layout hnd"
    "HND -> NHD 4->2|--prefill-tp 4 --decode-tp 2 --prefill-layout hnd"
    "HND -> HND qwen3-next 8->2 page 16->64|--model qwen3-next --prefill-tp 8 --decode-tp 2 --prefill-layout hnd --decode-layout hnd --page-size 16 --decode-page-size 64"
)
TRANSPORTS=(shm tcp)

# With 4 layers, qwen3-next keeps three Gated DeltaNet (state) layers and one
# full-attention layer (layer 3), so both kinds take part.

logdir="$(mktemp -d "${TMPDIR:-/tmp}/kvw_e2e.XXXXXX")"
trap 'rm -rf "$logdir"' EXIT

declare -a rows=()
failed=0
total=0
start_all=$SECONDS
for c in "${CASES[@]}"; do
    name="${c%%|*}"
    args="${c#*|}"
    if [[ -n "${KVW_E2E_ONLY:-}" && "$name" != *"$KVW_E2E_ONLY"* ]]; then
        continue
    fi
    for t in "${TRANSPORTS[@]}"; do
        total=$((total + 1))
        log="$logdir/run$total.log"
        # shellcheck disable=SC2086
        cmd=("$CLI" demo "${COMMON[@]}" $args --transport "$t")
        t0=$(date +%s.%N)
        timeout -k 5 "$PER_RUN_TIMEOUT" "${cmd[@]}" >"$log" 2>&1
        rc=$?
        t1=$(date +%s.%N)
        secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
        if [[ $rc -eq 0 ]]; then
            verdict="ok"
        else
            failed=$((failed + 1))
            if [[ $rc -eq 124 || $rc -eq 137 ]]; then
                verdict="TIMEOUT"
            else
                verdict="FAIL($rc)"
            fi
            echo "---- FAILED: $name over $t (exit $rc)" >&2
            echo "     ${cmd[*]}" >&2
            sed 's/^/     | /' "$log" | tail -n 30 >&2
        fi
        rows+=("$(printf '%-34s %-5s %-10s %6ss' "$name" "$t" "$verdict" "$secs")")
    done
done

# Refusals: a configuration the library would refuse exits 3 before any process starts,
# with a message naming the reason (the numbers below follow the presets in
# tools/testkit/model.c: qwen3-next has 2 KV heads and linear-attention state groups of
# 16, 16 and 32 heads; neither 16 % 6 nor 6 % 16 is 0, likewise for 3).
REFUSALS=(
    "qwen3-next decode TP 6|--model qwen3-next --prefill-tp 2 --decode-tp 6|decode TP 6: linear-attention state 0 group 0: 16 heads cannot be split over TP 6"
    "qwen3-next prefill TP 6|--model qwen3-next --prefill-tp 6 --decode-tp 2|prefill TP 6: linear-attention state 0 group 0: 16 heads cannot be split over TP 6"
    "qwen3-next state layers only, TP 3|--model qwen3-next --layers 3 --prefill-tp 1 --decode-tp 3|decode TP 3: linear-attention state 0 group 0: 16 heads cannot be split over TP 3"
    "qwen3-next 6 KV heads, TP 3|--model qwen3-next --kv-heads 6 --prefill-tp 3 --decode-tp 2|prefill TP 3: linear-attention state 0 group 0: 16 heads cannot be split over TP 3"
    "qwen3-next 2 KV heads, TP 3|--model qwen3-next --prefill-tp 3 --decode-tp 2|2 KV heads cannot be split over TP 3"
    "PP 3 over 2 layers|--layers 2 --prefill-pp 3 --decode-tp 1|prefill rank tp0/pp2 refused: layer range [2, 2) is empty"
)
for c in "${REFUSALS[@]}"; do
    IFS='|' read -r name args want <<<"$c"
    if [[ -n "${KVW_E2E_ONLY:-}" && "$name" != *"$KVW_E2E_ONLY"* ]]; then
        continue
    fi
    total=$((total + 1))
    log="$logdir/run$total.log"
    # shellcheck disable=SC2086
    cmd=("$CLI" demo --requests 2 --max-tokens 64 --quiet $args)
    timeout -k 5 "$PER_RUN_TIMEOUT" "${cmd[@]}" >"$log" 2>&1
    rc=$?
    if [[ $rc -eq 3 ]] && grep -qF -- "$want" "$log" && ! grep -q "length 0" "$log"; then
        verdict="refused"
    else
        failed=$((failed + 1))
        verdict="FAIL($rc)"
        echo "---- FAILED: $name: expected exit 3 and '$want'" >&2
        echo "     ${cmd[*]}" >&2
        sed 's/^/     | /' "$log" | tail -n 10 >&2
    fi
    rows+=("$(printf '%-34s %-5s %-10s' "$name" "-" "$verdict")")
done

# A shared secret from a file (mode 600) on both sides: the run verifies. The same file
# readable by others, or the secret through KVW_SECRET_FILE with a wrong mode, is a usage
# error naming the file.
if [[ -z "${KVW_E2E_ONLY:-}" || "secret" == *"$KVW_E2E_ONLY"* ]]; then
    sf="$logdir/secret"
    printf 'correct horse battery staple\n' >"$sf"
    chmod 600 "$sf"
    for t in "${TRANSPORTS[@]}"; do
        total=$((total + 1))
        log="$logdir/run$total.log"
        cmd=("$CLI" demo "${COMMON[@]}" --prefill-tp 2 --decode-tp 1 --transport "$t" --secret-file "$sf")
        timeout -k 5 "$PER_RUN_TIMEOUT" "${cmd[@]}" >"$log" 2>&1
        rc=$?
        verdict="ok"
        if [[ $rc -ne 0 ]]; then
            failed=$((failed + 1))
            verdict="FAIL($rc)"
            echo "---- FAILED: secret file over $t (exit $rc)" >&2
            sed 's/^/     | /' "$log" | tail -n 20 >&2
        fi
        rows+=("$(printf '%-34s %-5s %-10s' "shared secret (file)" "$t" "$verdict")")
    done
    chmod 640 "$sf"
    total=$((total + 1))
    err=$(KVW_SECRET_FILE="$sf" "$CLI" demo --requests 1 --quiet 2>&1 >/dev/null)
    rc=$?
    verdict="refused"
    if [[ $rc -ne 2 ]] || ! grep -qF "is accessible by other users (mode 640)" <<<"$err"; then
        failed=$((failed + 1))
        verdict="FAIL($rc)"
        echo "---- FAILED: a group-readable secret file: exit $rc, '$err'" >&2
    fi
    rows+=("$(printf '%-34s %-5s %-10s' "secret file readable by others" "-" "$verdict")")
fi

echo
printf '%-34s %-5s %-10s %7s\n' "case" "tl" "result" "time"
printf '%s\n' "${rows[@]}"
echo
echo "test_e2e: $((total - failed)) of $total runs verified in $((SECONDS - start_all)) s"
if [[ $total -eq 0 ]]; then
    echo "test_e2e: no case selected" >&2
    exit 1
fi
[[ $failed -eq 0 ]] || exit 1
exit 0
