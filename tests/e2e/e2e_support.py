"""Helpers for the gateway end-to-end tests on real vLLM engines (no tests here).

``gateway_stack`` wires production in one process around the session's two real engines: one
``ReplicaAgent`` per engine (KV events → the Redis block index, scrapes → the Redis fleet store),
and the gateway app (``gateway.app.create_app``, what ``fleetgate serve --config`` builds) with a
policy file that discovers the replicas in Redis, tokenizes with the tiny model's own tokenizer
and manages the LoRA adapters. Every stack uses its own Redis key prefixes.

``E2EResults`` collects the measured numbers for docs/benchmarks/e2e-vllm.md.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import GATEWAY, GatewayState
from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import RedisFleetStore
from replica.launcher import VllmEngine
from replica.tiny_model import TinyModel
from routing.index import MirrorBlockIndex
from tests.integration.test_gateway_support import serve
from tests.support.polling import wait_until

SERVED_MODEL = "tiny"
BLOCK_SIZE = 32
ADMIN_KEY = "e2e-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
POOL = "cpu"
#: Tenants of the policy and their API keys.
TENANTS = ("alpha", "beta", "gamma")
#: Tenants with a request class: the engines schedule by priority and the gateway sends each
#: request's class as vLLM's ``priority`` (``flow_control.engine_priority``).
CLASSED_TENANTS = {"urgent": "critical", "batch": "sheddable"}
#: Requests with this header value take the round-robin route (the baseline).
RR_HEADER = {"X-Fleetgate-Workload": "rr"}
REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_PATH = REPO_ROOT / "docs" / "benchmarks" / "e2e-vllm.md"

_unique = itertools.count()


def api_key(tenant: str) -> str:
    return f"{tenant}-e2e-key"


def replica_id(i: int) -> str:
    return f"{POOL}/r{i}"


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 30.0
) -> None:
    """Poll ``predicate`` (bounded) until it holds; fail naming ``what`` at the deadline."""
    await wait_until(predicate, what, timeout_s=timeout_s, interval_s=0.05)


# --------------------------------------------------------------------------- the policy


def policy_yaml(
    redis_url: str, index_prefix: str, fleet_prefix: str, tiny_model: TinyModel
) -> str:
    def sha(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    tenants = "".join(
        f"  - name: {t}\n    api_key_sha256: [{sha(api_key(t))}]\n" for t in TENANTS
    ) + "".join(
        f"  - name: {t}\n    api_key_sha256: [{sha(api_key(t))}]\n    priority: {c}\n"
        for t, c in CLASSED_TENANTS.items()
    )
    adapters = "".join(
        f"  - name: {name}\n    base_model: {SERVED_MODEL}\n    source: {path}\n"
        f"    rank: 8\n    size_mb: 1\n    public: true\n"
        for name, path in sorted(tiny_model.adapters.items())
    )
    return f"""
version: 1
replica_pools:
  - name: {POOL}
    discovery: {{redis_url: "{redis_url}", key_prefix: "{fleet_prefix}"}}
    block_size: {BLOCK_SIZE}
    max_loras: 2
    max_cpu_loras: 4
models:
  - name: {SERVED_MODEL}
    tokenizer: {{kind: local, path: "{tiny_model.model_dir}"}}
    pools: [{POOL}]
adapters:
{adapters}tenants:
{tenants}index:
  backend: redis
  redis_url: "{redis_url}"
  key_prefix: "{index_prefix}"
  # The 2-core test machine also runs two engines: 20 ms (the default) is often too short.
  lookup_timeout_ms: 500
flow_control:
  # The engines run --scheduling-policy priority (tests/e2e/conftest.py).
  engine_priority: true
gateway:
  # The health poll's timeout is max(0.5 s, this interval); one timed-out poll marks a replica
  # unhealthy. 0.5 s is too short for a busy engine on this loaded 2-core machine.
  health_check_interval_s: 2.0
routes:
  - name: rr
    match:
      headers:
        - {{name: X-Fleetgate-Workload, value: rr}}
    profile: round-robin
  # No profile: the default one (routing.policies.registry.DEFAULT_PROFILE), what a user gets.
  - name: main
    match:
      path_prefix: /v1/
"""


# --------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    """The gateway, its URL, the agents and engines behind it, and a reader of the index."""

    url: str
    app: web.Application
    engines: list[VllmEngine]
    agents: list[ReplicaAgent]
    index: MirrorBlockIndex
    http: httpx.AsyncClient
    clients: dict[str, openai.AsyncOpenAI] = field(default_factory=dict)
    #: Client tasks a test started; cancelled before the gateway stops (a failed test may
    #: leave requests in flight, and the gateway would wait for them).
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    @property
    def gw(self) -> GatewayState:
        return self.app[GATEWAY]

    def client(self, tenant: str = "alpha") -> openai.AsyncOpenAI:
        if tenant not in self.clients:
            self.clients[tenant] = openai.AsyncOpenAI(
                base_url=f"{self.url}/v1", api_key=api_key(tenant), max_retries=0, timeout=120
            )
        return self.clients[tenant]

    def engine_index(self, rid: str) -> int:
        return int(rid.rsplit("r", 1)[1])

    async def decisions(self) -> dict[str, dict[str, Any]]:
        """Every logged routing decision, by request id."""
        resp = await self.http.get(f"{self.url}/admin/decisions?n=100000", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        return {d["request_id"]: d for d in resp.json()["decisions"]}

    async def gateway_metric(self, name: str, **labels: str) -> float:
        return metric_sum((await self.http.get(f"{self.url}/metrics")).text, name, **labels)

    async def engine_counters(self) -> list[PrefixCounters]:
        """Each engine's own ``vllm:prefix_cache_queries_total`` / ``…hits_total``."""
        out = []
        for engine in self.engines:
            text = (await self.http.get(f"{engine.url}/metrics")).text
            out.append(
                PrefixCounters(
                    metric_sum(text, "vllm:prefix_cache_queries_total"),
                    metric_sum(text, "vllm:prefix_cache_hits_total"),
                )
            )
        return out

    async def idle(self) -> bool:
        """No request runs or waits on any engine (by its own gauges), and the gateway's view of
        every replica says so too (its figures come from the agents' scrapes, a moment later).

        The engines live for the whole session: a request an earlier test left running, or a
        gauge the gateway read while one ran, would make this test's first decisions avoid that
        replica, and a routing test would measure the previous test instead of the router.
        """
        for engine in self.engines:
            text = (await self.http.get(f"{engine.url}/metrics")).text
            if metric_sum(text, "vllm:num_requests_running") or metric_sum(
                text, "vllm:num_requests_waiting"
            ):
                return False
        for i in range(len(self.engines)):
            state = self.gw.registry.get(replica_id(i))
            if state is None or state.running or state.waiting or state.inflight_requests:
                return False
        return True

    async def replicas_view(self) -> dict[str, dict[str, Any]]:
        resp = await self.http.get(f"{self.url}/admin/replicas", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        items = body.get("replicas", body) if isinstance(body, dict) else body
        if isinstance(items, dict):
            return {str(k): v for k, v in items.items()}
        return {str(r.get("replica_id") or r.get("id")): r for r in items}

    async def routable(self, rids: Sequence[str]) -> bool:
        """The gateway knows every replica in ``rids`` and counts it healthy."""
        view = await self.replicas_view()
        return all(
            rid in view and _healthy(view[rid]) for rid in rids
        )


def _healthy(entry: dict[str, Any]) -> bool:
    state = entry.get("state", entry)
    circuit = str(entry.get("circuit", "closed"))
    return bool(state.get("healthy", True)) and circuit in ("closed", "half_open", "half-open")


@dataclass
class PrefixCounters:
    """An engine's prefix-cache counters, in prompt tokens."""

    queries: float = 0.0
    hits: float = 0.0

    def __sub__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries - other.queries, self.hits - other.hits)

    def __add__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries + other.queries, self.hits + other.hits)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def total(counters: Sequence[PrefixCounters]) -> PrefixCounters:
    out = PrefixCounters()
    for c in counters:
        out = out + c
    return out


def delta(after: Sequence[PrefixCounters], before: Sequence[PrefixCounters]) -> PrefixCounters:
    return total([a - b for a, b in zip(after, before, strict=True)])


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in a Prometheus text page whose labels include ``labels``."""
    out = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            out += float(line.rsplit(" ", 1)[1])
    return out


async def engine_adapters(http: httpx.AsyncClient, engine: VllmEngine) -> set[str]:
    """Adapters an engine lists in its ``/v1/models`` (those with a ``parent``)."""
    models = (await http.get(f"{engine.url}/v1/models")).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


async def _sync_agent(agent: ReplicaAgent, engine: VllmEngine) -> None:
    """Send fresh prompts to the engine until the agent has applied one of its event batches
    (a ZMQ subscriber misses what is published before it has joined)."""
    start = agent.batches_applied
    async with openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused") as client:

        async def received() -> bool:
            await client.completions.create(
                model=SERVED_MODEL, prompt=fresh_text(40), max_tokens=1, temperature=0
            )
            await asyncio.sleep(0.05)
            return agent.batches_applied > start

        await eventually(received, f"agent {agent.replica} receives its engine's KV events")


def fresh_text(words: int) -> str:
    tag = f"sync {next(_unique)} {time.time_ns()} "
    return tag + " ".join(["every replica of the fleet keeps its prefix cache"] * (words // 8))


@asynccontextmanager
async def gateway_stack(
    redis_url: str, engines: list[VllmEngine], tiny_model: TinyModel, tmp_dir: Path
) -> AsyncIterator[Stack]:
    """Agents for the engines + the gateway in policy mode over one Redis, fresh key prefixes."""
    tag = uuid.uuid4().hex[:8]
    index_prefix = f"fge2e-{tag}"  # a Redis hash tag: no ':'
    fleet_prefix = f"fge2e:{tag}:"
    async with AsyncExitStack() as stack:
        agents = []
        for i, engine in enumerate(engines):
            agent = ReplicaAgent(
                AgentConfig(
                    replica_id=replica_id(i),
                    engine_url=engine.url,
                    pool=POOL,
                    model=SERVED_MODEL,
                    kv_events_endpoint=engine.spec.subscriber_endpoint,
                    replay_endpoint=engine.spec.replay_endpoint,
                    index_url=redis_url,
                    fleet_url=redis_url,
                    index_key_prefix=index_prefix,
                    fleet_key_prefix=fleet_prefix,
                    max_cpu_loras=engine.spec.max_cpu_loras,
                    listen_port=None,
                )
            )
            agents.append(
                await stack.enter_async_context(bounded(agent, f"stopping agent {i}"))
            )
        for agent, engine in zip(agents, engines, strict=True):
            await _sync_agent(agent, engine)
        registry = RedisFleetStore(redis_url, key_prefix=fleet_prefix)
        stack.push_async_callback(registry.close)

        async def registered() -> bool:
            return len(await registry.list_replicas()) >= len(engines)

        await eventually(registered, "every agent registered its replica")
        path = tmp_dir / f"policy-{tag}.yaml"
        path.write_text(policy_yaml(redis_url, index_prefix, fleet_prefix, tiny_model))
        config = GatewayConfig(
            policy_path=str(path),
            policy_poll_s=0,
            admin_key=ADMIN_KEY,
            adapter_key_prefix=f"fge2e:{tag}:",
            adapter_prewarm_interval_s=None,
            decision_log_size=5000,
        )
        # The gateway's index, shared with the test's checks. Its per-call timeout is 1 s, not
        # the backend's 0.1 s default: this 2-core machine also runs both engines, and a timed-out
        # lookup routes on load alone (by design), which would measure the machine, not routing.
        # The default index mode, as the agents write it: the gateway's in-process mirror.
        index = MirrorBlockIndex(redis_url, key_prefix=index_prefix, timeout_s=1.0)
        stack.push_async_callback(index.close)
        await index.start()
        app = create_app(config, index=index)
        url = await stack.enter_async_context(
            bounded(serve(app, handler_cancellation=True), "stopping the gateway")
        )
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
        result = Stack(url, app, engines, agents, index, http)
        await eventually(
            lambda: result.routable([replica_id(i) for i in range(len(engines))]),
            "the gateway routes to both replicas",
        )
        await eventually(
            result.idle,
            "both engines idle and the gateway's view of them caught up (a request from an "
            "earlier test still running?)",
            timeout_s=60,
        )
        try:
            yield result
        finally:
            for task in result.tasks:
                task.cancel()
            await asyncio.gather(*result.tasks, return_exceptions=True)
            for client in result.clients.values():
                await client.close()


@asynccontextmanager
async def bounded(cm: Any, what: str, timeout_s: float = 30.0) -> AsyncIterator[Any]:
    """Enter ``cm``; its exit must finish within ``timeout_s``, else every pending task's stack
    is printed and the teardown fails (instead of hanging the session)."""
    value = await cm.__aenter__()
    try:
        yield value
    finally:
        try:
            await asyncio.wait_for(cm.__aexit__(None, None, None), timeout_s)
        except TimeoutError:
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    print(f"--- pending task {task.get_name()}:")
                    task.print_stack()
            raise AssertionError(f"{what} took longer than {timeout_s} s") from None


# --------------------------------------------------------------------------- results


@dataclass
class E2EResults:
    """Measured numbers by section, rendered as docs/benchmarks/e2e-vllm.md."""

    sections: dict[str, list[str]] = field(default_factory=dict)
    #: Sections of a full run (one per test of test_e2e_gateway_vllm.py).
    expected_sections: int = 5
    started: float = field(default_factory=time.monotonic)

    def record(self, section: str, *lines: str) -> None:
        self.sections.setdefault(section, []).extend(lines)
        print(f"\n[{section}]\n" + "\n".join(lines))

    def render(self) -> str:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        out = [
            "# End-to-end on real vLLM CPU engines: measured numbers",
            "",
            f"Written by the e2e test run of {now} (tests/e2e/test_e2e_gateway_vllm.py, "
            "collector in tests/e2e/e2e_support.py). Command:",
            "",
            "```bash",
            "bash replica/vllm_env/install.sh && .venv/bin/pytest tests/e2e -m e2e -s",
            "```",
            "",
            "Setup: two vLLM 0.32.0 CPU engines (tiny Llama built by the tests, block size 32, "
            "`--max-model-len 2048`, `--num-gpu-blocks-override 112`, `--max-loras 2 "
            "--max-cpu-loras 4`), one `ReplicaAgent` per engine feeding a Redis block index and "
            "fleet store, the gateway app in policy mode (local tokenizer, adapter registry), "
            "the official `openai` client. Hit rates are vLLM's own "
            "`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` deltas summed "
            "over both engines; cached tokens are the engines' "
            "`usage.prompt_tokens_details.cached_tokens`. 2-core shared machine: timings are "
            "indicative only.",
            "",
        ]
        for section, lines in self.sections.items():
            out += [f"## {section}", "", *lines, ""]
        return "\n".join(out)

    def write(self, path: Path = RESULTS_PATH) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.render())
        return path
