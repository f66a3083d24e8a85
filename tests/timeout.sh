# One scale for the shell tests' timeouts, as tests/timeout.h gives the C tests:
# KVW_TEST_TIMEOUT_SCALE (a whole number >= 1, default 1), times 3 in sanitized builds
# (KVW_SANITIZED set and not 0, or KVW_BUILD_DIR configured with KVW_SANITIZE).
# Source it, then write every timeout as $(kvt_tmo SECONDS_OR_MS).
KVT_TIMEOUT_SCALE=${KVW_TEST_TIMEOUT_SCALE:-1}
if ! [[ $KVT_TIMEOUT_SCALE =~ ^[1-9][0-9]{0,3}$ ]] || ((KVT_TIMEOUT_SCALE > 1000)); then
    echo "KVW_TEST_TIMEOUT_SCALE='$KVT_TIMEOUT_SCALE': expected a whole number from 1 to 1000" >&2
    exit 2
fi
if [[ -n ${KVW_SANITIZED:-} && ${KVW_SANITIZED} != 0 ]] ||
   { [[ -f ${KVW_BUILD_DIR:-}/CMakeCache.txt ]] &&
     grep -Eq '^KVW_SANITIZE:[A-Z]+=.+' "$KVW_BUILD_DIR/CMakeCache.txt"; }; then
    KVT_TIMEOUT_SCALE=$((KVT_TIMEOUT_SCALE * 3))
fi
kvt_tmo() { echo $(($1 * KVT_TIMEOUT_SCALE)); }
