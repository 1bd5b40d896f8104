"""What the chaos benchmark measures: the open-loop load, the fleet monitor, the index truth.

- ``OpenLoopLoad``: Poisson arrivals at a fixed rate, half streamed, two tenants, spread over
  both gateways; one ``RequestRecord`` per request. A gateway that refuses the connection (it is
  dead) is skipped for the other one, as a load balancer does; nothing was sent, so this is safe.
- ``Monitor``: every ``interval_s`` each gateway's ``/admin/replicas`` and ``/metrics`` and each
  agent's ``/health``; every second the gateways' decision logs, to learn which replica served
  which request (the client sets ``X-Request-Id``; the log's ``served_by`` names the replica).
- ``IndexTruth``: one KV-event subscriber per engine, next to the agent's, applying the same
  events with the agent's own ``EventApplier`` to a set: the blocks each engine holds now. An
  index entry that a lookup would return for a replica whose engine does not hold the block is
  *stale* (``index_snapshot``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import redis.asyncio
from prometheus_client import CollectorRegistry

from bench._bench_common import HOST, words
from bench.chaos_fleet import ADMIN_KEY, TENANT_KEYS, Fleet
from replica.agent.ingest import EventApplier
from replica.agent.metrics import AgentMetrics
from replica.kv_events import KVEventSubscriber
from routing.index.factory import DEFAULT_INDEX_MODE
from routing.index.stream_layout import StreamLayout
from routing.index.stream_writer import unpack_blocks
from routing.types import BlockHash, Epoch, ReplicaId

#: Outcomes of one request, as the client saw it.
OK = "ok"
FAILED_BEFORE_FIRST_BYTE = "failed_before_first_byte"
BROKEN_MID_STREAM = "broken_mid_stream"
NOT_SENT = "not_sent"

_ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
_CONNECT_ERRORS = (aiohttp.ClientConnectorError,)


# --------------------------------------------------------------------------- load


@dataclass
class RequestRecord:
    """One request. Times are seconds since the benchmark's start (``clock``)."""

    request_id: str
    gateway: int
    tenant: str
    stream: bool
    start: float
    first_byte: float | None = None
    end: float | None = None
    status: int = 0
    outcome: str = NOT_SENT
    error: str = ""
    #: The first gateway refused the connection; the request went to the other one.
    failover: bool = False
    served_by: str | None = None


@dataclass
class LoadConfig:
    rate: float
    max_tokens: int = 24
    #: Client-side bound on one request (a hung replica answers when resumed, within this).
    timeout_s: float = 30.0
    max_inflight: int = 2000
    seed: int = 0
    #: Share of requests that open a new conversation: a system prompt nobody has sent before,
    #: so no replica holds any of it. Real traffic has them, and they are what routing places by
    #: load alone; without them a lightly loaded fleet keeps every known prefix on the replicas
    #: that already hold it, and a restarted (empty) replica is rightly never chosen.
    novel_share: float = 0.1


class Clock:
    """Seconds since the benchmark started (monotonic)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


def _prompt(rng: random.Random, tenant: str, novel: bool = False) -> list[dict[str, str]]:
    """One of four shared system prompts per tenant + a fresh user turn (index entries grow);
    ``novel``: a system prompt of its own instead, which no replica has cached."""
    if novel:
        system = f"You are assistant {rng.getrandbits(64):x} of {tenant}. " + words(rng, 60)
    else:
        system = f"You are assistant {rng.randrange(4)} of {tenant}. " + words(random.Random(7), 60)
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": words(rng, 12)},
    ]


class OpenLoopLoad:
    """Sends requests at Poisson arrival times until ``stop()``; never waits for answers."""

    def __init__(self, fleet: Fleet, config: LoadConfig, clock: Clock) -> None:
        self.fleet = fleet
        self.config = config
        self.clock = clock
        self.records: list[RequestRecord] = []
        self._rng = random.Random(config.seed)
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        #: Per gateway, what the load balancer's readiness probe last saw (``/ready``); set
        #: when the run starts (the fleet's gateways exist by then).
        self.ready: list[bool] = []

    def stop(self) -> None:
        self._stopping = True

    async def _probe_ready(self, session: aiohttp.ClientSession, max_s: float) -> None:
        """A load balancer's readiness probe: ``/ready`` of each gateway every 0.5 s."""
        started = self.clock()
        timeout = aiohttp.ClientTimeout(total=1.0)
        while not self._stopping and self.clock() - started < max_s:
            for i, gateway in enumerate(self.fleet.gateways):
                try:
                    async with session.get(gateway.url + "/ready", timeout=timeout) as resp:
                        self.ready[i] = resp.status == 200
                except (aiohttp.ClientError, OSError, TimeoutError):
                    self.ready[i] = False
            await asyncio.sleep(0.5)

    async def run(self, max_s: float) -> None:
        """Arrivals until ``stop()`` or ``max_s``; then waits (bounded) for the last answers."""
        self.ready = [True] * len(self.fleet.gateways)
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            probe = asyncio.create_task(self._probe_ready(session, max_s))
            started = self.clock()
            next_at = started
            while not self._stopping and self.clock() - started < max_s:
                next_at += self._rng.expovariate(self.config.rate)
                await asyncio.sleep(max(0.0, next_at - self.clock()))
                self._launch(session)
            self._stopping = True
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=self.config.timeout_s + 5)
            await probe

    def _launch(self, session: aiohttp.ClientSession) -> None:
        rng = self._rng
        tenant = rng.choice(sorted(TENANT_KEYS))
        ready = [i for i, ok in enumerate(self.ready) if ok] or list(range(len(self.ready)))
        record = RequestRecord(
            request_id=f"chaos-{len(self.records)}", gateway=rng.choice(ready), tenant=tenant,
            stream=rng.random() < 0.5, start=self.clock(),
        )
        self.records.append(record)
        if len(self._tasks) >= self.config.max_inflight:
            record.error = "client in-flight bound reached"
            return
        novel = rng.random() < self.config.novel_share
        body = {"model": self.fleet.engine.model, "messages": _prompt(rng, tenant, novel),
                "max_tokens": self.config.max_tokens, "stream": record.stream}
        task = asyncio.create_task(self._send(session, record, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(
        self, session: aiohttp.ClientSession, record: RequestRecord, body: dict
    ) -> None:
        headers = {"Authorization": f"Bearer {TENANT_KEYS[record.tenant]}",
                   "X-Request-Id": record.request_id}
        try:
            try:
                await self._attempt(session, record, body, headers)
            except _CONNECT_ERRORS:
                # Connection refused: nothing was sent, so the other gateway may take it.
                record.failover = True
                record.gateway = (record.gateway + 1) % len(self.fleet.gateways)
                await self._attempt(session, record, body, headers)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:200]
            got_first = record.first_byte is not None and record.status == 200
            record.outcome = BROKEN_MID_STREAM if got_first else FAILED_BEFORE_FIRST_BYTE
        record.end = self.clock()

    async def _attempt(
        self, session: aiohttp.ClientSession, record: RequestRecord, body: dict,
        headers: dict[str, str],
    ) -> None:
        url = self.fleet.gateways[record.gateway].url + "/v1/chat/completions"
        record.outcome = FAILED_BEFORE_FIRST_BYTE
        async with session.post(url, json=body, headers=headers) as resp:
            record.status = resp.status
            record.first_byte = self.clock()
            if resp.status != 200:
                record.error = (await resp.text())[:200]
                return
            if record.stream:
                await _read_stream(resp)
            else:
                payload = await resp.json()
                if not payload.get("choices"):
                    raise ValueError("answer without choices")
            record.outcome = OK


async def _read_stream(resp: aiohttp.ClientResponse) -> None:
    """Read an SSE stream to ``data: [DONE]``; a stream that ends before it is broken."""
    async for line in resp.content:
        if line.strip() == b"data: [DONE]":
            return
    raise ValueError("stream ended before data: [DONE]")


# --------------------------------------------------------------------------- monitor


@dataclass
class ReplicaView:
    healthy: bool
    circuit: str
    #: Requests this gateway counts in flight there (a leak would hold a healed replica back).
    inflight: int = 0


@dataclass
class GatewaySample:
    """One gateway at one moment; ``up`` False when it did not answer."""

    t: float
    gateway: int
    up: bool
    replicas: dict[str, ReplicaView] = field(default_factory=dict)
    degraded_total: float = 0.0
    index_errors_total: float = 0.0
    retries_total: float = 0.0
    requests_total: float = 0.0


@dataclass
class AgentSample:
    t: float
    replica: str
    up: bool
    epoch: int = 0
    dirty: bool = False
    engine_up: bool = False


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total


class Monitor:
    """Samples gateways and agents until stopped; every loop is bounded by ``max_s``."""

    def __init__(self, fleet: Fleet, clock: Clock, interval_s: float = 0.5) -> None:
        self.fleet = fleet
        self.clock = clock
        self.interval_s = interval_s
        self.gateway_samples: list[GatewaySample] = []
        self.agent_samples: list[AgentSample] = []
        #: request id -> replica that served it (from the gateways' decision logs).
        self.served_by: dict[str, str] = {}
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True

    async def run(self, max_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s * 2))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            started = self.clock()
            last_decisions = -1.0
            while not self._stopping and self.clock() - started < max_s:
                tick = self.clock()
                jobs = [self._gateway(session, i) for i in range(len(self.fleet.gateways))]
                jobs += [self._agent(session, r.replica_id, r.agent_url)
                         for r in self.fleet.replicas]
                if tick - last_decisions >= 1.0:
                    last_decisions = tick
                    jobs += [self._decisions(session, g.url) for g in self.fleet.gateways]
                await asyncio.gather(*jobs)
                await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - tick)))

    async def _gateway(self, session: aiohttp.ClientSession, index: int) -> None:
        url = self.fleet.gateways[index].url
        sample = GatewaySample(t=self.clock(), gateway=index, up=False)
        try:
            async with session.get(url + "/admin/replicas", headers=_ADMIN) as resp:
                listing = await resp.json()
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            self.gateway_samples.append(sample)
            return
        sample.up = True
        sample.replicas = {
            r["replica_id"]: ReplicaView(bool(r["healthy"]), str(r["circuit"]),
                                         int(r.get("inflight_requests") or 0))
            for r in listing.get("replicas", [])
        }
        sample.degraded_total = _metric_sum(text, "fleetgate_degraded_decisions_total")
        sample.index_errors_total = _metric_sum(text, "fleetgate_index_errors_total")
        sample.retries_total = _metric_sum(text, "fleetgate_upstream_retries_total")
        sample.requests_total = _metric_sum(text, "fleetgate_requests_total")
        self.gateway_samples.append(sample)

    async def _agent(self, session: aiohttp.ClientSession, replica: str, url: str) -> None:
        sample = AgentSample(t=self.clock(), replica=replica, up=False)
        try:
            async with session.get(url + "/health") as resp:
                health = await resp.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            self.agent_samples.append(sample)
            return
        sample.up = True
        sample.epoch = int(health.get("epoch") or 0)
        sample.dirty = bool(health.get("index_dirty"))
        sample.engine_up = bool(health.get("engine_up"))
        self.agent_samples.append(sample)

    async def _decisions(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            async with session.get(url + "/admin/decisions?n=200", headers=_ADMIN) as resp:
                text = await resp.text()
            entries = json.loads(text).get("decisions", [])
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return
        for entry in entries:
            served = entry.get("served_by")
            if served and entry.get("request_id"):
                self.served_by[entry["request_id"]] = served


# --------------------------------------------------------------------------- index truth


class _TruthSet:
    """The part of the ``BlockIndex`` protocol ``EventApplier`` calls: a set per epoch.

    A new epoch (engine restart, ``AllBlocksCleared``) starts empty, as the engine's cache does.
    """

    def __init__(self) -> None:
        self.blocks: set[BlockHash] = set()
        self.epoch: Epoch | None = None

    async def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.blocks = set()

    async def retire_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        self.blocks = set()

    async def record(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash],
                     ttl_s: float | None = None) -> None:
        self.blocks.update(blocks)

    async def remove(self, replica: ReplicaId, epoch: Epoch, blocks: Sequence[BlockHash]) -> None:
        self.blocks.difference_update(blocks)


class EngineTruth:
    """What one engine's KV cache holds, from its own KV events (a second subscriber)."""

    def __init__(self, replica_id: str, endpoint: str, model: str) -> None:
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.truth = _TruthSet()
        metrics = AgentMetrics(replica_id, registry=CollectorRegistry())
        self.applier = EventApplier(self.truth, ReplicaId(replica_id), metrics, model=model)
        self.expected_seq: int | None = None
        #: Sequence gaps seen: after one the truth may miss events (reported, never guessed).
        self.gaps = 0
        self._task: asyncio.Task[None] | None = None
        self._sub: KVEventSubscriber | None = None

    async def start(self) -> None:
        await self.applier.start()
        self._sub = KVEventSubscriber(self.endpoint)
        self._task = asyncio.create_task(self._follow())

    async def engine_gone(self) -> None:
        """The benchmark killed the engine: its cache is gone with it."""
        self.expected_seq = None
        await self.applier.new_epoch("restart", forget_hashes=True)

    async def _follow(self) -> None:
        assert self._sub is not None
        async for seq, batch in self._sub:
            if self.expected_seq is not None and seq < self.expected_seq:
                await self.applier.new_epoch("restart", forget_hashes=True)
            elif self.expected_seq is not None and seq > self.expected_seq:
                self.gaps += 1
            self.expected_seq = seq + 1
            await self.applier.apply_batch(batch)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                self._sub.close()


@dataclass
class IndexSnapshot:
    """The Redis index against the engines' truth, at one moment."""

    t: float
    block_keys: int
    #: (replica, block) entries a lookup would return that the replica's engine does not hold.
    stale: set[tuple[str, int]] = field(default_factory=set)
    #: Blocks an engine holds that the index does not list for it (lost entries: cold, not wrong).
    missing: int = 0
    #: Confirmed entries of dead incarnations still in block keys (match nothing; expire by TTL).
    dead_entries: int = 0
    live_replicas: int = 0


def _slots(bitset: bytes) -> list[int]:
    """Slot numbers set in a block value's confirmed bitset (Redis SETBIT order)."""
    out = []
    for i, byte in enumerate(bitset):
        for k in range(8):
            if byte & (0x80 >> k):
                out.append(i * 8 + k)
    return out


async def index_snapshot(
    redis_port: int, truths: Sequence[EngineTruth], clock: Clock, key_prefix: str = "fleetgate",
    max_keys: int = 200_000, mode: str = DEFAULT_INDEX_MODE,
) -> IndexSnapshot:
    """Read the whole index (directly, not through a proxy) and compare it with the truth, in
    the layout of ``mode`` (what the fleet's gateways and agents were started with)."""
    if mode == "mirror":
        return await _mirror_snapshot(redis_port, truths, clock, key_prefix)
    tag = "{" + key_prefix + "}"
    client = redis.asyncio.Redis(host=HOST, port=redis_port, socket_timeout=5)
    try:
        owners = {int(k): v.decode() for k, v in (await client.hgetall(f"{tag}:owners")).items()}
        alive = {k.decode(): int(v) for k, v in (await client.hgetall(f"{tag}:alive")).items()}
        seconds, micros = await client.time()
        now_ms = seconds * 1000 + micros // 1000
        keys = []
        async for key in client.scan_iter(match=f"{tag}:b:*", count=1000):
            keys.append(key)
            if len(keys) >= max_keys:
                break
        values: list[bytes | None] = []
        for start in range(0, len(keys), 1000):
            values += await client.mget(keys[start : start + 1000])
    finally:
        await client.aclose()
    # A replica whose heartbeat deadline passed matches nothing (docs/index.md, Heartbeats).
    matching = {slot: rid for slot, rid in owners.items() if alive.get(rid, now_ms) >= now_ms}
    truth = {t.replica_id: t.truth.blocks for t in truths}
    snap = IndexSnapshot(t=clock(), block_keys=len(keys), live_replicas=len(matching))
    listed: dict[str, set[int]] = {rid: set() for rid in truth}
    for key, value in zip(keys, values, strict=True):
        if not value:
            continue
        block = int(key.rsplit(b":", 1)[1], 16)
        width = value[0] * 256 + value[1]
        for slot in _slots(value[2 : 2 + width]):
            rid = matching.get(slot)
            if rid is None:
                snap.dead_entries += 1
                continue
            listed.setdefault(rid, set()).add(block)
            if block not in truth.get(rid, ()):
                snap.stale.add((rid, block))
    snap.missing = sum(len(blocks - listed.get(rid, set())) for rid, blocks in truth.items())
    return snap


async def _mirror_snapshot(
    redis_port: int, truths: Sequence[EngineTruth], clock: Clock, key_prefix: str
) -> IndexSnapshot:
    """The mirrored layout (``routing/index/stream_layout.py``): per replica, its live epoch's
    engine-confirmed block set, matching while the epoch is live and the heartbeat current."""
    layout = StreamLayout(key_prefix)
    client = redis.asyncio.Redis(host=HOST, port=redis_port, socket_timeout=5)
    try:
        seconds, micros = await client.time()
        now_ms = seconds * 1000 + micros // 1000
        read = {}
        for t in truths:
            keys = layout.replica_keys(ReplicaId(t.replica_id))
            state = {k.decode(): v.decode() for k, v in (await client.hgetall(keys.state)).items()}
            members = await client.smembers(keys.blocks)
            read[t.replica_id] = (state, members)
    finally:
        await client.aclose()
    snap = IndexSnapshot(t=clock(), block_keys=sum(len(m) for _, m in read.values()))
    for t in truths:
        state, members = read[t.replica_id]
        blocks = {b for member in members for b in unpack_blocks(member)}
        epoch = state.get("e", "~")
        live = not epoch.startswith("~") and int(state.get("a", now_ms)) >= now_ms
        if not live:
            snap.dead_entries += len(blocks)
            blocks = set()
        else:
            snap.live_replicas += 1
        held = t.truth.blocks
        snap.stale.update((t.replica_id, b) for b in blocks - held)
        snap.missing += len(held - blocks)
    return snap
