"""Shared builders for the adapter-registry tests (no tests here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from routing.config import Policy, parse_policy
from routing.state import ReplicaState
from routing.types import ReplicaId

BASE_MODEL = "sim-model"


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
