#!/usr/bin/env bash
# Two "hosts": network namespaces joined by a veth pair. The prefill instance runs in one,
# the decode instance in the other, and verified KV caches move between them over tcp and
# (when built) UCX, TP1->TP4 and TP4->TP1, gpt-oss-120b-shaped. Skips (77) where
# namespaces cannot be created. The namespaces are deleted on every exit path.
set -u
CLI=${KVW_CLI:-build/kvwire}
source "$(dirname "${BASH_SOURCE[0]}")/timeout.sh"
A=kvwt$$a
B=kvwt$$b
IPA=10.231.$((RANDOM % 200 + 10)).1
IPB=${IPA%.1}.2

cleanup() {
    [ -n "${PF_PID:-}" ] && kill "$PF_PID" 2>/dev/null
    ip netns del "$A" 2>/dev/null
    ip netns del "$B" 2>/dev/null
}
trap cleanup EXIT INT TERM

if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null; then
    echo "test_netns: skipped: needs root and iproute2 to create network namespaces"
    exit 77
fi
if ! ip netns add "$A" 2>/dev/null || ! ip netns add "$B" 2>/dev/null; then
    echo "test_netns: skipped: cannot create network namespaces here"
    exit 77
fi
ip link add "v$A" type veth peer name "v$B" || { echo "test_netns: skipped: no veth"; exit 77; }
ip link set "v$A" netns "$A"
ip link set "v$B" netns "$B"
ip -n "$A" addr add "$IPA/24" dev "v$A"
ip -n "$B" addr add "$IPB/24" dev "v$B"
for ns in "$A" "$B"; do
    ip -n "$ns" link set lo up
done
ip -n "$A" link set "v$A" up
ip -n "$B" link set "v$B" up

transports="tcp"
if "$CLI" info | grep -qE '^  ucx +usable$'; then transports="tcp ucx"; fi

fail=0
port=17600
summary=""
for t in $transports; do
    for topo in "1 4" "4 1"; do
        set -- $topo
        port=$((port + 1))
        args=(--transport "$t" --prefill-tp "$1" --decode-tp "$2" --layers 4 --requests 8
              --max-tokens 512 --timeout-ms "$(kvt_tmo 30000)")
        # Across namespaces UCX's shared-memory lanes would be chosen and hang; use tcp lanes.
        ip netns exec "$A" env UCX_TLS=tcp "$CLI" demo --role prefill --bootstrap "$IPA:$port" \
            --listen-host "$IPA" "${args[@]}" >"/tmp/kvw_netns_pf.$$" 2>&1 &
        PF_PID=$!
        out=$(timeout "$(kvt_tmo 120)" ip netns exec "$B" env UCX_TLS=tcp "$CLI" demo --role decode \
              --bootstrap "$IPA:$port" --listen-host "$IPB" "${args[@]}" 2>&1)
        rc=$?
        wait "$PF_PID"
        prc=$?
        PF_PID=
        if [ $rc -eq 0 ] && [ $prc -eq 0 ] && grep -q "verified: yes" <<<"$out"; then
            summary+="$t TP$1->TP$2 across namespaces: verified"$'\n'
        else
            summary+="$t TP$1->TP$2 across namespaces: FAILED (decode $rc, prefill $prc)"$'\n'
            echo "$out"
            cat "/tmp/kvw_netns_pf.$$"
            fail=1
        fi
    done
done
rm -f "/tmp/kvw_netns_pf.$$"
printf '%s' "$summary"
exit $fail
