"""Shared builders for the adapter-registry tests (no tests here)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import yaml

from adapters_registry.engine_api import EngineReply
from adapters_registry.errors import AdapterLoadFailed
from routing.config import Policy, parse_policy
from routing.state import ReplicaState
from routing.types import ReplicaId

BASE_MODEL = "sim-model"


class FakeEngine:
    """Records calls; a load can be held at a gate or made to fail."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.gate: asyncio.Event | None = None
        self.fail_with: AdapterLoadFailed | None = None
        #: Name -> the path its weights came from: a loaded name keeps its first path, as vLLM
        #: answers a second load "already loaded".
        self.paths: dict[str, str] = {}

    async def load(self, url: str, replica: str, adapter: str, path: str) -> EngineReply:
        self.calls.append(("load", adapter))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        changed = adapter not in self.loaded
        self.loaded.add(adapter)
        if changed:
            self.paths[adapter] = path
        return EngineReply(changed=changed)

    async def unload(self, url: str, replica: str, adapter: str) -> EngineReply:
        self.calls.append(("unload", adapter))
        changed = adapter in self.loaded
        self.loaded.discard(adapter)
        self.paths.pop(adapter, None)
        return EngineReply(changed=changed)


def adapter(name: str, **fields: Any) -> dict[str, Any]:
    """A catalog entry for ``BASE_MODEL`` owned by acme unless told otherwise."""
    entry: dict[str, Any] = {
        "name": name,
        "base_model": BASE_MODEL,
        "source": f"/adapters/acme/{name}",
        "rank": 8,
        "owners": ["acme"],
    }
    entry.update(fields)
    return entry


def make_policy(
    adapters: Sequence[dict[str, Any]],
    urls: Sequence[str] = ("http://127.0.0.1:9",),
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
) -> Policy:
    """A one-pool policy serving ``BASE_MODEL`` with tenants acme, globex and initech."""
    pool: dict[str, Any] = {"name": "pool-a", "replicas": list(urls)}
    if max_loras is not None:
        pool["max_loras"] = max_loras
    if max_cpu_loras is not None:
        pool["max_cpu_loras"] = max_cpu_loras
    # globex may use acme's "acme-shared" when the catalog has it (the policy checks the name).
    allowed = ["acme-shared"] if any(a["name"] == "acme-shared" for a in adapters) else []
    doc = {
        "version": 1,
        "replica_pools": [pool],
        "models": [{"name": BASE_MODEL, "pools": ["pool-a"]}],
        "tenants": [
            {"name": "acme"},
            {"name": "globex", "allowed_adapters": allowed},
            {"name": "initech"},
        ],
        "adapters": list(adapters),
    }
    return parse_policy(yaml.safe_dump(doc))


def replica(
    rid: str,
    url: str = "http://127.0.0.1:9",
    loaded: Sequence[str] = (),
    read_at: float = 0.0,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
) -> ReplicaState:
    """A replica state as the gateway's poller would build it."""
    return ReplicaState(
        replica_id=ReplicaId(rid),
        url=url,
        pool="pool-a",
        models=frozenset({BASE_MODEL}),
        loaded_adapters=frozenset(loaded),
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        metrics_read_at=read_at,
    )
