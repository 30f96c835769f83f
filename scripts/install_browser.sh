#!/usr/bin/env bash
# Install Debian's Chromium for the HTML report's browser tests, unless it is already there.
# Idempotent: does nothing when /usr/bin/chromium exists. (Playwright drives this binary; its
# own browser download is never used.)
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    echo "chromium is installed: /usr/bin/chromium"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: /usr/bin/chromium is missing and apt-get is not available;" \
         "install Chromium with your system's package manager" >&2
    exit 1
fi
as_root=()
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "error: installing chromium needs root (or sudo)" >&2
        exit 1
    fi
    as_root=(sudo)
fi
"${as_root[@]}" apt-get update
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium
echo "chromium is installed: /usr/bin/chromium"
