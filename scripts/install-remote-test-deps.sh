#!/usr/bin/env bash
# `make test`: the system packages the remote tier's tests run real servers from, installed when missing.
# - libibverbs1: Mooncake Store's wheel links it even for TCP (mooncake_master, mooncake_client, store.so)
# - redis-server: the Redis backend's tests start their own on a free loopback port
# The Python clients come with the test extra (pyproject.toml). Only root can install these; anyone else
# is told the line to run, and those tests skip (they fail instead under KVTIER_REQUIRE_REMOTE=1, as in CI).
# Measured on a Debian 12 machine without them: apt-get update 1.2 s, the 8 packages (2 MB) 11 s.
set -euo pipefail
missing=()
for package in libibverbs1 redis-server; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
((${#missing[@]})) || exit 0
line="apt-get install -y --no-install-recommends ${missing[*]}"
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "make test: the remote tier's tests will skip without ${missing[*]}; as root: $line" >&2
    exit 0
fi
echo "make test: installing ${missing[*]} for the remote tier's tests"
export DEBIAN_FRONTEND=noninteractive
# package lists only when the install fails without them (a fresh container has none, old ones go stale)
$line -q || { apt-get update -q && $line -q; }
