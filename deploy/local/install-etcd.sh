#!/usr/bin/env bash
# Make sure the etcd server binary is there (the embedded platform and the tests
# start it as a child process). Installs Debian's etcd-server when run as root;
# otherwise says how to install it and fails.
set -euo pipefail
if command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing etcd (Debian package etcd-server)..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq etcd-server etcd-client >/dev/null
    # the package may start a system service on port 2379; rrl never uses it
    exit 0
fi
cat >&2 <<'MSG'
error: the etcd server binary is missing.
  Debian/Ubuntu:  sudo apt-get install etcd-server etcd-client
  other systems:  install etcd 3.4+ so that `etcd` is on PATH,
  or point rrl at an existing cluster with --etcd host:port (RRL_ETCD).
MSG
exit 1
