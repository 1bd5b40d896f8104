#!/usr/bin/env bash
# Set up everything a fresh machine needs, then run every test tier (unit, integration, e2e).
#   bash tests/run.sh            # all tiers
#   bash tests/run.sh tests/unit # any pytest arguments narrow the run
# Idempotent: a second run reuses .venv/ and .venv-vllm/.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
echo "==> installing fleetgate with its dev, plan and bench extras into .venv"
.venv/bin/pip install -q --upgrade pip >/dev/null
.venv/bin/pip install -q -e '.[dev,plan,bench]'

if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server (tests start their own on a free port)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q redis-server
  else
    sudo apt-get update -q && sudo apt-get install -y -q redis-server
  fi
fi

echo "==> Prometheus and promtool (Debian's package) for the rule and dashboard tests"
bash tests/setup_prometheus.sh
echo "==> Chromium (Debian's package) for the /dashboard browser test"
bash tests/setup_chromium.sh

if [ -f replica/vllm_env/install.sh ]; then
  echo "==> installing the real vLLM (CPU build) into .venv-vllm for the e2e tier"
  bash replica/vllm_env/install.sh
fi

echo "==> ruff"
.venv/bin/ruff check .
echo "==> pytest"
exec .venv/bin/pytest "$@"
