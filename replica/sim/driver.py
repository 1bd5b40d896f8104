"""The real-time driver: runs one ``EngineModel`` against the wall clock, at ``speed``×.

One asyncio task per replica loops: ``step(now)``, publish the step's KV events, sleep until the
step's modelled end, then hand each request its tokens. Modelled time runs ``speed`` times faster
than the wall clock, and the loop sleeps until an absolute target rather than for a duration, so
its own compute does not drift the clock. All latencies it reports (metrics, usage) are in
modelled seconds, so a sim at ``--speed 10`` reports what the modelled hardware would.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from replica.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventPublisher,
)
from replica.sim.engine import EngineModel, KVEventRecord, SimRequest, StepResult
from replica.sim.kv_cache import chain_seed, extend_chain, token_bytes
from replica.sim.metrics import ReplicaMetrics

logger = logging.getLogger(__name__)


class RequestAborted(Exception):
    """The engine dropped the request (client gone, or the replica is shutting down)."""


@dataclass(eq=False)
class RequestStream:
    """Tokens of one in-flight request, handed from the driver to its HTTP handler."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    adapter: str | None
    cache_salt: str | None
    arrival_s: float
    #: Token ids not yet taken by the handler.
    pending: list[int] = field(default_factory=list)
    generated: int = 0
    cached_tokens: int = 0
    finished: bool = False
    aborted: bool = False
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    async def next_tokens(self) -> list[int]:
        """Wait for new tokens; an empty list means the request finished.

        Raises ``RequestAborted`` if the engine dropped it.
        """
        while not self.pending and not self.finished:
            self._ready.clear()
            await self._ready.wait()
        if self.aborted:
            raise RequestAborted(self.request_id)
        tokens, self.pending = self.pending, []
        return tokens

    def _wake(self) -> None:
        self._ready.set()


class EngineDriver:
    """Runs one engine model in real time and connects it to requests, events and metrics."""

    #: How many salted prompts' first-block hashes are remembered for ``extra_keys``.
    ROOT_SALT_MEMORY = 100_000

    def __init__(
        self,
        engine: EngineModel,
        metrics: ReplicaMetrics,
        token_source: Callable[[int, int], int],
        publisher: KVEventPublisher | None = None,
        speed: float = 1.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed: must be > 0 (got {speed})")
        self.engine = engine
        self.metrics = metrics
        self.publisher = publisher
        self.speed = speed
        #: (request seed, position) -> token id of the generated filler text.
        self._token_source = token_source
        self._clock = clock or asyncio.get_running_loop().time
        self._wall_start = self._clock()
        self._streams: dict[str, RequestStream] = {}
        self._seeds: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._poked = False
        self._ids = itertools.count()
        #: Root block hash -> cache_salt, for vLLM's per-block ``extra_keys`` (bounded LRU).
        self._root_salts: OrderedDict[int, str] = OrderedDict()
        self._lora_ids: dict[str, int] = {}
        self._next_lora_id = itertools.count(1)
        #: Worst lateness of a step against its modelled schedule, wall seconds (capacity bench).
        self.max_lag_s = 0.0
        self.steps = 0

    # ------------------------------------------------------------------ time

    def now_s(self) -> float:
        """Modelled seconds since the driver started."""
        return (self._clock() - self._wall_start) * self.speed

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        adapter: str | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request; raises ``ValueError`` if the engine can never run it."""
        rid = request_id or f"sim-{next(self._ids)}"
        arrival = self.now_s()
        self.engine.submit(
            SimRequest(
                request_id=rid,
                prompt_token_ids=prompt_token_ids,
                max_tokens=max_tokens,
                adapter=adapter,
                cache_salt=cache_salt,
                arrival_s=arrival,
                priority=priority,
            )
        )
        stream = RequestStream(
            request_id=rid,
            prompt_tokens=len(prompt_token_ids),
            max_tokens=max_tokens,
            adapter=adapter,
            cache_salt=cache_salt,
            arrival_s=arrival,
        )
        self._streams[rid] = stream
        if cache_salt:
            self._remember_salt(prompt_token_ids, adapter, cache_salt)
        # Generated text depends on the prompt, so a repeated prompt repeats its answer.
        self._seeds[rid] = hash(tuple(prompt_token_ids[-64:])) & 0xFFFFFFFF
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away); unknown ids are ignored."""
        stream = self._streams.pop(request_id, None)
        self._seeds.pop(request_id, None)
        if stream is None:
            return
        self.engine.abort(request_id)
        if not stream.finished:
            stream.finished = stream.aborted = True
            stream._wake()
            self.metrics.request_finished("abort")

    def _remember_salt(self, prompt: list[int], adapter: str | None, salt: str) -> None:
        # The engine's records do not carry the salt, but vLLM puts it in the extra_keys of a
        # prompt's first block, where the agent reads it: recompute that block's hash to know it.
        block_size = self.engine.config.block_size
        if len(prompt) < block_size:
            return
        root: list[int] = []
        extend_chain(root, token_bytes(prompt[:block_size]), block_size, 1,
                     chain_seed(adapter, salt))
        self._root_salts[root[0]] = salt
        self._root_salts.move_to_end(root[0])
        if len(self._root_salts) > self.ROOT_SALT_MEMORY:
            self._root_salts.popitem(last=False)

    def lora_id(self, adapter: str) -> int:
        """vLLM's integer id of an adapter (assigned in load order, from 1)."""
        if adapter not in self._lora_ids:
            self._lora_ids[adapter] = next(self._next_lora_id)
        return self._lora_ids[adapter]

    def poke(self) -> None:
        """Run one step even without requests, to publish pending events (cache reset)."""
        self._poked = True
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._streams)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Step the engine forever (until cancelled), sleeping while it has no work."""
        try:
            while True:
                if not self.engine.has_work() and not self._poked:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._poked = False
                await self._one_step()
        finally:
            for rid in list(self._streams):
                self.abort(rid)

    async def _one_step(self) -> None:
        start_s = self.now_s()
        result = self.engine.step(start_s)
        self.steps += 1
        if result.kv_events and self.publisher is not None:
            # vLLM publishes a step's events as soon as the scheduler has made them.
            self.publisher.publish([self._event(r) for r in result.kv_events])
        end_s = start_s + result.duration_s
        target_wall = self._wall_start + end_s / self.speed
        delay = target_wall - self._clock()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            self.max_lag_s = max(self.max_lag_s, -delay)
            await asyncio.sleep(0)  # let HTTP handlers run even when the loop is behind
        self._deliver(result, start_s, end_s)

    def _deliver(self, result: StepResult, start_s: float, end_s: float) -> None:
        metrics = self.metrics
        for rid, count in result.tokens.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if stream.scheduled_s is None:
                stream.scheduled_s = start_s
                metrics.queue_time.observe(max(0.0, start_s - stream.arrival_s))
            if count <= 0:
                continue
            if stream.first_token_s is None:
                stream.first_token_s = end_s
                stream.cached_tokens = self.engine.cached_tokens(rid)
                metrics.ttft.observe(end_s - stream.arrival_s)
                scheduled_s = stream.arrival_s if stream.scheduled_s is None else stream.scheduled_s
                metrics.prefill_time.observe(end_s - scheduled_s)
                metrics.prompt_tokens.inc(stream.prompt_tokens)
            elif stream.last_token_s is not None:
                metrics.itl.observe((end_s - stream.last_token_s) / count)
            stream.last_token_s = end_s
            seed = self._seeds[rid]
            stream.pending.extend(
                self._token_source(seed, stream.generated + i) for i in range(count)
            )
            stream.generated += count
            metrics.generation_tokens.inc(count)
            stream._wake()
        for rid in result.finished:
            stream = self._streams.pop(rid, None)
            self._seeds.pop(rid, None)
            if stream is None:
                continue
            stream.finished = True
            stream._wake()
            metrics.e2e.observe(end_s - stream.arrival_s)
            metrics.request_prompt_tokens.observe(stream.prompt_tokens)
            metrics.request_generation_tokens.observe(stream.generated)
            metrics.request_finished("length")
        running_adapters = {
            s.adapter for s in self._streams.values()
            if s.adapter is not None and s.scheduled_s is not None
        }
        metrics.update_engine(self.engine.stats(), running_adapters, time.time())

    # ------------------------------------------------------------------ KV events

    def _event(self, record: KVEventRecord) -> KVEvent:
        if record.kind == "BlockStored":
            return BlockStored(
                block_hashes=list(record.block_hashes),
                parent_block_hash=record.parent_block_hash,
                token_ids=list(record.token_ids),
                block_size=record.block_size,
                lora_id=self.lora_id(record.lora_name) if record.lora_name else None,
                medium=MEDIUM_GPU,
                lora_name=record.lora_name,
                extra_keys=self._extra_keys(record),
                group_idx=0,
                # vLLM 0.32 tags every store with its KV-cache group's kind; the model is plain
                # full attention, as the simulated engine's roofline assumes.
                kv_cache_spec_kind="full_attention",
            )
        if record.kind == "BlockRemoved":
            return BlockRemoved(block_hashes=list(record.block_hashes), medium=MEDIUM_GPU,
                                group_idx=0)
        return AllBlocksCleared()

    def _extra_keys(self, record: KVEventRecord) -> list[tuple[str, ...] | None]:
        """vLLM's per-block ``extra_keys``: the adapter name, plus the salt on a first block."""
        salt = None
        if record.parent_block_hash is None and record.block_hashes:
            salt = self._root_salts.get(record.block_hashes[0])
        keys: list[tuple[str, ...] | None] = []
        for i in range(len(record.block_hashes)):
            block_keys: list[str] = []
            if record.lora_name:
                block_keys.append(record.lora_name)
            if salt and i == 0:
                block_keys.append(salt)
            keys.append(tuple(block_keys) if block_keys else None)
        return keys

