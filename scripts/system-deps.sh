#!/usr/bin/env bash
# System packages the test suite needs beyond Python: Mooncake's native libraries
# (libibverbs, libnl; loaded by the mooncake wheel even for TCP) and the tools that
# make a private network namespace (unshare, ip). Installs them with apt-get when
# run as root on Debian/Ubuntu; otherwise stops at once printing the one command to run.
set -euo pipefail
PKGS=(libibverbs1 libnl-3-200 libnl-route-3-200 iproute2 util-linux)

missing=()
for lib in libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200; do
  ldconfig -p 2>/dev/null | grep -q "$lib" || missing+=("$lib")
done
for tool in unshare ip; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0

cmd="apt-get update && apt-get install -y ${PKGS[*]}"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "== installing system packages (missing: ${missing[*]}): $cmd"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq "${PKGS[@]}" >/dev/null
  exit 0
fi
echo "missing system packages for the test suite (${missing[*]}). Run, as root:" >&2
echo "  $cmd" >&2
exit 1
