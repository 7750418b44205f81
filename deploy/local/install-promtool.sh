#!/usr/bin/env bash
# Make sure promtool is there (the metrics test runs `promtool check metrics` on the
# controller's /metrics). Installs Debian's prometheus package (which ships promtool; no
# server is started here: rrl never runs one) when run as root; otherwise says how and fails.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing promtool (Debian package prometheus, for the metrics test)..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    exit 0
fi
cat >&2 <<'MSG'
error: promtool is missing (the metrics test checks /metrics with it).
  Debian/Ubuntu:  sudo apt-get install prometheus
  other systems:  install Prometheus so that `promtool` is on PATH
MSG
exit 1
