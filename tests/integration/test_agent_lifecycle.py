"""The agent beside a simulated engine that freezes, or that it joins late (the live review's
replica-lifecycle findings 1 and 2).

- A hung engine (SIGSTOP: TCP is accepted, nothing answers) must count as down: before, the
  agent's scrape was cancelled before its health probe timed out, the miss was never counted,
  and the agent vouched for the frozen engine (its blocks matched, its registration said up).
- An agent that starts beside an idle engine must learn what the engine holds at once: before,
  its catch-up waited for the engine's next KV-event batch, which an idle engine never sends.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
import pytest

from replica.agent import AgentConfig, ReplicaAgent
from replica.agent.agent import RESTART_AFTER_DOWN_S
from replica.fleet_store import MemoryFleetStore
from replica.kv_events.codec import EventBatch
from replica.sim.fleet import start_sim_fleet
from routing.hashing import chain_seed, hash_token_blocks
from routing.index import MemoryBlockIndex, RedisBlockIndex
from routing.types import ReplicaId
from tests.support.polling import wait_until
from tests.support.redis_server import free_port, free_port_block

pytestmark = pytest.mark.redis

MODEL = "sim-model"
BLOCK = 16
RID = "pool/r0"


def _prompt(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BLOCK))


def _chain(prompt: list[int]) -> list[int]:
    return hash_token_blocks(prompt, BLOCK, chain_seed(MODEL, None, None))


async def _complete(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


@asynccontextmanager
async def _sim_process() -> AsyncIterator[tuple[asyncio.subprocess.Process, str, str, str]]:
    """``fleetgate sim`` in its own process, so that it can be frozen: (process, URL, KV-event
    endpoint, replay endpoint)."""
    http_port = free_port_block(3)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetgate.cli", "sim", "--port", str(http_port),
        "--profile", "tiny", "--speed", "1000", "--block-size", str(BLOCK), "--model", MODEL,
        "--kv-events", f"tcp://*:{http_port + 1}", "--kv-replay", f"tcp://*:{http_port + 2}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    try:
        lines: list[str] = []
        async with asyncio.timeout(60):
            while True:
                line = (await process.stdout.readline()).decode()
                assert line, "fleetgate sim exited before it was up:\n" + "".join(lines)
                lines.append(line)
                found = re.search(r"replica 0: (\S+)\s+kv-events (\S+)\s+replay (\S+)", line)
                if found:
                    break

        async def drain() -> None:  # a full pipe would block the sim
            assert process.stdout is not None
            while await process.stdout.readline():
                pass

        draining = asyncio.create_task(drain())
        try:
            yield process, found.group(1), found.group(2), found.group(3)
        finally:
            draining.cancel()
    finally:
        if process.returncode is None:
            process.kill()  # SIGKILL ends a stopped process too
            await process.wait()


def _agent(index: RedisBlockIndex, fleet: MemoryFleetStore, url: str, events: str,
           replay: str) -> ReplicaAgent:
    return ReplicaAgent(
        AgentConfig(
            replica_id=RID,
            engine_url=url,
            model=MODEL,
            kv_events_endpoint=events,
            replay_endpoint=replay,
            listen_port=None,
            scrape_interval_s=0.1,
            heartbeat_ttl_s=2.0,
        ),
        index=index,
        fleet=fleet,
    )


async def test_a_frozen_engine_is_down_for_its_agent_and_its_blocks_come_back_when_it_resumes(
    redis_url: str,
) -> None:
    index = RedisBlockIndex(redis_url, key_prefix=f"frozen{free_port()}", timeout_s=1.0)
    fleet = MemoryFleetStore()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(index.close)
        process, url, events, replay = await stack.enter_async_context(_sim_process())
        http = await stack.enter_async_context(aiohttp.ClientSession())
        agent = await stack.enter_async_context(_agent(index, fleet, url, events, replay))
        await wait_until(lambda: agent.engine_up, "the agent sees its engine up", timeout_s=30)

        async def matched(prompt: list[int]) -> int:
            return (await index.match(_chain(prompt))).get(RID, 0)

        # Fresh prompts until one is indexed from the live stream (the subscription joins late).
        prompts = iter(_prompt(10_000 + 1000 * i, 4) for i in range(1000))
        prompt = next(prompts)

        async def indexed() -> bool:
            nonlocal prompt
            if await matched(prompt) == 4:
                return True
            prompt = next(prompts)
            await _complete(http, url, prompt)
            await asyncio.sleep(0.1)
            return False

        await wait_until(indexed, "a prompt's blocks are indexed", timeout_s=30)

        async def registered_healthy() -> bool | None:
            states = {s.replica_id: s for s in await fleet.list_replicas()}
            state = states.get(ReplicaId(RID))
            return None if state is None else state.healthy

        os.kill(process.pid, signal.SIGSTOP)  # a hung engine: connections accepted, no answer
        try:
            await wait_until(lambda: not agent.engine_up, "the agent sees its engine down", 30)

            async def registered_down() -> bool:
                return await registered_healthy() is False

            async def unmatched() -> bool:
                return await matched(prompt) == 0

            await wait_until(registered_down, "the registration says the engine is down", 30)
            await wait_until(unmatched, "the frozen engine's blocks stop matching", 30)

            def down_long_enough() -> bool:  # for its return to count as a new process
                since = agent._down_since
                return since is not None and time.monotonic() - since >= RESTART_AFTER_DOWN_S

            await wait_until(down_long_enough, "the engine is down long enough", 30)
        finally:
            os.kill(process.pid, signal.SIGCONT)

        # Back: a new epoch (its blocks might be another process's), and the engine's buffered
        # history replayed at once, though the idle engine publishes nothing new.
        async def back() -> bool:
            return agent.engine_up and await matched(prompt) == 4

        await wait_until(back, "the resumed engine's blocks match again", timeout_s=30)
        assert agent.metrics.value("fleetgate_agent_epoch_retirements_total", reason="restart") == 1
        assert await registered_healthy() is True


async def test_an_agent_started_beside_an_idle_engine_learns_its_blocks_at_once(
    redis_url: str,
) -> None:
    index = RedisBlockIndex(redis_url, key_prefix=f"idle{free_port()}", timeout_s=1.0)
    first = _prompt(20_000, 4)
    longer = first + _prompt(30_000, 2)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(index.close)
        sims = await stack.enter_async_context(
            start_sim_fleet(1, model=MODEL, profile="tiny", speed=1000.0, block_size=BLOCK)
        )
        (handle,) = sims.replicas
        assert handle.kv_events_endpoint and handle.kv_replay_endpoint
        http = await stack.enter_async_context(aiohttp.ClientSession())
        # The engine stored the prompt before any agent listened, then went idle.
        await _complete(http, handle.url, first)
        agent = await stack.enter_async_context(
            _agent(index, MemoryFleetStore(), handle.url, handle.kv_events_endpoint,
                   handle.kv_replay_endpoint)
        )

        async def matched(prompt: list[int]) -> int:
            return (await index.match(_chain(prompt))).get(RID, 0)

        async def caught_up() -> bool:
            return await matched(first) == 4

        await wait_until(caught_up, "the idle engine's blocks are indexed", timeout_s=15)

        # The live stream goes on from where the replay ended: in order, nothing retired.
        await _complete(http, handle.url, longer)

        async def extended() -> bool:
            return await matched(longer) == 6

        await wait_until(extended, "the next request's blocks extend the chain", timeout_s=15)
        for reason in ("gap", "restart"):
            retired = agent.metrics.value("fleetgate_agent_epoch_retirements_total", reason=reason)
            assert retired == 0, reason


class _EverBusyReplay:
    """A replay socket on an engine that publishes faster than it is asked: every answer holds
    one batch newer than the last (what the real-vLLM e2e tier showed, one request after
    another). ``live`` is called at the third request, as the SUB socket's first delivery."""

    replay_endpoint = "tcp://replay.invalid:1"

    def __init__(self, live: Callable[[], None]) -> None:
        self.asked: list[int] = []
        self._live = live

    async def request_replay(
        self, start_seq: int, timeout_s: float = 5.0, *, partial: bool = False
    ) -> list[tuple[int, EventBatch]]:
        self.asked.append(start_seq)
        if len(self.asked) == 3:
            self._live()
        await asyncio.sleep(0)
        return [(start_seq, EventBatch(ts=float(start_seq), events=[]))]


async def _agent_without_an_engine() -> ReplicaAgent:
    """An agent whose stream the test drives itself (its replay socket, its batches)."""
    agent = ReplicaAgent(
        AgentConfig(replica_id=RID, engine_url="http://127.0.0.1:9", model=MODEL,
                    listen_port=None),
        index=MemoryBlockIndex(), fleet=MemoryFleetStore(),
    )
    agent._model_known.set()
    await agent.applier.start()
    return agent


async def _caught_up_beside_a_busy_engine() -> tuple[ReplicaAgent, _EverBusyReplay]:
    """An agent whose catch-up ran against ``_EverBusyReplay``, batch 2 arriving live meanwhile."""
    agent = await _agent_without_an_engine()
    live: list[asyncio.Task[None]] = []
    replay = _EverBusyReplay(
        lambda: live.append(asyncio.create_task(agent.handle_batch(2, EventBatch(2.0, []))))
    )
    agent.subscriber = replay  # type: ignore[assignment]
    async with asyncio.timeout(10):  # it chased the engine for ever
        await agent._catch_up_now()
        await live[0]
    return agent, replay


async def test_a_catch_up_stops_at_the_first_live_batch() -> None:
    agent, replay = await _caught_up_beside_a_busy_engine()
    assert replay.asked == [0, 1, 2]
    # 0..2 replayed; 2 also came live and was skipped as replayed.
    assert agent.tracker.expected == 3 and agent.batches_applied == 3


async def test_a_fast_restart_after_a_catch_up_is_not_taken_for_replayed_batches() -> None:
    """The diff review: after a catch-up had replayed batches 0..n, a new engine process's
    batches 0.. were dropped as batches the replay had applied, and no new epoch began."""
    agent, _ = await _caught_up_beside_a_busy_engine()
    agent.subscriber = None  # the new process's catch-up is not this test's subject
    await agent.handle_batch(0, EventBatch(100.0, []))  # the engine restarted: it starts again
    assert agent.metrics.value("fleetgate_agent_epoch_retirements_total", reason="restart") == 1
    assert agent.tracker.expected == 1


class _IdleReplay:
    """The replay socket of an idle engine that buffered batches 0..2 (stamped 0.0..2.0)."""

    replay_endpoint = "tcp://replay.invalid:1"

    async def request_replay(
        self, start_seq: int, timeout_s: float = 5.0, *, partial: bool = False
    ) -> list[tuple[int, EventBatch]]:
        return [(seq, EventBatch(ts=float(seq), events=[])) for seq in range(start_seq, 3)]


async def test_a_fast_restart_after_an_idle_engines_catch_up_starts_a_new_epoch() -> None:
    """The mends review: with nothing live during the catch-up, the new process's first batch
    (number 0) was taken for batch 0 of the replay and dropped."""
    agent = await _agent_without_an_engine()
    agent.subscriber = _IdleReplay()  # type: ignore[assignment]
    await agent._catch_up_now()
    assert agent.tracker.expected == 3
    agent.subscriber = None
    await agent.handle_batch(0, EventBatch(50.0, []))  # a new process, stamped later
    assert agent.metrics.value("fleetgate_agent_epoch_retirements_total", reason="restart") == 1
