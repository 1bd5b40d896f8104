#!/usr/bin/env bash
# Install Prometheus and promtool (Debian's `prometheus` package) for the integration tier:
# tests/integration/test_prometheus_rules.py (promtool check/test rules) and
# tests/integration/test_prometheus_live.py (a real Prometheus scraping `fleetgate up`).
# Idempotent: does nothing when both binaries are already on PATH.
# The package may try to start its systemd service; the tests never use it (each starts its own
# `prometheus` on a free port with a temporary config and storage), so a failed start is harmless.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi

echo "==> installing prometheus and promtool (tests start their own on a free port)"
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO=sudo
fi
# Only refresh the package lists when apt does not know the package yet (a fresh image).
if ! apt-cache show prometheus >/dev/null 2>&1; then
  $SUDO apt-get update -q
fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends prometheus

for tool in prometheus promtool; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "setup_prometheus.sh: $tool is still missing after installing the package" >&2
    exit 1
  fi
done
