#!/usr/bin/env bash
# Installs the Debian 12 packages kvwire needs, only when some are missing.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libucx-dev ucx-utils libxxhash-dev iproute2 clang
      libclang-rt-14-dev python3 python3-numpy python3-venv gnuplot-nox)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "install-deps: installing ${missing[*]}"
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
