#!/bin/bash
# Installs the Debian packages needed to BUILD rdma-rpc with its default `rdma` feature:
# transport-rdma uses sideway -> rdma-mummy-sys, whose build script runs cmake and bindgen
# (libclang). No rdma-core development package is needed: rdma-core is loaded with dlopen at run
# time, so the binaries start (and serve TCP) on machines without it.
# Idempotent and quiet when everything is there. Needs root (or sudo) and apt-get.
set -euo pipefail
PKGS=(cmake clang libclang-dev make)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
log=$(mktemp /tmp/install-build-deps.XXXXXX.log)
echo "install-build-deps: installing ${missing[*]} (log: $log)"
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get -o DPkg::Lock::Timeout=600 update \
       && $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  echo "install-build-deps: FAILED; last lines of $log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
echo "install-build-deps: done"
