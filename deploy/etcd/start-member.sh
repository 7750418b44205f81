#!/usr/bin/env bash
# Start one member of rrl's 3-member etcd cluster in the foreground:
#
#   deploy/etcd/start-member.sh etcd-0        # on host etcd-0, likewise etcd-1, etcd-2
#
# Loads cluster.env, then NAME.env (and tls.env with START_MEMBER_TLS=1) from this
# folder, or from $START_MEMBER_CONF, and execs `etcd` with them: etcd reads ETCD_*
# variables as its flags. Run it under systemd or a supervisor that restarts it.
# Knobs (not ETCD_*, which etcd would read as flags):
#   START_MEMBER_CONF=DIR  folder with cluster.env / NAME.env / tls.env (default: here)
#   START_MEMBER_TLS=1     load tls.env and use https:// for every URL
#   START_MEMBER_ETCD=PATH the etcd binary (default: etcd on PATH)
set -euo pipefail

name=${1:-}
conf=${START_MEMBER_CONF:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
if [ -z "$name" ] || [ ! -f "$conf/$name.env" ]; then
    echo "usage: $0 NAME   (NAME is one of:$(cd "$conf" && ls -- *.env | grep -vx 'cluster.env\|tls.env' | sed 's/\.env$//' | tr '\n' ' ' | sed 's/^/ /'))" >&2
    exit 2
fi

set -a
# shellcheck source=/dev/null
. "$conf/cluster.env"
# shellcheck source=/dev/null
. "$conf/$name.env"
if [ "${START_MEMBER_TLS:-0}" = 1 ]; then
    # shellcheck source=/dev/null
    . "$conf/tls.env"
    for var in ETCD_INITIAL_CLUSTER ETCD_LISTEN_CLIENT_URLS ETCD_LISTEN_PEER_URLS \
               ETCD_ADVERTISE_CLIENT_URLS ETCD_INITIAL_ADVERTISE_PEER_URLS; do
        printf -v "$var" '%s' "${!var//http:\/\//https://}"
    done
fi
set +a

if [ "$ETCD_NAME" != "$name" ]; then
    echo "error: $conf/$name.env sets ETCD_NAME=$ETCD_NAME, expected $name" >&2
    exit 2
fi
mkdir -p "$ETCD_DATA_DIR"
chmod 700 "$ETCD_DATA_DIR"
echo "starting etcd member $ETCD_NAME (data $ETCD_DATA_DIR, clients $ETCD_ADVERTISE_CLIENT_URLS)" >&2
exec "${START_MEMBER_ETCD:-etcd}"
