#!/usr/bin/env bash
# Randomized configuration sweep of `kvwire demo`: draws presets, TP 1-16 and PP 1-3 per
# side, page sizes 1-256 and NHD/HND per side, transports (ucx where usable) and request
# shapes; runs each with a time limit and classifies it as verified, refused (exit 3 with
# the reason), failed, crashed or hung. Exits 1 if any run failed, crashed or hung, and
# prints each such run's command line. The logic is in sweep.py (Python standard library).
#
#   scripts/sweep.sh --seed 1 --runs 20        CI-sized (under 2 minutes on 2 cores)
#   scripts/sweep.sh --seed 7 --seconds 3600 --max-pairs 2304 --max-tokens 2048 --timeout 300
#                                              at length: every TP/PP pair, longer requests
#   scripts/sweep.sh --help                    all options
#
# Env: BUILD = build directory holding kvwire (default build).
set -eu
if ! command -v python3 >/dev/null; then
    echo "sweep.sh: python3 is needed" >&2
    exit 2
fi
exec python3 "$(dirname "$0")/sweep.py" "$@"
