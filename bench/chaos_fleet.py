"""The processes of the chaos benchmark, each its own subprocess on loopback, killable by pid.

```
load ──▶ gateway 0 ─┐                       ┌─▶ proxy r0 ─▶ sim r0 ◀── agent r0 ─┐
     └─▶ gateway 1 ─┼─▶ proxy "gw-redis" ─┐ ├─▶ proxy r1 ─▶ sim r1 ◀── agent r1 ─┤
                    └───────────────────▶ │ └─▶ …                                 │
                                          ▼                                       ▼
                                       redis-server ◀──── proxy "agent-redis" ◀───┘
```

Gateways reach the replicas and Redis through ``FaultProxy``s (``bench/chaos_proxy.py``) that the
benchmark runs in its own event loop, so "Redis slow", "network stall" and "replica slow" are
injected on the wire. Agents scrape their engine directly (the engine is not slow to its own
sidecar) but advertise the proxy's URL, which is what gateways call. KV events and the replay
socket use ``ipc://`` endpoints: local only, and stable across an engine restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis.asyncio

from bench._bench_common import HOST, MODEL, VENV_BIN, Proc, free_port
from bench.chaos_proxy import FaultProxy

ADMIN_KEY = "chaos-admin-key"
TENANT_KEYS = {"tenant-a": "chaos-key-a", "tenant-b": "chaos-key-b"}
POOL = "chaos"
#: Gateway health polls (and fleet-store merges) this often: detection times scale with it.
HEALTH_INTERVAL_S = 1.0


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def policy_yaml(redis_url: str) -> str:
    """Two tenants, one discovery-only pool (agents register replicas), the Redis index."""
    tenants = "".join(
        f"  - name: {name}\n    api_key_sha256: [{sha256_hex(key)}]\n"
        for name, key in TENANT_KEYS.items()
    )
    return (
        "version: 1\n"
        "replica_pools:\n"
        f"  - name: {POOL}\n"
        f"    discovery: {{redis_url: '{redis_url}'}}\n"
        "    block_size: 16\n"
        "models:\n"
        f"  - name: {MODEL}\n"
        f"    pools: [{POOL}]\n"
        f"tenants:\n{tenants}"
        f"index: {{backend: redis, redis_url: '{redis_url}'}}\n"
        f"gateway: {{health_check_interval_s: {HEALTH_INTERVAL_S}}}\n"
        f"admin: {{api_key_sha256: [{sha256_hex(ADMIN_KEY)}]}}\n"
    )


def _signal(proc: Proc, sig: signal.Signals) -> None:
    if proc.alive():
        os.kill(proc.pid, sig)


def _kill(proc: Proc) -> None:
    """SIGKILL this pid (a crash) and reap it."""
    if proc.popen is not None and proc.popen.poll() is None:
        proc.popen.kill()
        proc.popen.wait(timeout=10)


async def wait_http(url: str, timeout_s: float, what: str, status: int = 200) -> None:
    """Poll ``url`` until it answers ``status``; raise naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    await resp.read()
                    if resp.status == status:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                last = repr(exc)
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{what}: {url} did not answer {status} within {timeout_s}s ({last})")


@dataclass
class RedisProc:
    """A private redis-server (no persistence) on a fixed port, so it can restart there."""

    log_dir: Path
    port: int = field(default_factory=free_port)
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found (apt-get install redis-server)")
        workdir = self.log_dir / "redis"
        workdir.mkdir(exist_ok=True)
        argv = [binary, "--port", str(self.port), "--bind", HOST, "--save", "",
                "--appendonly", "no", "--dir", str(workdir)]
        self.proc = Proc("redis", argv, self.url, self.log_dir / "redis.log")
        self.proc.start()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection(HOST, self.port)
                writer.write(b"PING\r\n")
                reply = await asyncio.wait_for(reader.read(16), 1.0)
                writer.close()
                if reply.startswith(b"+PONG"):
                    return
            except (OSError, TimeoutError):
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer PING on {self.port} in {timeout_s}s")

    def kill(self) -> None:
        if self.proc is not None:
            _kill(self.proc)


@dataclass
class Replica:
    """One simulated engine (``fleetgate sim``, one replica), its proxy and its agent."""

    index: int
    log_dir: Path
    speed: float
    sim_port: int = field(default_factory=free_port)
    agent_port: int = field(default_factory=free_port)
    proxy: FaultProxy | None = None
    sim: Proc | None = None
    agent: Proc | None = None
    sim_starts: int = 0
    agent_starts: int = 0

    @property
    def replica_id(self) -> str:
        return f"{POOL}/r{self.index}"

    @property
    def engine_url(self) -> str:
        return f"http://{HOST}:{self.sim_port}"

    @property
    def public_url(self) -> str:
        assert self.proxy is not None
        return f"http://{HOST}:{self.proxy.port}"

    @property
    def agent_url(self) -> str:
        return f"http://{HOST}:{self.agent_port}"

    @property
    def kv_events(self) -> str:
        return f"ipc://{self.log_dir}/r{self.index}.events"

    @property
    def kv_replay(self) -> str:
        return f"ipc://{self.log_dir}/r{self.index}.replay"

    def sim_argv(self) -> list[str]:
        return [
            str(VENV_BIN / "fleetgate"), "sim", "--host", HOST, "--port", str(self.sim_port),
            "--replicas", "1", "--speed", str(self.speed), "--seed", str(self.index),
            "--model", MODEL, "--kv-events", self.kv_events, "--kv-replay", self.kv_replay,
            "--log-level", "WARNING",
        ]

    def agent_argv(self, redis_url: str) -> list[str]:
        return [
            str(VENV_BIN / "fleetgate"), "agent", "--replica-id", self.replica_id,
            "--engine-url", self.engine_url, "--advertise-url", self.public_url,
            "--pool", POOL, "--model", MODEL, "--kv-events", self.kv_events,
            "--replay", self.kv_replay, "--index-url", redis_url,
            "--listen", f"{HOST}:{self.agent_port}", "--log-level", "WARNING",
        ]

    async def start_proxy(self) -> None:
        self.proxy = await FaultProxy(f"replica-r{self.index}", self.sim_port).start()

    def start_sim(self) -> None:
        self.sim_starts += 1
        self.sim = Proc(f"sim-r{self.index}", self.sim_argv(), self.engine_url,
                        self.log_dir / f"sim-r{self.index}.{self.sim_starts}.log")
        self.sim.start()

    def start_agent(self, redis_url: str) -> None:
        self.agent_starts += 1
        self.agent = Proc(f"agent-r{self.index}", self.agent_argv(redis_url), self.agent_url,
                          self.log_dir / f"agent-r{self.index}.{self.agent_starts}.log")
        self.agent.start()

    def kill_sim(self) -> None:
        if self.sim is not None:
            _kill(self.sim)

    def kill_agent(self) -> None:
        if self.agent is not None:
            _kill(self.agent)

    def pause_sim(self) -> None:
        """SIGSTOP: the kernel still accepts connections (backlog), nothing answers."""
        if self.sim is not None:
            _signal(self.sim, signal.SIGSTOP)

    def resume_sim(self) -> None:
        if self.sim is not None:
            _signal(self.sim, signal.SIGCONT)


@dataclass
class Gateway:
    """One ``fleetgate serve --config`` process on a fixed port (restartable there)."""

    index: int
    policy_path: Path
    log_dir: Path
    port: int = field(default_factory=free_port)
    proc: Proc | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        argv = [str(VENV_BIN / "fleetgate"), "serve", "--config", str(self.policy_path),
                "--host", HOST, "--port", str(self.port)]
        self.starts += 1  # a restarted process gets its own log: the crash's stays readable
        self.proc = Proc(f"gateway-{self.index}", argv, self.url,
                         self.log_dir / f"gateway-{self.index}.{self.starts}.log")
        self.proc.start()

    def kill(self) -> None:
        if self.proc is not None:
            _kill(self.proc)


@dataclass
class Fleet:
    """Redis, its two proxies, N replicas (sim + proxy + agent) and two gateways."""

    log_dir: Path
    replicas_n: int
    speed: float
    redis: RedisProc = field(init=False)
    gw_redis_proxy: FaultProxy | None = None
    agent_redis_proxy: FaultProxy | None = None
    replicas: list[Replica] = field(default_factory=list)
    gateways: list[Gateway] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.redis = RedisProc(self.log_dir)

    @property
    def gw_redis_url(self) -> str:
        assert self.gw_redis_proxy is not None
        return f"redis://{HOST}:{self.gw_redis_proxy.port}/0"

    @property
    def agent_redis_url(self) -> str:
        assert self.agent_redis_proxy is not None
        return f"redis://{HOST}:{self.agent_redis_proxy.port}/0"

    @property
    def proxies(self) -> list[FaultProxy]:
        out = [p for p in (self.gw_redis_proxy, self.agent_redis_proxy) if p is not None]
        return out + [r.proxy for r in self.replicas if r.proxy is not None]

    async def start(self, timeout_s: float = 90.0) -> None:
        self.redis.start()
        await self.redis.wait_ready()
        self.gw_redis_proxy = await FaultProxy("gateway-redis", self.redis.port).start()
        self.agent_redis_proxy = await FaultProxy("agent-redis", self.redis.port).start()
        self.replicas = [Replica(i, self.log_dir, self.speed) for i in range(self.replicas_n)]
        for replica in self.replicas:
            await replica.start_proxy()
            replica.start_sim()
        for replica in self.replicas:
            await wait_http(replica.engine_url + "/health", timeout_s, replica.sim.name)
            replica.start_agent(self.agent_redis_url)
        for replica in self.replicas:
            await wait_http(replica.agent_url + "/health", timeout_s, replica.agent.name)
        policy = self.log_dir / "policy.yaml"
        policy.write_text(policy_yaml(self.gw_redis_url))
        self.gateways = [Gateway(i, policy, self.log_dir) for i in range(2)]
        for gateway in self.gateways:
            gateway.start()
        for gateway in self.gateways:
            await self.wait_gateway(gateway, timeout_s)

    async def wait_gateway(self, gateway: Gateway, timeout_s: float) -> None:
        """Until the gateway answers ``/ready`` (a healthy replica of the model is known)."""
        await wait_http(gateway.url + "/ready", timeout_s, gateway.proc.name)

    async def stop(self) -> None:
        for gateway in self.gateways:
            if gateway.proc is not None:
                gateway.proc.stop(timeout_s=10)
        for replica in self.replicas:
            replica.resume_sim()  # a stopped process cannot handle SIGINT
            for proc in (replica.agent, replica.sim):
                if proc is not None:
                    proc.stop(timeout_s=10)
        for proxy in self.proxies:
            await proxy.stop()
        self.redis.kill()

    def logs_tail(self, n: int = 15) -> str:
        procs = [g.proc for g in self.gateways] + [r.agent for r in self.replicas]
        procs += [r.sim for r in self.replicas]
        return "\n".join(
            f"--- {p.name}\n{p.log_tail(n)}" for p in procs if p is not None and p.log_tail(n)
        )


async def flush_redis(port: int) -> None:
    """FLUSHALL on the real server (not through a proxy)."""
    client = redis.asyncio.Redis(host=HOST, port=port, socket_timeout=5)
    try:
        await client.flushall()
    finally:
        await client.aclose()
