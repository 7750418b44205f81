#!/usr/bin/env bash
# Make sure a Chromium binary is there for the browser test (tests/e2e/test_web.py drives
# it headless through Playwright with executable_path; Playwright never downloads one).
# Installs Debian's chromium when run as root; otherwise says how to install it and fails.
set -euo pipefail
for b in chromium chromium-browser; do
    if command -v "$b" >/dev/null 2>&1; then
        exit 0
    fi
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium (Debian package chromium, for the browser test)..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium >/dev/null
    exit 0
fi
cat >&2 <<'MSG'
error: Chromium is missing (the web page test drives it headless).
  Debian/Ubuntu:  sudo apt-get install chromium
  other systems:  install Chromium and set RRL_CHROMIUM=/path/to/chromium
MSG
exit 1
