"""Helpers for the gateway acceptance tests (no tests here).

``redis_stack`` wires a fleet the way production does, in one process: simulated vLLM replicas
(``replica/sim``), one real ``ReplicaAgent`` per replica that reads the replica's ZMQ KV events
and writes the block index and the fleet registration into a real Redis, and a gateway app
(``gateway.app.create_app``, what ``fleetgate serve --redis`` builds) that reads both from Redis.
The gateway tokenizes like the sims (``SimPromptTokenizer``; ``--tokenizer DIR`` in production) so
its block hashes and the agents' agree. Every stack uses its own Redis key prefixes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy
from gateway.sim_tokenizer import SimPromptTokenizer
from gateway.state import GATEWAY, GatewayState
from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import RedisFleetStore
from replica.sim.driver import RequestStream
from replica.sim.fleet import SimFleet, SimReplicaHandle, start_sim_fleet
from replica.sim.server import SimReplica
from tests.integration.test_gateway_support import serve
from tests.support.polling import wait_until

MODEL = "sim-model"
ADMIN_KEY = "acceptance-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class RedisStack:
    """A running gateway + agents + sims over one Redis."""

    url: str
    fleet: SimFleet
    agents: list[ReplicaAgent]
    app: web.Application
    index_prefix: str
    fleet_prefix: str

    @property
    def gw(self) -> GatewayState:
        return self.app[GATEWAY]

    def replica_id(self, handle: SimReplicaHandle) -> str:
        return f"sim/{handle.index}"


@asynccontextmanager
async def redis_stack(
    redis_url: str,
    replicas: int,
    *,
    profile: str = "expected-ttft",
    engine_overrides: Mapping[str, Any] | None = None,
    policy_yaml: Callable[[str, str], str] | None = None,
    tmp_path: Path | None = None,
    speed: float = 1000.0,
    index_timeout_s: float = 0.5,
    index_url: str | None = None,
) -> AsyncIterator[RedisStack]:
    """Sims + one agent each (Redis index and fleet store) + a gateway reading both.

    ``policy_yaml(index_prefix, fleet_prefix)`` gives a policy file (written under ``tmp_path``)
    for policy mode; without it the gateway runs policy-less, as ``fleetgate serve --redis``.
    ``index_timeout_s``: the lookup budget past which a decision degrades to load only. The
    production default (20 ms) is a latency bound that a starved 2-core test machine misses now
    and then; these tests measure routing, so they give lookups room (policy mode: set
    ``index.lookup_timeout_ms`` in the file). ``index_url``: the block index's own Redis (a
    Cluster's ``redis+cluster://`` URL, policy-less mode); the fleet store stays on ``redis_url``.
    """
    tag = uuid.uuid4().hex[:8]
    index_prefix = f"fgacc-{tag}"  # the index's prefix is a Redis hash tag: no ':'
    fleet_prefix = f"fgacc:{tag}:"
    async with AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            start_sim_fleet(replicas, model=MODEL, speed=speed, engine_overrides=engine_overrides)
        )
        agents = []
        for handle in fleet.replicas:
            agent = ReplicaAgent(
                AgentConfig(
                    replica_id=f"sim/{handle.index}",
                    engine_url=handle.url,
                    pool="pool-a",
                    model=MODEL,
                    kv_events_endpoint=handle.kv_events_endpoint,
                    replay_endpoint=handle.kv_replay_endpoint,
                    index_url=index_url or redis_url,
                    fleet_url=redis_url,
                    index_key_prefix=index_prefix,
                    fleet_key_prefix=fleet_prefix,
                    # Registrations outlive a starved event loop on a busy 2-core test machine.
                    heartbeat_ttl_s=10.0,
                    listen_port=None,
                )
            )
            agents.append(await stack.enter_async_context(agent))
        registry = RedisFleetStore(redis_url, key_prefix=fleet_prefix)
        stack.push_async_callback(registry.close)
        await eventually(
            lambda: _registered(registry, replicas), "every agent registered its replica"
        )
        if policy_yaml is None:
            config = GatewayConfig(
                default_profile=profile,
                redis_url=redis_url,
                index_redis_url=index_url,
                index_key_prefix=index_prefix,
                admin_key=ADMIN_KEY,
                health_interval_s=0.25,
                index_timeout_s=index_timeout_s,
            )
            app = create_app(
                config,
                GatewayPolicy.default(profile=profile),
                tokenizer=SimPromptTokenizer(),
                fleet_store=registry,
            )
        else:
            assert tmp_path is not None
            path = tmp_path / f"policy-{tag}.yaml"
            path.write_text(policy_yaml(index_prefix, fleet_prefix))
            config = GatewayConfig(policy_path=str(path), policy_poll_s=0, admin_key=ADMIN_KEY)
            app = create_app(config, tokenizer=SimPromptTokenizer())
            config.health_interval_s = 0.25
        url = await stack.enter_async_context(serve(app, handler_cancellation=True))
        yield RedisStack(url, fleet, agents, app, index_prefix, fleet_prefix)


async def _registered(registry: RedisFleetStore, count: int) -> bool:
    return len(await registry.list_replicas()) >= count


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 15.0
) -> None:
    """Poll ``predicate`` (bounded) until it holds; fail naming ``what`` at the deadline."""
    await wait_until(predicate, what, timeout_s, interval_s=0.02)


@asynccontextmanager
async def hang_guard(what: str, limit_s: float = 60.0) -> AsyncIterator[None]:
    """Fail (naming ``what`` and printing every task's stack) instead of hanging the run.

    A guard against deadlocks, not a latency assertion: the limit is far above normal runs.
    """
    try:
        async with asyncio.timeout(limit_s):
            yield
    except TimeoutError:
        for task in asyncio.all_tasks():
            task.print_stack(limit=12)
        raise AssertionError(f"{what}: still not done after {limit_s} s (stacks above)") from None


# --------------------------------------------------------------------------- metrics


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in a Prometheus text page whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def get_metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return metric_sum(await resp.text(), name, **labels)


@dataclass
class PrefixCounters:
    """The engines' own prefix-cache counters (tokens), summed over replicas."""

    queries: float = 0.0
    hits: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def __sub__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries - other.queries, self.hits - other.hits)


async def engine_prefix_counters(http: aiohttp.ClientSession, urls: list[str]) -> PrefixCounters:
    """``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` from each /metrics."""
    total = PrefixCounters()
    for url in urls:
        total.queries += await get_metric(http, url, "vllm:prefix_cache_queries_total")
        total.hits += await get_metric(http, url, "vllm:prefix_cache_hits_total")
    return total


async def decisions(http: aiohttp.ClientSession, url: str, n: int) -> list[dict[str, Any]]:
    """The gateway's last ``n`` routing decisions, newest last."""
    async with http.get(f"{url}/admin/decisions?n={n}", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        found: list[dict[str, Any]] = (await resp.json())["decisions"]
    return sorted(found, key=lambda d: d["at"])


# --------------------------------------------------------------------------- client side


def client_session() -> aiohttp.ClientSession:
    """A client whose requests fail (rather than hang the run) if an answer never comes."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))


@dataclass
class ClientResult:
    """What one client saw: status, whether any data event reached it, and whether it failed."""

    request_id: str
    status: int
    data_events: int = 0
    #: The failure (HTTP status or in-band error event), None if the request succeeded.
    error: str | None = None
    #: Data events the client had received before the failure.
    events_before_error: int = 0
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


async def post_and_read(
    http: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> ClientResult:
    """POST a completion and read all of it, streaming or not, recording what the client saw."""
    sent_headers = {"X-Request-Id": request_id, **(headers or {})}
    async with http.post(f"{url}{path}", json=body, headers=sent_headers) as resp:
        result = ClientResult(request_id, resp.status)
        if not body.get("stream"):
            payload = await resp.json(content_type=None)
            if resp.status != 200:
                result.error = f"HTTP {resp.status} {payload.get('error', {}).get('code')}"
                return result
            details = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
            return result
        if resp.status != 200:
            result.error = f"HTTP {resp.status}"
            return result
        done = False
        try:
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.error = f"in-band {event['error'].get('code')}"
                    result.events_before_error = result.data_events
                    return result
                result.data_events += 1
        except aiohttp.ClientPayloadError as exc:
            result.error = f"stream cut: {type(exc).__name__}"
            result.events_before_error = result.data_events
            return result
        if not done:
            result.error = "stream ended without [DONE]"
            result.events_before_error = result.data_events
        return result


def chat_body(messages: list[dict[str, str]], max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}


# --------------------------------------------------------------------------- replica control


@dataclass
class TokenGate:
    """Holds one sim's requests before they hand out tokens, to kill the replica at a known point.

    The engine still schedules and computes; only the HTTP handler waits. A request whose id is
    in ``after_first`` gets its first batch of tokens (a streaming client sees a data event),
    then waits; every other request waits before its first token.
    """

    after_first: set[str]
    held: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def install(self, replica: SimReplica) -> None:
        submit = replica.driver.submit

        def gated_submit(*args: Any, **kwargs: Any) -> RequestStream:
            stream = submit(*args, **kwargs)
            self._wrap(stream)
            return stream

        replica.driver.submit = gated_submit  # type: ignore[method-assign]

    def _wrap(self, stream: RequestStream) -> None:
        next_tokens = stream.next_tokens
        calls = 0

        # The engine's id is the gateway's with a suffix of its own (request_body.py,
        # engine_request_id): the test names requests by the gateway's.
        request_id = stream.request_id.rsplit("~", 1)[0]

        async def gated() -> list[int]:
            nonlocal calls
            calls += 1
            hold_at = 2 if request_id in self.after_first else 1
            if calls == hold_at and not self.release.is_set():
                self.held.append(request_id)
                self.changed.set()
                await self.release.wait()
            return await next_tokens()

        stream.next_tokens = gated  # type: ignore[method-assign]


async def kill_replica(handle: SimReplicaHandle) -> None:
    """What the network sees when an engine process dies (kill -9): the port stops accepting
    and every open connection is closed at once, mid-request or not."""
    for site in list(handle.runner.sites):
        await site.stop()
    server = handle.runner.server
    assert server is not None
    for connection in list(server.connections):
        if connection.transport is not None:
            connection.transport.abort()
