#!/usr/bin/env bash
# Install the baseline routers for bench/gateway_overhead.py into their own venv, .venv-routers/
# (gitignored), at pinned versions, so they never touch fleetgate's .venv.
#
#   bash bench/install_routers.sh
#
# Afterwards: .venv-routers/bin/python -m sglang_router.launch_router --help
#             .venv-routers/bin/vllm-router --help
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv-routers/bin/python ]; then
    "$PY" -m venv .venv-routers
fi
.venv-routers/bin/python -m pip install --quiet --upgrade pip
.venv-routers/bin/python -m pip install --quiet "sglang-router==0.3.2" "vllm-router==0.1.17"
.venv-routers/bin/python -m pip show sglang-router vllm-router | grep -E '^(Name|Version):'
