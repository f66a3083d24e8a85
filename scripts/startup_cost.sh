#!/usr/bin/env bash
# Start-up cost per rank pair (docs/SCALING.md): runs `kvwire demo --startup` for a few
# instance sizes, idle and beside CPU load, and prints one markdown row per size and
# load: the median over RUNS runs of the decode side's start-up (every decode rank
# registered with every prefill rank), per pair, and what the connections carried.
#
#   scripts/startup_cost.sh [BUILD_DIR]      (default build; RUNS=3 LOAD=4 TRANSPORT=shm)
#
# LOAD busy loops (`while :; do :; done`) run beside the loaded rows and are killed on
# exit. The demo registers its decode ranks one after the other, so the time is the
# sum over decode ranks; each rank's registrations with the prefill ranks run in
# parallel (up to 8 at once).
set -u
build=${1:-build}
runs=${RUNS:-3}
load=${LOAD:-4}
tl=${TRANSPORT:-shm}
kvw="$build/kvwire"
[ -x "$kvw" ] || { echo "startup_cost: no $kvw (build first)" >&2; exit 2; }

pids=()
stop_load() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    pids=()
}
trap stop_load EXIT INT TERM

# name: prefill TP PP, decode TP PP
sizes=("1x1:1 1 1 1" "4x4:4 1 4 1" "16x4:16 1 4 1" "48x8:16 3 4 2")

median() { sort -g | awk '{a[NR]=$1} END {print (NR ? a[int((NR+1)/2)] : "-")}'; }

echo "| ranks (P x D) | pairs | load | decode start-up s | ms per pair | B per pair | segments per pair | decode fds / threads | prefill fds / threads | failed runs |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for mode in idle loaded; do
    if [ "$mode" = loaded ]; then
        for _ in $(seq "$load"); do (while :; do :; done) & pids+=($!); done
    fi
    for sz in "${sizes[@]}"; do
        name=${sz%%:*}
        read -r ptp ppp dtp dpp <<<"${sz#*:}"
        t=(); ms=(); b=(); sg=(); dfd=""; pfd=""; fail=0
        for _ in $(seq "$runs"); do
            out=$("$kvw" demo --model gpt-oss-20b --layers 7 --prefill-tp "$ptp" \
                  --prefill-pp "$ppp" --decode-tp "$dtp" --decode-pp "$dpp" --page-size 16 \
                  --decode-page-size 1 --decode-layout hnd --transport "$tl" --max-tokens 1 \
                  --requests 4 --concurrency 7 --seed 2088489570 --startup --quiet 2>&1)
            rc=$?
            [ $rc -eq 0 ] || fail=$((fail + 1))
            d=$(grep -m1 'start-up: decode' <<<"$out")
            p=$(grep -m1 'start-up: prefill, every decode' <<<"$out")
            [ -n "$d" ] || continue
            t+=("$(sed -E 's/.* rank pairs, ([0-9.]+) s .*/\1/' <<<"$d")")
            ms+=("$(sed -E 's/.*\(([0-9.]+) ms per pair\).*/\1/' <<<"$d")")
            b+=("$(sed -E 's/.*\(([0-9]+) B, .*/\1/' <<<"$d")")
            sg+=("$(sed -E 's/.* B, ([0-9.]+) segments per pair.*/\1/' <<<"$d")")
            dfd=$(sed -E 's/.*; ([0-9]+) fds, ([0-9]+) threads.*/\1 \/ \2/' <<<"$d")
            [ -n "$p" ] && pfd=$(sed -E 's/.*; ([0-9]+) fds, ([0-9]+) threads.*/\1 \/ \2/' <<<"$p")
        done
        pairs=$(( ptp * ppp * dtp * dpp ))
        echo "| $((ptp * ppp)) x $((dtp * dpp)) ($name) | $pairs | $mode | $(printf '%s\n' "${t[@]:-}" | median) | $(printf '%s\n' "${ms[@]:-}" | median) | $(printf '%s\n' "${b[@]:-}" | median) | $(printf '%s\n' "${sg[@]:-}" | median) | ${dfd:--} | ${pfd:--} | $fail of $runs |"
    done
    stop_load
done
