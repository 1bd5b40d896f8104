"""``fleetgate replica run``'s stop drains: the agent reports the engine down (gateways send it
nothing new), the requests in flight finish, and only then is the engine signalled. Before, a
stop signalled the engine at once: vLLM aborts on SIGTERM, and streams in flight got no byte
for ``--stop-grace`` and were then cut (live review of ``replica run`` on real vLLM).

The engine here is ``fleetgate sim`` slowed down (a request runs for seconds), supervised as an
``EngineProcess``; the agent is the real one, with in-memory stores.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from fleetgate.commands.replica import _drain
from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import MemoryFleetStore
from replica.launcher import EngineProcess
from routing.index import MemoryBlockIndex
from routing.types import ReplicaId
from tests.support.polling import wait_until
from tests.support.redis_server import free_port

MODEL = "sim-model"
RID = ReplicaId("pool/drain")


@asynccontextmanager
async def _engine_and_agent(tmp_path: Path) -> AsyncIterator[tuple[EngineProcess, ReplicaAgent,
                                                                     MemoryFleetStore]]:
    port = free_port()
    engine = EngineProcess(
        [sys.executable, "-m", "fleetgate.cli", "sim", "--port", str(port), "--profile", "tiny",
         "--speed", "0.05", "--model", MODEL],
        url=f"http://127.0.0.1:{port}", log_path=tmp_path / "sim.log",
    ).start()
    fleet = MemoryFleetStore()
    agent = ReplicaAgent(
        AgentConfig(replica_id=RID, engine_url=engine.url, model=MODEL, listen_port=None,
                    scrape_interval_s=0.1, heartbeat_ttl_s=5.0),
        index=MemoryBlockIndex(), fleet=fleet,
    )
    try:
        await asyncio.to_thread(engine.wait_healthy, 60)
        await agent.start()
        await wait_until(lambda: agent.engine_up, "the agent sees its engine", timeout_s=30)
        yield engine, agent, fleet
    finally:
        await agent.stop()
        engine.stop(grace_s=5)


async def _registered_healthy(fleet: MemoryFleetStore) -> bool | None:
    states = {s.replica_id: s for s in await fleet.list_replicas()}
    return states[RID].healthy if RID in states else None


async def test_a_stop_waits_for_the_requests_in_flight_then_lets_the_engine_go(
    tmp_path: Path,
) -> None:
    stack = _engine_and_agent(tmp_path)
    async with stack as (engine, agent, fleet), aiohttp.ClientSession() as http:
        await wait_until(lambda: _registered_healthy(fleet), "registered as up")

        async def long_completion() -> tuple[int, int]:
            body = {"model": MODEL, "prompt": "a slow one", "max_tokens": 200}  # ~6 s
            async with http.post(f"{engine.url}/v1/completions", json=body) as resp:
                data = await resp.json()
                return resp.status, data["usage"]["completion_tokens"]

        in_flight = asyncio.create_task(long_completion())
        await wait_until(lambda: (agent.snapshot is not None and agent.snapshot.running > 0),
                         "the request runs in the engine", timeout_s=30)
        await _drain(agent, engine, timeout_s=120, force=asyncio.Event(), settle_s=1.0)
        # The drain ended because the engine went idle, not at its deadline: the request is done.
        assert in_flight.done()
        assert await in_flight == (200, 200)
        # Meanwhile gateways were told: the registration says the engine takes nothing new,
        # and that it is draining (so a gateway leaves it the requests it holds).
        assert await _registered_healthy(fleet) is False
        (state,) = await fleet.list_replicas()
        assert state.draining and agent.leaving
        assert engine.poll() is None  # stopping the engine is the supervisor's next step


async def _slow_request_running(
    http: aiohttp.ClientSession, engine: EngineProcess, agent: ReplicaAgent
) -> asyncio.Task[aiohttp.ClientResponse]:
    """A request of 400 tokens (~12 s on the slowed engine), once the engine runs it."""
    body = {"model": MODEL, "prompt": "a slow one", "max_tokens": 400}
    in_flight = asyncio.create_task(http.post(f"{engine.url}/v1/completions", json=body))
    await wait_until(lambda: (agent.snapshot is not None and agent.snapshot.running > 0),
                     "the request runs in the engine", timeout_s=30)
    return in_flight


async def test_a_second_signal_ends_the_drain_at_once(tmp_path: Path) -> None:
    async with _engine_and_agent(tmp_path) as (engine, agent, _), aiohttp.ClientSession() as http:
        in_flight = await _slow_request_running(http, engine, agent)
        force = asyncio.Event()
        force.set()
        await _drain(agent, engine, timeout_s=600, force=force, settle_s=1.0)
        assert not in_flight.done()
        in_flight.cancel()


async def test_a_drain_ends_when_the_engine_goes_down(tmp_path: Path) -> None:
    """A dead engine holds nothing to wait for: the drain must not run to its deadline."""
    async with _engine_and_agent(tmp_path) as (engine, agent, _), aiohttp.ClientSession() as http:
        in_flight = await _slow_request_running(http, engine, agent)
        draining = asyncio.create_task(
            _drain(agent, engine, timeout_s=600, force=asyncio.Event(), settle_s=0.5)
        )
        await asyncio.to_thread(engine.stop, 5)
        await asyncio.wait_for(draining, 60)
        in_flight.cancel()


async def test_the_prestop_drain_waits_for_the_requests_in_flight(tmp_path: Path) -> None:
    """``python3 -m replica.drain_wait``, the pool manifest's preStop hook: it returns only
    once the engine holds nothing, so vLLM's SIGTERM aborts nothing; and at once when the
    engine is gone."""
    async with _engine_and_agent(tmp_path) as (engine, agent, _), aiohttp.ClientSession() as http:
        in_flight = await _slow_request_running(http, engine, agent)
        waiter = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "replica.drain_wait", "--engine", engine.url,
            "--settle", "0.2", "--timeout", "120",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(waiter.communicate(), timeout=150)
        assert in_flight.done()  # it finished before the hook let the engine go
        assert (await in_flight).status == 200
        assert waiter.returncode == 0 and b"drain: idle" in out

        await asyncio.to_thread(engine.stop, 5)
        gone = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "replica.drain_wait", "--engine", engine.url,
            "--settle", "0", "--timeout", "120", stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(gone.communicate(), timeout=30)
        assert gone.returncode == 0 and b"drain: engine down" in out
