"""Read which kernel plugins the engine runs, as its vLLM plugin recorded them in Redis.

The plugin (``replica/vllm_plugin``) writes ``<prefix>replica:<id>:kernels`` — module -> version
of the plugins loaded in *every* engine process — beside the fleet store's key for the replica.
The agent owns the replica's ``ReplicaState`` (one writer per JSON value), so it reads that hash
and publishes it as ``kernel_plugins``: that is how the gateway (``/admin/replicas``) and routing
(``requires-kernels``) see it. Same Redis, same prefix and same replica id as the plugin:
``FLEETGATE_REDIS_URL``/``FLEETGATE_KEY_PREFIX``/``FLEETGATE_REPLICA_ID`` on the engine must match
the agent's fleet URL, fleet key prefix and replica id.
"""

from __future__ import annotations

import logging
from typing import Any

from replica.vllm_plugin.keys import PluginKeys
from routing.redis_urls import PRIMARY_URL_PREFIXES

__all__ = ["KernelReportReader", "build_kernel_reader"]

logger = logging.getLogger(__name__)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class KernelReportReader:
    """One ``HGETALL`` of the replica's ``:kernels`` hash per ``read``."""

    def __init__(self, url: str, key_prefix: str, replica_id: str, *,
                 timeout_s: float = 1.0, client: Any | None = None) -> None:
        from routing.redis_clients import bounded_client

        self._redis = client or bounded_client(url, timeout_s)
        self.key = PluginKeys(key_prefix, replica_id).kernels
        self._failing = False

    async def read(self) -> dict[str, str] | None:
        """module -> version (empty: no plugin listed, or the engine has not started yet);
        None if Redis could not be read (the caller keeps what it last knew)."""
        try:
            raw = await self._redis.hgetall(self.key)
        except Exception as exc:  # redis raises many connection error types; all mean "down"
            if not self._failing:
                logger.warning("cannot read kernel plugins from %s: %s", self.key, exc)
            self._failing = True
            return None
        self._failing = False
        return {_text(k): _text(v) for k, v in sorted(raw.items())}

    async def close(self) -> None:
        await self._redis.aclose()


def build_kernel_reader(url: str | None, key_prefix: str, replica_id: str
                        ) -> KernelReportReader | None:
    """A reader for a Redis URL; None for an in-memory fleet (no plugin can report there)."""
    if url is None or not url.startswith(PRIMARY_URL_PREFIXES):
        return None
    return KernelReportReader(url, key_prefix, replica_id)
