"""``LoraEngineApi`` (adapters_registry) over aiohttp: vLLM's runtime LoRA API for the gateway.

It lives in the gateway, which owns the pooled upstream session, so that ``adapters_registry``
speaks no HTTP itself.
"""

from __future__ import annotations

import aiohttp

from adapters_registry.engine_api import ALREADY_LOADED, EngineReply, engine_message
from adapters_registry.errors import AdapterLoadFailed, AdapterUnloadFailed


class EngineLoraClient:
    """``LoraEngineApi`` over aiohttp: loads and unloads adapters on one engine URL at a time."""

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
                if resp.status == 400 and ALREADY_LOADED in message:
                    return EngineReply(changed=False)
                raise AdapterLoadFailed(adapter, replica, message, resp.status)
        except TimeoutError:
            raise AdapterLoadFailed(
                adapter, replica, f"no answer within {self.timeout_s:g}s"
            ) from None
        except aiohttp.ClientError as exc:
            unreachable = isinstance(exc, aiohttp.ClientConnectorError)
            raise AdapterLoadFailed(
                adapter, replica, f"request failed: {exc}", unreachable=unreachable
            ) from exc

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
