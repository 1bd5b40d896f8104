#!/usr/bin/env bash
# Install Chromium (Debian's `chromium` package) for the browser test of the built-in dashboard page:
# tests/integration/test_dashboard_chromium.py loads /dashboard in real headless Chromium.
# Idempotent: does nothing when /usr/bin/chromium already exists.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi

echo "==> installing chromium (the dashboard page test drives it headless)"
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO=sudo
fi
# Only refresh the package lists when apt does not know the package yet (a fresh image).
if ! apt-cache show chromium >/dev/null 2>&1; then
  $SUDO apt-get update -q
fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core

if [ ! -x /usr/bin/chromium ]; then
  echo "setup_chromium.sh: /usr/bin/chromium is still missing after installing the package" >&2
  exit 1
fi
