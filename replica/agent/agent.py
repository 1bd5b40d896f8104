"""``ReplicaAgent``: the sidecar that keeps fleetgate's view of one vLLM engine true.

Three background loops and a one-off task, all started by ``start`` (the catch-up task by the
scrape loop) and cancelled and awaited by ``stop``:

* **events** — reads the engine's ZMQ KV events, checks sequence numbers (a gap asks the replay
  socket, else retires the epoch; a backward jump is a new engine process) and hands batches to
  the ``EventApplier``, which writes the block index;
* **scrape** — every ``scrape_interval_s`` probes ``/health``, reads ``/metrics`` and
  ``/v1/models``, publishes the ``ReplicaState`` to the fleet store with a TTL (the heartbeat) and
  heartbeats the index;
* **catch-up** — whenever the stream position is unknown (agent start, engine restart) and the
  engine answers ``/health``, replays every batch the engine still buffers, so the index learns
  what the engine already holds without waiting for its next batch (an idle engine may send none
  for a long time, and a replica that looks cold draws fewer requests to make it send one);
* **resync** — after a Redis outage, re-records the engine's live blocks under a fresh epoch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import httpx
import zmq
from aiohttp import web

from replica.agent.config import AgentConfig
from replica.agent.ingest import INDEX_DOWN_ERRORS, EventApplier
from replica.agent.kernels import build_kernel_reader
from replica.agent.metrics import AgentMetrics
from replica.agent.scrape import EngineScraper, EngineSnapshot
from replica.agent.sequence import SequenceTracker, SeqVerdict
from replica.agent.server import start_server
from replica.fleet_store import FleetStore, FleetStoreUnavailable, build_fleet_store
from replica.kv_events import EventBatch, KVEventDecodeError, KVEventSubscriber
from routing.contracts import BlockIndex, EpochAwareHeartbeat
from routing.index import build_index
from routing.index.stream_writer import StreamIndexWriter
from routing.state import ReplicaState
from routing.types import Epoch, ReplicaId

logger = logging.getLogger(__name__)

#: What a replay request can fail with (no answer in time, a bad frame, no socket).
_REPLAY_ERRORS = (TimeoutError, KVEventDecodeError, RuntimeError, zmq.ZMQError)

#: The engine must fail health probes this long before its return counts as a restart, so one
#: slow probe under load does not throw the replica's index entries away.
RESTART_AFTER_DOWN_S = 2.0
#: While the engine is down, how often the agent says so again (s).
DOWN_LOG_INTERVAL_S = 30.0
#: How long a known set of kernel plugins may read as none before it is published as none: past
#: the plugin's re-assert period (a third of its 10 s TTL), short of an engine's restart.
KERNELS_GONE_AFTER_S = 15.0


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True if it was set.

    Unlike ``asyncio.wait_for`` on Python 3.11, this never swallows a cancellation that arrives
    as the timeout fires, which would leave a loop running after ``stop``.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return event.is_set()


def _build_index(config: AgentConfig) -> BlockIndex:
    if config.index_url in (None, "", "memory", "memory://"):
        return build_index(None)
    if config.index_mode == "mirror":
        # Agents only write: the stream layout, without a mirror of the whole fleet.
        return StreamIndexWriter(  # type: ignore[return-value]
            config.index_url, key_prefix=config.index_key_prefix, timeout_s=1.0
        )
    return build_index(
        config.index_url, mode=config.index_mode, key_prefix=config.index_key_prefix, timeout_s=1.0
    )


class ReplicaAgent:
    """Runs beside one engine; ``async with ReplicaAgent(config):`` or ``start``/``stop``.

    ``index`` and ``fleet`` default to backends built from the config's URLs; pass shared ones
    to run several agents (or an agent and a gateway) in one process.
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        index: BlockIndex | None = None,
        fleet: FleetStore | None = None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.config = config
        self.replica = ReplicaId(config.replica_id)
        self.index = index if index is not None else _build_index(config)
        self._owns_index = index is None
        self.fleet = fleet if fleet is not None else build_fleet_store(
            config.fleet_url or config.index_url or None, config.fleet_key_prefix
        )
        self._owns_fleet = fleet is None
        self.metrics = metrics or AgentMetrics(config.replica_id)
        self.applier = EventApplier(
            self.index, self.replica, self.metrics,
            model=config.model, map_capacity=config.map_capacity,
        )
        self.applier.on_epoch_change(self._epoch_changed)
        self.metrics.index_behind(lambda: self.applier.dirty)
        self.scraper = EngineScraper(config.engine_url)
        # The engine's vLLM plugin records its kernel plugins in the fleet's Redis.
        self.kernel_reader = build_kernel_reader(
            config.fleet_url or config.index_url or None, config.fleet_key_prefix,
            config.replica_id,
        )
        #: Kernel plugins the engine reported loaded (module -> version), as last read.
        self.kernel_plugins: dict[str, str] = {}
        #: Since when a known kernel set has read as none (``_note_kernels``).
        self._kernels_missing_since: float | None = None
        self.tracker = SequenceTracker()
        #: Serialises the stream position (``tracker``) between live batches and the catch-up.
        self._stream_lock = asyncio.Lock()
        #: The stream position is unknown (start, engine restart): catch up once the engine
        #: answers; the task doing it, while it runs.
        self._catch_up_due = True
        self._catch_up_task: asyncio.Task[None] | None = None
        #: The wall-clock stamp of each batch the last open-ended catch-up replayed, until the
        #: live stream passes them: a live batch of the same number and stamp, received while
        #: the replay ran, is one of them again; another stamp is a new engine process's.
        self._replayed_ts: dict[int, float] = {}
        #: The first batch the SUB socket delivered from this engine process: an open-ended
        #: catch-up stops there, and the live stream goes on from it.
        self._first_live_seq: int | None = None
        self.subscriber: KVEventSubscriber | None = None
        self.snapshot: EngineSnapshot | None = None
        self.engine_up = False
        #: Set by ``leave``: the replica reports its engine down so that gateways send it
        #: nothing new while the requests in flight finish.
        self._leaving = False
        #: When the engine last showed progress (a new step, or nothing to do), and whether it
        #: is stalled now (``AgentConfig.stall_after_s``).
        self._progress_at = time.monotonic()
        self._last_progress: tuple[int, float] | None = None
        self.stalled = False
        self._health_failures = 0
        #: The last scrape's page could not be read (said once per spell).
        self._unreadable = False
        #: Batches applied, for tests and /health.
        self.batches_applied = 0
        self._down_since: float | None = None
        self._down_logged_at = 0.0
        self._ever_up = False
        self._model_known = asyncio.Event()
        if config.model is not None:
            self._model_known.set()
        self._registered_epoch: Epoch | None = None
        #: The last fleet-store write failed (its warning is logged once per outage).
        self._fleet_store_down = False
        #: The fleet store ever took this replica's registration (else leaving removes nothing).
        self._ever_registered = False
        self._wake_publisher = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._server: web.AppRunner | None = None
        #: The agent's own HTTP port once started (``listen_port`` 0 picks one).
        self.listen_port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Declare the first epoch, connect to the event stream, start the loops and server."""
        await self.applier.start()
        if self.config.kv_events_endpoint is not None:
            self.subscriber = KVEventSubscriber(
                self.config.kv_events_endpoint,
                self.config.kv_events_topic,
                self.config.replay_endpoint,
            )
            self._tasks.append(asyncio.create_task(self._events_loop(), name="agent-events"))
        self._tasks.append(asyncio.create_task(self._scrape_loop(), name="agent-scrape"))
        self._tasks.append(asyncio.create_task(self._resync_loop(), name="agent-resync"))
        if self.config.listen_port is not None:
            self._server, self.listen_port = await start_server(
                self, self.config.listen_host, self.config.listen_port
            )

    async def stop(self, deregister: bool = True) -> None:
        """Cancel and await every loop; remove the replica from the fleet store if asked."""
        # The flag ends each loop at its next turn even if a library swallowed the cancellation
        # (a lost cancel would otherwise leave stop() waiting forever); cancel again until done.
        self._stopping = True
        pending = set(self._tasks)
        if self._catch_up_task is not None:
            pending.add(self._catch_up_task)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.5)
            if pending:
                logger.warning("replica %s: %d loops still stopping", self.replica, len(pending))
        self._tasks.clear()
        if self._server is not None:
            await self._server.cleanup()
            self._server = None
        if self.subscriber is not None:
            self.subscriber.close()
        if deregister:
            try:
                await self.fleet.remove(self.replica)
            except FleetStoreUnavailable as exc:
                # Gateways keep routing to an engine that still answers until they hear it left
                # (or an hour passes): say so, the operator may need to stop the engine too. A
                # replica never registered is known to no gateway through the store.
                log = logger.warning if self._ever_registered else logger.debug
                log(
                    "could not remove replica %s from the fleet store (%s): gateways keep "
                    "routing to it while its engine answers, for up to an hour",
                    self.replica,
                    exc,
                )
            await self._retire_on_leaving()
        await self.scraper.close()
        if self.kernel_reader is not None:
            await self.kernel_reader.close()
        if self._owns_index:
            await self.index.close()
        if self._owns_fleet:
            await self.fleet.close()

    async def leave(self) -> None:
        """The replica is about to stop: report its engine down at once, so that gateways send
        it nothing new while the requests it holds finish (``stop`` deregisters it after).
        Its blocks stay matched meanwhile: the engine still holds them."""
        self._leaving = True
        await self.publish_state()

    def requests_in_engine(self, read_after: float) -> int | None:
        """Requests running or waiting in the engine by a ``/metrics`` read made after
        ``read_after`` (``time.time()``); None until there is one."""
        snap = self.snapshot
        if snap is None or snap.read_at <= read_after:
            return None
        return snap.running + snap.waiting

    async def _retire_on_leaving(self) -> None:
        """The replica leaves the fleet: retire its epoch, so that every gateway forgets its
        blocks at once and the index drops them (left behind, they would stay in Redis and be
        loaded by every gateway that starts later). Best effort: Redis may be gone too."""
        epoch = self.applier.epoch
        if epoch is None:
            return
        try:
            await self.index.retire_epoch(self.replica, epoch)
        except Exception as exc:  # leaving anyway: the keys expire on their own
            logger.warning(
                "replica %s: could not retire its epoch on leaving: %s", self.replica, exc
            )

    async def __aenter__(self) -> ReplicaAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait(self) -> None:
        """Block while the loops run; if one dies (a bug), re-raise its exception."""
        if not self._tasks:
            raise RuntimeError("ReplicaAgent.wait before start")
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()

    # ------------------------------------------------------------------ engine restarts

    async def engine_restarted(self) -> None:
        """A new engine process: new epoch, forget its hashes and stream position.

        Called by the supervisor (``fleetgate replica run``) when it restarts the engine, and by
        the agent itself on a backward sequence jump or a health outage.
        """
        # A catch-up still replaying the old process must not record its blocks under the new
        # epoch: cancelled here, before the epoch changes, and run again for the new process.
        if self._catch_up_task is not None:
            self._catch_up_task.cancel()
        self._catch_up_due = True
        self._replayed_ts = {}
        self._first_live_seq = None
        self.tracker.reset()
        # The health watch must not count this same restart again when the engine comes back.
        self._ever_up = False
        self._down_since = None
        # A new process has not stalled: its first readings decide.
        self.stalled = False
        self._progress_at = time.monotonic()
        self._last_progress = None
        await self.applier.new_epoch("restart", forget_hashes=True)

    async def _epoch_changed(self, epoch: Epoch) -> None:
        self._wake_publisher.set()

    # ------------------------------------------------------------------ events

    async def _events_loop(self) -> None:
        assert self.subscriber is not None
        while not self._stopping:
            try:
                seq, batch = await self.subscriber.recv()
            except KVEventDecodeError as exc:
                # The lost batch shows up as a sequence gap, handled there.
                logger.warning("replica %s: malformed KV-event message: %s", self.replica, exc)
                continue
            await self.handle_batch(seq, batch)

    async def handle_batch(self, seq: int, batch: EventBatch) -> None:
        """Apply one received batch, first repairing the stream if ``seq`` is not the next one."""
        if self._first_live_seq is None:
            self._first_live_seq = seq  # where a catch-up running now may stop (``_catch_up``)
        async with self._stream_lock:
            await self._handle_batch(seq, batch)

    async def _handle_batch(self, seq: int, batch: EventBatch) -> None:
        if self._replayed_ts:
            if self._replayed_ts.get(seq) == batch.ts:
                return  # the catch-up applied it already (the SUB socket queued it meanwhile)
            # Past the replay, or a batch the replay never had: a new engine process starting
            # again from 0 (a fast restart), which the classification below must see.
            self._replayed_ts = {}
        verdict = self.tracker.classify(seq)
        if verdict is SeqVerdict.RESTART:
            logger.info(
                "replica %s: event sequence went back to %d (expected %s): engine restarted",
                self.replica, seq, self.tracker.expected,
            )
            await self.engine_restarted()
        if self.tracker.expected is None and seq > 0:
            # This agent's first batch of this engine process, and not the process's first.
            await self._catch_up(seq)
        elif verdict is SeqVerdict.GAP:
            self.metrics.gap()
            expected = self.tracker.expected
            assert expected is not None
            if not await self._replay(expected, seq):
                logger.warning(
                    "replica %s: lost KV events %d..%d; retiring the epoch",
                    self.replica, expected, seq - 1,
                )
                await self.applier.new_epoch("gap")
        await self._model_known.wait()
        await self.applier.apply_batch(batch)
        self.tracker.accept(seq)
        self.batches_applied += 1

    def _start_catch_up_if_due(self) -> None:
        """The engine answers: if the stream position is unknown, replay its buffer now."""
        subscriber = self.subscriber
        if not self._catch_up_due or subscriber is None or subscriber.replay_endpoint is None:
            return
        if self._catch_up_task is not None and not self._catch_up_task.done():
            return
        self._catch_up_due = False
        task = asyncio.create_task(self._catch_up_now(), name="agent-catch-up")
        task.add_done_callback(self._catch_up_ended)
        self._catch_up_task = task

    def _catch_up_ended(self, task: asyncio.Task[None]) -> None:
        # Not one of the loops ``wait`` watches (an engine restart cancels it): say so here.
        if not task.cancelled() and task.exception() is not None:
            logger.error("replica %s: KV-event catch-up failed", self.replica,
                         exc_info=task.exception())

    async def _catch_up_now(self) -> None:
        """Apply every batch the engine buffers, then expect the one after the last."""
        async with self._stream_lock:
            if self.tracker.expected is not None:
                return  # a live batch came first and caught up from its own number
            last = await self._catch_up(None)
            if last is not None:
                self.tracker.accept(last)

    async def _catch_up(self, first_seq: int | None) -> int | None:
        """Apply every batch the replay socket still buffers before ``first_seq`` (None: all of
        them); returns the last one applied, None if none. The buffer is bounded (vLLM's holds
        the latest batches), so this recovers what the engine stored recently, and blocks whose
        parent came before the buffer are skipped as unkeyable; without a replay socket the
        index stays cold, as before."""
        subscriber = self.subscriber
        if subscriber is None or subscriber.replay_endpoint is None:
            return None
        # Asked again from where each partial answer stopped: a publisher whose socket drops
        # what is over its high-water mark sends a long buffer a part at a time. Open-ended,
        # it ends at an answer with nothing new or at the first batch the live stream
        # delivered, whichever comes first: a busy engine publishes a batch per request, and a
        # catch-up that chased them all held the stream (the live batches waiting on it) for
        # as long as the traffic lasted (the real-vLLM e2e tier: no batch applied in 30 s).
        earlier: list[tuple[int, EventBatch]] = []
        start = 0
        while start < (end := self._catch_up_end(first_seq)):
            try:
                replayed = await subscriber.request_replay(
                    start, self.config.catch_up_timeout_s, partial=True
                )
            except _REPLAY_ERRORS as exc:
                logger.warning(
                    "replica %s: KV-event catch-up replay failed: %s", self.replica, exc
                )
                self.metrics.replay(ok=False)
                break
            got = sorted((s, b) for s, b in replayed if start <= s < end)
            if not got:
                break
            earlier += got
            start = got[-1][0] + 1
        if not earlier:
            return None
        await self._model_known.wait()
        if first_seq is None:  # an open-ended catch-up: live copies of these may follow
            self._replayed_ts = {seq: batch.ts for seq, batch in earlier}
        recorded = await self.applier.absorb([batch for _, batch in earlier])
        self.batches_applied += len(earlier)
        self.metrics.replay(ok=True)
        logger.info(
            "replica %s: caught up on %d earlier KV-event batches (%d..%d) the engine buffered: "
            "%d blocks live", self.replica, len(earlier), earlier[0][0], earlier[-1][0], recorded,
        )
        return earlier[-1][0]

    def _catch_up_end(self, first_seq: int | None) -> float:
        """Where a catch-up stops: before ``first_seq``, else before the first live batch."""
        if first_seq is not None:
            return first_seq
        return self._first_live_seq if self._first_live_seq is not None else math.inf

    async def _replay(self, start: int, stop: int) -> bool:
        """Fetch and apply batches ``start..stop-1`` from the replay socket; all or nothing."""
        if self.subscriber is None or self.subscriber.replay_endpoint is None:
            return False
        try:
            replayed = await self.subscriber.request_replay(start, self.config.replay_timeout_s)
        except _REPLAY_ERRORS as exc:
            logger.warning("replica %s: KV-event replay failed: %s", self.replica, exc)
            self.metrics.replay(ok=False)
            return False
        wanted = sorted((s, b) for s, b in replayed if start <= s < stop)
        if [s for s, _ in wanted] != list(range(start, stop)):
            self.metrics.replay(ok=False)
            return False
        await self._model_known.wait()
        for s, batch in wanted:
            await self.applier.apply_batch(batch)
            self.tracker.accept(s)
            self.batches_applied += 1
        self.metrics.replay(ok=True)
        return True

    # ------------------------------------------------------------------ scrape and publish

    async def _scrape_loop(self) -> None:
        last_heartbeat = 0.0
        heartbeat_every = max(self.config.scrape_interval_s, self.config.heartbeat_ttl_s / 3)
        while not self._stopping:
            started = time.monotonic()
            await self.scrape_once()
            await self.publish_state()
            # No heartbeat for an engine that is down: its entries then stop matching once the
            # heartbeat expires, instead of drawing requests (last-resort routing included) to
            # a replica that holds nothing; the restart brings a new epoch and new heartbeats.
            if (
                started - last_heartbeat >= heartbeat_every
                and not self.applier.dirty
                and self.engine_up
            ):
                last_heartbeat = started
                await self._index_heartbeat()
            elapsed = time.monotonic() - started
            self._wake_publisher.clear()
            await wait_event(
                self._wake_publisher, max(0.0, self.config.scrape_interval_s - elapsed)
            )

    async def scrape_once(self) -> None:
        """Probe health, then read the engine's figures, in at most half the heartbeat TTL.

        A busy engine can take seconds to answer; the fleet-store entry must not expire
        meanwhile (the gateway would drop a replica that is merely slow), so the probe and the
        reading together get at most ``heartbeat_ttl_s / 2``. A probe not answered within it
        is a failed probe (a hung engine accepts connections and never answers: cancelling
        the probe uncounted kept such an engine "up" for ever); figures not read within it
        are published again as they were.
        """
        budget_s = self.config.heartbeat_ttl_s / 2
        started = time.monotonic()
        try:
            async with asyncio.timeout(budget_s):
                up = await self.scraper.healthy()
        except TimeoutError:
            up = False
        await self._note_health(up)
        if not up:
            return
        self._start_catch_up_if_due()
        try:
            await asyncio.wait_for(
                self._read_figures(), max(0.0, budget_s - (time.monotonic() - started))
            )
        except TimeoutError:
            logger.debug("replica %s: figures slower than %.1fs; republishing the last ones",
                         self.replica, budget_s)

    async def _note_health(self, up: bool) -> None:
        """One probe's answer: log an outage, detect a restart by it, apply the miss rule."""
        now = time.monotonic()
        if not up and self._down_since is None:
            self._down_since = now
            self._down_logged_at = now
            # One missed probe is no outage (the rule below); an engine the supervisor is
            # stopping on purpose is none either.
            logger.log(
                logging.INFO if self._leaving else logging.DEBUG,
                "replica %s: engine at %s does not answer its health check%s",
                self.replica,
                self.config.engine_url,
                " (the replica is leaving)" if self._leaving
                else "" if self._ever_up else " (not up yet)",
            )
        elif not up and now - self._down_logged_at >= DOWN_LOG_INTERVAL_S:
            self._down_logged_at = now
            logger.warning(
                "replica %s: engine at %s still down after %.0fs",
                self.replica,
                self.config.engine_url,
                now - (self._down_since or now),
            )
        if up:
            down_for = now - self._down_since if self._down_since is not None else 0.0
            if self._ever_up and down_for >= RESTART_AFTER_DOWN_S:
                logger.info("replica %s: engine back after %.1fs down", self.replica, down_for)
                await self.engine_restarted()
            self._down_since = None
            self._ever_up = True
        # One missed probe (a CPU stall, a long prefill) is not an outage: the replica leaves
        # routing after two in a row. Restart detection above still uses every raw answer.
        self._health_failures = 0 if up else self._health_failures + 1
        was_up = self.engine_up
        self.engine_up = up or (self.engine_up and self._health_failures < 2)
        if was_up and not self.engine_up and not self._leaving:
            logger.warning(
                "replica %s: engine at %s missed %d health checks in a row: reported down",
                self.replica,
                self.config.engine_url,
                self._health_failures,
            )
        self.metrics.engine_up(self.serving)

    async def _read_figures(self) -> None:
        """Read ``/metrics``, ``/v1/models`` and the kernel report into the snapshot."""
        started = time.perf_counter()
        try:
            snapshot = await self.scraper.snapshot()
        except httpx.HTTPError as exc:
            logger.debug("replica %s: scrape failed: %s", self.replica, exc)
            return
        except Exception as exc:  # a page it cannot read: keep the last figures, go on
            # Any error here once ended the loop that also publishes the replica's heartbeat
            # (an infinite sample: the routing review, session 46). Said once per spell.
            if not self._unreadable:
                logger.warning(
                    "replica %s: the engine's figures are unreadable (%s); keeping the last "
                    "ones until they read again",
                    self.replica,
                    exc,
                )
            self._unreadable = True
            return
        if self._unreadable:
            logger.info("replica %s: the engine's figures read again", self.replica)
            self._unreadable = False
        self.metrics.scrape_seconds(time.perf_counter() - started)
        self.snapshot = snapshot
        self._note_progress(snapshot)
        if self.kernel_reader is not None:
            kernels = await self.kernel_reader.read()
            if kernels is not None:
                self._note_kernels(kernels, time.monotonic())
        if self.applier.model is None and snapshot.models:
            self.applier.model = snapshot.models[0]
            self._model_known.set()

    def _note_kernels(self, kernels: dict[str, str], now: float) -> None:
        """Publish the kernel plugins read. A known set read as none is kept for up to
        ``KERNELS_GONE_AFTER_S``: Redis lost the key (a restart without persistence, a failover
        before replication) and the engine's plugin writes it again within a third of its TTL;
        published at once, the gap took the replica out of kernel-gated routes (16 of 40
        requests got 503 in the failover review)."""
        if kernels or not self.kernel_plugins:
            self.kernel_plugins = kernels
            self._kernels_missing_since = None
            return
        if self._kernels_missing_since is None:
            self._kernels_missing_since = now
        elif now - self._kernels_missing_since >= KERNELS_GONE_AFTER_S:
            self.kernel_plugins = {}
            self._kernels_missing_since = None

    @property
    def leaving(self) -> bool:
        """``leave`` was called: the replica is being stopped on purpose."""
        return self._leaving

    @property
    def serving(self) -> bool:
        """The engine answers its health checks and is not stalled."""
        return self.engine_up and not self.stalled

    def _note_progress(self, snapshot: EngineSnapshot) -> None:
        """Is the engine stalled: holding requests, yet no step finished for ``stall_after_s``?

        vLLM's ``/health`` asks its server, which answers while the EngineCore (or the GPU
        under it) is hung: requests sent there wait for the gateway's upstream timeout. vLLM
        counts only steps that produce output, so a request's prefill alone moves no step
        count; its chunks take KV blocks, so the KV usage moves instead: progress is either.
        A hung EngineCore sends no figures at all, and both stand still.
        """
        now = time.monotonic()
        steps = snapshot.steps_total
        progress = None if steps is None else (steps, snapshot.kv_usage)
        if (
            progress is None
            or snapshot.running + snapshot.waiting == 0
            or progress != self._last_progress
        ):
            self._progress_at = now
        self._last_progress = progress
        limit = self.config.stall_after_s
        stalled = limit is not None and now - self._progress_at >= limit
        if stalled and not self.stalled:
            logger.warning(
                "replica %s: the engine holds %d request(s) but has finished no step for %.0fs "
                "(a hung EngineCore or GPU?); reported down until it moves again",
                self.replica, snapshot.running + snapshot.waiting, now - self._progress_at,
            )
        elif self.stalled and not stalled:
            logger.warning("replica %s: the engine is making progress again", self.replica)
        if stalled != self.stalled:
            self.stalled = stalled
            self.metrics.engine_up(self.serving)

    def state(self) -> ReplicaState:
        """The replica as gateways should see it now."""
        snap = self.snapshot or EngineSnapshot(read_at=0.0)
        models = frozenset(snap.models) or (
            frozenset({self.applier.model}) if self.applier.model else frozenset()
        )
        return ReplicaState(
            replica_id=self.replica,
            url=self.config.public_url,
            pool=self.config.pool,
            models=models,
            healthy=self.serving and not self._leaving,
            draining=self.serving and self._leaving,
            epoch=self.applier.epoch if self.applier.epoch is not None else Epoch(0),
            block_size=snap.block_size or ReplicaState.block_size,
            kv_capacity_blocks=snap.num_gpu_blocks,
            kv_usage=snap.kv_usage,
            # From the engine's own KV events: its usage gauge misses cached blocks not in use.
            cached_blocks=self.applier.hashes.live_count,
            running=snap.running,
            waiting=snap.waiting,
            preemptions_total=snap.preemptions_total,
            # Registered adapters serve without a load call; running ones are surely resident.
            loaded_adapters=snap.adapters | snap.running_adapters,
            running_adapters=snap.running_adapters,
            waiting_adapters=snap.waiting_adapters,
            max_loras=snap.max_loras,
            max_cpu_loras=self.config.max_cpu_loras,
            kernel_plugins=dict(self.kernel_plugins),
            metrics_read_at=snap.read_at,
        )

    async def publish_state(self) -> None:
        """Register (after an epoch change) or refresh the replica in the fleet store."""
        state = self.state()
        try:
            if state.epoch != self._registered_epoch:
                await self.fleet.register(state, self.config.heartbeat_ttl_s)
                self._registered_epoch = state.epoch
                self._ever_registered = True
            else:
                await self.fleet.publish(state, self.config.heartbeat_ttl_s)
        except FleetStoreUnavailable as exc:
            self.metrics.redis_error()
            self._registered_epoch = None  # register again once the store is back
            if self._fleet_store_down:
                logger.debug("replica %s: fleet store write failed: %s", self.replica, exc)
            else:
                # Once per outage: while it lasts no gateway discovers this replica (one that
                # never registered left nothing else in the log: the TLS review).
                self._fleet_store_down = True
                logger.warning(
                    "replica %s: cannot register in the fleet store (%s); gateways that discover "
                    "replicas through it do not see this one until it can; retrying",
                    self.replica,
                    exc,
                )
            return
        if self._fleet_store_down:
            self._fleet_store_down = False
            logger.info("replica %s: registered in the fleet store again", self.replica)

    async def _index_heartbeat(self) -> None:
        try:
            if isinstance(self.index, EpochAwareHeartbeat):
                known = await self.index.heartbeat_known(self.replica, self.config.heartbeat_ttl_s)
                if not known and not self.applier.dirty:
                    # Redis forgot our epoch (FLUSHALL, a restart without persistence): without
                    # this the index stayed cold until the engine stored its blocks again.
                    self.metrics.index_lost()
                    self.applier.dirty = True
                    logger.warning(
                        "replica %s: Redis lost the index entries; re-publishing", self.replica
                    )
            else:
                await self.index.heartbeat(self.replica, self.config.heartbeat_ttl_s)
        except INDEX_DOWN_ERRORS as exc:
            # A Redis that failed may come back empty: resync re-records what the engine holds.
            self.metrics.redis_error()
            self.applier.dirty = True
            logger.debug("replica %s: index heartbeat failed: %s", self.replica, exc)

    # ------------------------------------------------------------------ resync

    async def _resync_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.resync_interval_s)
            if self.applier.dirty and await self.applier.resync() and self.engine_up:
                await self._index_heartbeat()
