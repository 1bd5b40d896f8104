"""Engine priority on real sockets: with ``flow_control.engine_priority`` the gateway sends each
request's class as vLLM's ``priority`` (critical -1, standard 0, sheddable 1), replacing a
client's own; a simulated replica under ``scheduling_policy: priority`` serves them all, and an
engine left first-come-first-served refuses the non-zero ones as vLLM does.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from replica.sim.fleet import start_sim_fleet
from tests.integration.test_gateway_support import FakeUpstream, serve


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _policy(replica_url: str, engine_priority: bool, model: str) -> str:
    return f"""
version: 1
replica_pools:
  - name: pool-a
    replicas: [{replica_url}]
models:
  - name: {model}
    pools: [pool-a]
flow_control:
  engine_priority: {str(engine_priority).lower()}
tenants:
  - {{name: gold, api_key_sha256: [{_sha("gold")}], priority: critical}}
  - {{name: plain, api_key_sha256: [{_sha("plain")}]}}
  - {{name: bulk, api_key_sha256: [{_sha("bulk")}], priority: sheddable}}
  - {{name: chooser, api_key_sha256: [{_sha("chooser")}], allow_priority_header: true}}
"""


@contextlib.asynccontextmanager
async def _gateway(
    tmp_path: Path, replica_url: str, engine_priority: bool, model: str = "base-model"
) -> AsyncIterator[str]:
    """A gateway in front of ``replica_url`` (the fake upstream serves ``base-model``)."""
    path = tmp_path / "policy.yaml"
    path.write_text(_policy(replica_url, engine_priority, model))
    async with serve(create_app(GatewayConfig(policy_path=str(path)))) as url:
        yield url


async def _complete(
    http: aiohttp.ClientSession,
    url: str,
    key: str,
    path: str = "/v1/completions",
    model: str = "base-model",
    **extra: object,
) -> tuple[int, dict[str, object]]:
    if path == "/v1/completions":
        body: dict[str, object] = {"model": model, "prompt": "hello", "max_tokens": 2}
    else:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(extra)
    async with http.post(
        f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        return resp.status, await resp.json()


async def _priorities_sent(
    tmp_path: Path, engine_priority: bool, requests: list[tuple[str, str, dict[str, object]]]
) -> tuple[list[object], str]:
    """Send ``requests`` (tenant key, path, extra body fields) through a gateway in front of a
    fake engine; the ``priority`` of each body the engine received, and the gateway's metrics."""
    upstream = FakeUpstream()
    async with (
        serve(upstream.app()) as upstream_url,
        _gateway(tmp_path, upstream_url, engine_priority) as url,
        aiohttp.ClientSession() as http,
    ):
        for key, path, extra in requests:
            assert (await _complete(http, url, key, path, **extra))[0] == 200
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    return [body.get("priority") for body in upstream.received], metrics


async def test_each_class_reaches_the_engine_as_vllms_priority(tmp_path: Path) -> None:
    completion, chat = "/v1/completions", "/v1/chat/completions"
    sent, _ = await _priorities_sent(
        tmp_path,
        True,
        # The last one: a client's own priority is replaced (a tenant cannot raise its class).
        [("gold", completion, {}), ("plain", completion, {}), ("bulk", completion, {}),
         ("bulk", chat, {"priority": -100})],
    )
    assert sent == [-1, 0, 1, 1]


async def test_without_the_setting_only_a_tenant_that_chooses_its_priority_sends_its_own(
    tmp_path: Path,
) -> None:
    """Without ``engine_priority`` the gateway sets no priority, and a client's own reaches the
    engine only where its tenant may choose its priority (``allow_priority_header``): on an
    engine under priority scheduling anyone else could jump its queue with the body field."""
    completion, chat = "/v1/completions", "/v1/chat/completions"
    sent, metrics = await _priorities_sent(
        tmp_path,
        False,
        [("gold", completion, {}), ("bulk", completion, {"priority": -100}),
         ("plain", chat, {"priority": -1}), ("chooser", completion, {"priority": 3})],
    )
    assert sent == [None, None, None, 3]
    dropped = 'fleetgate_flow_priority_field_dropped_total{tenant="%s"} 1.0'
    assert dropped % "bulk" in metrics and dropped % "plain" in metrics
    assert 'fleetgate_flow_priority_field_dropped_total{tenant="chooser"}' not in metrics


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_a_simulated_engine_schedules_or_refuses_priorities_as_vllm(
    tmp_path: Path, policy: str
) -> None:
    async with start_sim_fleet(
        1, speed=100, kv_events=None, kv_replay=None,
        engine_overrides={"scheduling_policy": policy},
    ) as fleet:
        (replica_url,) = fleet.urls
        gateway = _gateway(tmp_path, replica_url, engine_priority=True, model="sim-model")
        async with gateway as url, aiohttp.ClientSession() as http:
            results = {
                key: await _complete(http, url, key, model="sim-model")
                for key in ("gold", "plain", "bulk")
            }
    assert results["plain"][0] == 200  # priority 0: vLLM's default, fine for either policy
    if policy == "priority":
        assert results["gold"][0] == results["bulk"][0] == 200
    else:
        for key in ("gold", "bulk"):
            status, body = results[key]
            assert status == 400
            assert "Priority scheduling is not enabled" in str(body)


async def test_a_priority_that_is_not_an_integer_is_a_400_from_the_engine() -> None:
    async with (
        start_sim_fleet(
            1, speed=100, kv_events=None, kv_replay=None,
            engine_overrides={"scheduling_policy": "priority"},
        ) as fleet,
        aiohttp.ClientSession() as http,
    ):
        (replica_url,) = fleet.urls
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 2, "priority": "high"}
        async with http.post(f"{replica_url}/v1/completions", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["param"] == "priority"
        assert "must be an integer" in error["message"]


async def test_without_tenants_the_clients_priority_passes(tmp_path: Path) -> None:
    # A gateway with no tenants has no one to keep apart: the field is the client's, as on
    # vLLM's own server (dropping it broke priority scheduling there: the diff review).
    from gateway.policy_view import GatewayPolicy, ReplicaSpec

    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        spec = ReplicaSpec("r0", upstream_url, models=frozenset(upstream.models))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        async with serve(app) as url, aiohttp.ClientSession() as http:
            assert (await _complete(http, url, "anyone", priority=2))[0] == 200
    assert [body.get("priority") for body in upstream.received] == [2]
