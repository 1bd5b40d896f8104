"""Helpers for the gateway + adapter-registry integration tests (no tests here).

A real gateway app in policy mode in front of simulated vLLM replicas (``replica/sim``), which
serve vLLM's runtime LoRA API; tenants ``acme`` / ``globex`` / ``initech`` with keys
``<tenant>-key``, admin key ``admin-key``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from adapters_registry import RegistrySettings
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import GATEWAY, GatewayState
from replica.sim.fleet import SimFleet
from tests.integration.test_gateway_support import serve

BASE_MODEL = "sim-model"
ADMIN = {"Authorization": "Bearer admin-key"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tenant}-key"}


def adapter(name: str, owner: str | None = "acme", **fields: Any) -> dict[str, Any]:
    """A catalog entry of ``BASE_MODEL``; ``owner=None`` makes it public."""
    entry: dict[str, Any] = {
        "name": name,
        "base_model": BASE_MODEL,
        "source": f"/adapters/{owner or 'public'}/{name}",
        "rank": 8,
        "size_mb": 500,
    }
    if owner is None:
        entry["public"] = True
    else:
        entry["owners"] = [owner]
    entry.update(fields)
    return entry


def policy_yaml(
    urls: Sequence[str],
    adapters: Sequence[dict[str, Any]],
    *,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
    profile: str | None = None,
) -> str:
    """One pool of the sims' URLs serving ``BASE_MODEL``; ``profile`` routes everything."""
    pool: dict[str, Any] = {"name": "pool-a", "replicas": list(urls)}
    if max_loras is not None:
        pool["max_loras"] = max_loras
    if max_cpu_loras is not None:
        pool["max_cpu_loras"] = max_cpu_loras
    doc: dict[str, Any] = {
        "version": 1,
        "replica_pools": [pool],
        "models": [{"name": BASE_MODEL, "pools": ["pool-a"]}],
        "tenants": [
            {"name": name, "api_key_sha256": [sha(f"{name}-key")]}
            for name in ("acme", "globex", "initech")
        ],
        "adapters": list(adapters),
        "admin": {"api_key_sha256": [sha("admin-key")]},
    }
    if profile is not None:
        doc["routes"] = [{"name": "all", "match": {"path_prefix": "/v1/"}, "profile": profile}]
    return yaml.safe_dump(doc)


@asynccontextmanager
async def adapter_gateway(
    tmp_path: Path,
    fleet: SimFleet,
    adapters: Sequence[dict[str, Any]],
    *,
    name: str = "gateway",
    redis_url: str | None = None,
    key_prefix: str = "fleetgate:",
    settings: RegistrySettings | None = None,
    **policy: Any,
) -> AsyncIterator[tuple[str, GatewayState]]:
    """A running policy-mode gateway over ``fleet``; yields its URL and its state.

    Health polling and pre-warming are off after start-up (the start-up poll and adapter refresh
    still run), so what the gateway knows about placement comes from its own loads: no test
    depends on when a background poll happens to run.
    """
    path = tmp_path / f"{name}.yaml"
    path.write_text(policy_yaml(fleet.urls, adapters, **policy))
    # The block index's prefix may not contain ':' (it becomes a Redis hash tag).
    index_prefix = "fgidx-" + key_prefix.replace(":", "-")
    config = GatewayConfig(
        policy_path=str(path),
        policy_poll_s=0,
        redis_url=redis_url,
        index_key_prefix=index_prefix if redis_url else None,
        adapter_key_prefix=key_prefix,
        adapter_prewarm_interval_s=None,
        adapter_settings=settings,
    )
    app: web.Application = create_app(config)
    config.health_interval_s = 3600  # the policy set its own; one poll at start-up is enough
    async with serve(app, handler_cancellation=True) as url:
        yield url, app[GATEWAY]


def chat(model: str, text: str = "hello") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


async def post_chat(
    http: aiohttp.ClientSession, url: str, tenant: str, model: str, text: str = "hello"
) -> tuple[int, Any]:
    """POST a chat completion as ``tenant``; returns (status, JSON body)."""
    async with http.post(
        f"{url}/v1/chat/completions", json=chat(model, text), headers=auth(tenant)
    ) as resp:
        return resp.status, await resp.json()


async def last_decision(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The newest entry of ``/admin/decisions`` (chosen replica, fallbacks, who served it)."""
    async with http.get(f"{url}/admin/decisions?n=1", headers=ADMIN) as resp:
        assert resp.status == 200
        return (await resp.json())["decisions"][0]


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """Sum of the gateway's ``name`` samples whose labels include ``labels``."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


class GatedLoraLock(asyncio.Lock):
    """Replaces a sim's ``lora_lock``: counts load/unload calls and holds them at ``gate``."""

    def __init__(self, gate: asyncio.Event) -> None:
        super().__init__()
        self.gate = gate
        self.calls = 0

    async def acquire(self) -> bool:
        self.calls += 1
        await self.gate.wait()
        return await super().acquire()
