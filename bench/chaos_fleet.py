"""The processes of the chaos benchmark, each its own subprocess on loopback, killable by pid.

```
load ──▶ gateway 0 ─┐                       ┌─▶ proxy r0 ─▶ sim r0 ◀── agent r0 ─┐
     └─▶ gateway 1 ─┼─▶ proxy "gw-redis" ─┐ ├─▶ proxy r1 ─▶ sim r1 ◀── agent r1 ─┤
                    └───────────────────▶ │ └─▶ …                                 │
                                          ▼                                       ▼
                                       redis-server ◀──── proxy "agent-redis" ◀───┘
```

Gateways reach the replicas and Redis through ``FaultProxy``s (``bench/chaos_proxy.py``), all in
one process of their own that the benchmark drives over a small control API, so "Redis slow",
"network stall" and "replica slow" are injected on the wire, and the benchmark's own work never
delays a relayed byte. Agents scrape their engine directly (the engine is not slow to its own
sidecar) but advertise the proxy's URL, which is what gateways call. KV events and the replay
socket use ``ipc://`` endpoints: local only, and stable across an engine restart.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from bench.chaos_proxy import Mode, ProxySpec
from replica.launcher import VLLM_SERVER_MODULE, EngineSpec, kv_events_config
from replica.vllm_env import require_vllm_env

ADMIN_KEY = "chaos-admin-key"
TENANT_KEYS = {"tenant-a": "chaos-key-a", "tenant-b": "chaos-key-b"}
POOL = "chaos"
#: Gateway health polls (and fleet-store merges) this often: detection times scale with it.
HEALTH_INTERVAL_S = 1.0


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class EngineKind:
    """What the replicas run: ``fleetgate sim`` or a real vLLM CPU engine (the e2e tier)."""

    name: str
    model: str
    block_size: int
    #: A tokenizer directory the gateways tokenize with (exact blocks); None: text blocks.
    tokenizer_dir: Path | None = None
    #: How long an engine may take to answer ``/health`` after a (re)start.
    start_timeout_s: float = 90.0


SIM = EngineKind("sim", MODEL, 16)


def vllm_kind(model_dir: Path) -> EngineKind:
    """The tiny generated model (``replica.tiny_model``) on vLLM's CPU build."""
    return EngineKind("vllm", "tiny", 32, tokenizer_dir=model_dir, start_timeout_s=600.0)


def policy_yaml(redis_url: str, engine: EngineKind = SIM) -> str:
    """Two tenants, one discovery-only pool (agents register replicas), the Redis index."""
    tenants = "".join(
        f"  - name: {name}\n    api_key_sha256: [{sha256_hex(key)}]\n"
        for name, key in TENANT_KEYS.items()
    )
    tokenizer = ("" if engine.tokenizer_dir is None else
                 f"    tokenizer: {{kind: local, path: '{engine.tokenizer_dir}'}}\n")
    return (
        "version: 1\n"
        "replica_pools:\n"
        f"  - name: {POOL}\n"
        f"    discovery: {{redis_url: '{redis_url}'}}\n"
        f"    block_size: {engine.block_size}\n"
        "models:\n"
        f"  - name: {engine.model}\n"
        f"{tokenizer}"
        f"    pools: [{POOL}]\n"
        f"tenants:\n{tenants}"
        f"index: {{backend: redis, redis_url: '{redis_url}'}}\n"
        f"gateway: {{health_check_interval_s: {HEALTH_INTERVAL_S}}}\n"
        f"admin: {{api_key_sha256: [{sha256_hex(ADMIN_KEY)}]}}\n"
    )


def _signal_group(proc: Proc, sig: signal.Signals) -> None:
    """``sig`` to the process group ``Proc`` started (its own session: vLLM's EngineCore and
    workers are in it and must share the parent's fate)."""
    if proc.alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def _kill(proc: Proc) -> None:
    """SIGKILL this process group (a crash) and reap the leader."""
    if proc.popen is not None and proc.popen.poll() is None:
        _signal_group(proc, signal.SIGKILL)
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
class ProxyHandle:
    """One proxy of the proxy process, driven through its control API."""

    name: str
    port: int
    control_url: str

    async def _post(self, path: str, body: dict) -> None:
        async with aiohttp.ClientSession() as session, session.post(
            self.control_url + path, json={"name": self.name, **body},
            timeout=aiohttp.ClientTimeout(total=5),
        ) as resp:
            resp.raise_for_status()

    async def set_mode(self, mode: Mode, *, delay_ms: float = 0.0, factor: float = 1.0) -> None:
        await self._post("/mode", {"mode": mode.value, "delay_ms": delay_ms, "factor": factor})

    async def heal(self) -> None:
        await self.set_mode(Mode.PASS)

    async def drop_all(self) -> None:
        await self._post("/drop", {})


@dataclass
class ProxyProcess:
    """``python -m bench.chaos_proxy`` with every proxy of the fleet."""

    log_dir: Path
    control_port: int = field(default_factory=free_port)
    specs: list[ProxySpec] = field(default_factory=list)
    proc: Proc | None = None

    def add(self, name: str, upstream_port: int) -> ProxyHandle:
        spec = ProxySpec(name, free_port(), upstream_port)
        self.specs.append(spec)
        return ProxyHandle(name, spec.listen_port, f"http://{HOST}:{self.control_port}")

    async def start(self, timeout_s: float) -> None:
        argv = [str(VENV_BIN / "python"), "-m", "bench.chaos_proxy",
                "--control-port", str(self.control_port)]
        for spec in self.specs:
            argv += ["--proxy", spec.arg()]
        self.proc = Proc("proxies", argv, f"http://{HOST}:{self.control_port}",
                         self.log_dir / "proxies.log")
        self.proc.start()
        await wait_http(self.proc.url + "/stats", timeout_s, "fault proxies")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout_s=10)


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
    engine: EngineKind = SIM
    sim_port: int = field(default_factory=free_port)
    agent_port: int = field(default_factory=free_port)
    proxy: ProxyHandle | None = None
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
        if self.engine.name == "vllm":
            return self._vllm_argv()
        return [
            str(VENV_BIN / "fleetgate"), "sim", "--host", HOST, "--port", str(self.sim_port),
            "--replicas", "1", "--speed", str(self.speed), "--seed", str(self.index),
            "--model", MODEL, "--kv-events", self.kv_events, "--kv-replay", self.kv_replay,
            "--log-level", "WARNING",
        ]

    def _spec(self) -> EngineSpec:
        assert self.engine.tokenizer_dir is not None
        return EngineSpec(
            model=self.engine.tokenizer_dir, served_model_name=self.engine.model,
            port=self.sim_port, block_size=self.engine.block_size, enable_lora=False,
            extra_args=("--num-gpu-blocks-override", "2048"),
        )

    def _vllm_argv(self) -> list[str]:
        """vLLM's flags as the e2e tier sets them, KV events on this replica's ipc endpoints
        (vLLM binds ``ipc://``, like a wildcard: local only, and stable over a restart)."""
        args = self._spec().vllm_args()
        at = args.index("--kv-events-config") + 1
        args[at] = kv_events_config(self.kv_events, "kv", self.kv_replay)
        return [str(require_vllm_env(check_import=False)), "-m", VLLM_SERVER_MODULE, *args]

    def agent_argv(self, redis_url: str) -> list[str]:
        return [
            str(VENV_BIN / "fleetgate"), "agent", "--replica-id", self.replica_id,
            "--engine-url", self.engine_url, "--advertise-url", self.public_url,
            "--pool", POOL, "--model", self.engine.model, "--kv-events", self.kv_events,
            "--replay", self.kv_replay, "--index-url", redis_url,
            "--listen", f"{HOST}:{self.agent_port}", "--log-level", "WARNING",
        ]

    def start_sim(self) -> None:
        self.sim_starts += 1
        self.sim = Proc(f"sim-r{self.index}", self.sim_argv(), self.engine_url,
                        self.log_dir / f"sim-r{self.index}.{self.sim_starts}.log")
        if self.engine.name == "vllm":
            self.sim.env = self._spec().env()
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
            _signal_group(self.sim, signal.SIGSTOP)

    def resume_sim(self) -> None:
        if self.sim is not None:
            _signal_group(self.sim, signal.SIGCONT)


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
    engine: EngineKind = SIM
    redis: RedisProc = field(init=False)
    proxy_process: ProxyProcess = field(init=False)
    gw_redis_proxy: ProxyHandle | None = None
    agent_redis_proxy: ProxyHandle | None = None
    replicas: list[Replica] = field(default_factory=list)
    gateways: list[Gateway] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.redis = RedisProc(self.log_dir)
        self.proxy_process = ProxyProcess(self.log_dir)

    @property
    def gw_redis_url(self) -> str:
        assert self.gw_redis_proxy is not None
        return f"redis://{HOST}:{self.gw_redis_proxy.port}/0"

    @property
    def agent_redis_url(self) -> str:
        assert self.agent_redis_proxy is not None
        return f"redis://{HOST}:{self.agent_redis_proxy.port}/0"

    async def start(self, timeout_s: float = 90.0) -> None:
        self.redis.start()
        await self.redis.wait_ready()
        self.gw_redis_proxy = self.proxy_process.add("gateway-redis", self.redis.port)
        self.agent_redis_proxy = self.proxy_process.add("agent-redis", self.redis.port)
        self.replicas = [Replica(i, self.log_dir, self.speed, self.engine)
                         for i in range(self.replicas_n)]
        for replica in self.replicas:
            replica.proxy = self.proxy_process.add(f"replica-r{replica.index}", replica.sim_port)
        await self.proxy_process.start(timeout_s)
        for replica in self.replicas:
            replica.start_sim()
        for replica in self.replicas:
            await wait_http(replica.engine_url + "/health",
                            max(timeout_s, self.engine.start_timeout_s), replica.sim.name)
            replica.start_agent(self.agent_redis_url)
        for replica in self.replicas:
            await wait_http(replica.agent_url + "/health", timeout_s, replica.agent.name)
        policy = self.log_dir / "policy.yaml"
        policy.write_text(policy_yaml(self.gw_redis_url, self.engine))
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
        self.proxy_process.stop()
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
