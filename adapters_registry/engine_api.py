"""vLLM's runtime LoRA API (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) over aiohttp.

``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter {"lora_name"}``. vLLM answers 400 "has already been loaded" for a
second load of the same name, which for us means the goal is reached; likewise a 404 on unload
means the adapter is already gone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from adapters_registry.errors import AdapterLoadFailed, AdapterUnloadFailed

_ALREADY_LOADED = "already been loaded"


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
    """What the loader needs from an engine; ``EngineLoraClient`` is the HTTP implementation."""

    async def load(self, url: str, replica: str, adapter: str, path: str) -> EngineReply: ...

    async def unload(self, url: str, replica: str, adapter: str) -> EngineReply: ...


class EngineLoraClient:
    """Loads and unloads adapters on one engine URL at a time."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float = 60.0) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.timeout_s = timeout_s

    async def load(self, url: str, replica: str, adapter: str, path: str) -> EngineReply:
        """Load ``adapter`` from ``path``; raises ``AdapterLoadFailed`` with the engine's reason."""
        body = {"lora_name": adapter, "lora_path": path}
        try:
            async with self._session.post(
                f"{url}/v1/load_lora_adapter", json=body, timeout=self._timeout
            ) as resp:
                text = await resp.text()
                if resp.status == 200:
                    return EngineReply(changed=True)
                message = engine_message(resp.status, text)
                if resp.status == 400 and _ALREADY_LOADED in message:
                    return EngineReply(changed=False)
                raise AdapterLoadFailed(adapter, replica, message, resp.status)
        except TimeoutError:
            raise AdapterLoadFailed(
                adapter, replica, f"no answer within {self.timeout_s:g}s"
            ) from None
        except aiohttp.ClientError as exc:
            raise AdapterLoadFailed(adapter, replica, f"request failed: {exc}") from exc

    async def unload(self, url: str, replica: str, adapter: str) -> EngineReply:
        """Unload ``adapter``; raises ``AdapterUnloadFailed`` with the engine's reason."""
        try:
            async with self._session.post(
                f"{url}/v1/unload_lora_adapter", json={"lora_name": adapter}, timeout=self._timeout
            ) as resp:
                text = await resp.text()
                if resp.status == 200:
                    return EngineReply(changed=True)
                if resp.status == 404:
                    return EngineReply(changed=False)
                raise AdapterUnloadFailed(
                    adapter, replica, engine_message(resp.status, text), resp.status
                )
        except TimeoutError:
            raise AdapterUnloadFailed(
                adapter, replica, f"no answer within {self.timeout_s:g}s"
            ) from None
        except aiohttp.ClientError as exc:
            raise AdapterUnloadFailed(adapter, replica, f"request failed: {exc}") from exc
