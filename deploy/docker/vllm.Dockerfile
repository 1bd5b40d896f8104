# A vLLM engine image with the fleetgate vLLM plugin installed (stat logger + kernel-plugin hook).
# Pin the vLLM version: the KV-event wire format and metric names are checked against it in CI.
# Build from the repository root:
#   docker build -f deploy/docker/vllm.Dockerfile -t fleetgate-vllm:0.1.0-vllm0.32.0 .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY . /opt/fleetgate
# --no-deps: the engine image already has every dependency the plugin needs; fleetgate's own
# pins must never replace the engine's torch or transformers.
RUN pip install --no-cache-dir --no-deps /opt/fleetgate && \
    pip install --no-cache-dir redis==8.1.0 hiredis==3.5.0 xxhash==4.1.0
ENV PYTHONHASHSEED=0 \
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
