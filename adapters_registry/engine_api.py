"""What the registry needs from an engine: vLLM's runtime LoRA API, as a protocol.

vLLM (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) offers ``POST /v1/load_lora_adapter
{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}``. vLLM answers 400
"has already been loaded" for a second load of the same name, which for us means the goal is
reached; likewise a 404 on unload means the adapter is already gone.

This package speaks no HTTP (tests/unit/test_layering.py holds it to that): the gateway passes in
``gateway.engine_api.EngineLoraClient``, the aiohttp implementation; unit tests pass a fake.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

#: What vLLM's 400 says when the adapter is loaded already: success for a load.
ALREADY_LOADED = "already been loaded"


@dataclass(frozen=True)
class EngineReply:
    """What the engine answered to a load or unload that counts as success."""

    #: False when the engine already had it loaded (load) or did not have it (unload).
    changed: bool


def engine_message(status: int, body: str) -> str:
    """The human message of a vLLM error body (its envelope, or the raw text, shortened)."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
        if isinstance(data.get("message"), str):
            return data["message"]
        if isinstance(data.get("detail"), str):
            return data["detail"]
    text = body.strip() or f"HTTP {status} with an empty body"
    return text[:500]


class LoraEngineApi(Protocol):
    """Load and unload adapters on the engine at ``url`` (``replica`` names it in errors).

    ``load`` raises ``AdapterLoadFailed`` and ``unload`` raises ``AdapterUnloadFailed`` with the
    engine's reason; a load of a loaded adapter, or an unload of an absent one, is a success
    with ``changed=False``.
    """

    async def load(self, url: str, replica: str, adapter: str, path: str) -> EngineReply: ...

    async def unload(self, url: str, replica: str, adapter: str) -> EngineReply: ...
