"""A ZMQ publisher of KV events that is wire-compatible with vLLM's ``ZmqEventPublisher``.

Every message is three frames: ``topic``, an 8-byte big-endian sequence number (0 for the first
batch of this publisher, +1 per batch) and the msgpack payload. When ``replay_endpoint`` is set,
a ROUTER socket answers ``[b"", start_seq(8 bytes)]`` with one ``[b"", seq, payload]`` message per
buffered batch whose ``seq >= start_seq``, then the end marker ``[b"", seq=-1, b""]``.

Unlike vLLM, which publishes from its own thread, this publisher is meant for one asyncio event
loop: ``publish`` never blocks (a PUB socket drops at its high-water mark instead) and replay
requests are served by ``serve_replay``, a coroutine the owner runs as a background task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

import zmq
import zmq.asyncio

from replica.kv_events.codec import EventBatch, KVEvent, encode_payload
from replica.kv_events.endpoints import allow_ipv6, publisher_binds

logger = logging.getLogger(__name__)

#: vLLM's end-of-replay marker: sequence number -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def shared_context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process-wide ZMQ context; one I/O thread serves every publisher and subscriber.

    Its socket cap is raised from ZeroMQ's 1,023 to the process's file limit: ``fleetgate up
    --sim 400`` (three sockets per simulated replica and agent) failed with "Too many open
    files" far below the real limit (the CLI review)."""
    global _sized
    context = zmq.Context.instance()
    if not _sized:
        _sized = True
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft > context.get(zmq.MAX_SOCKETS):
            context.set(zmq.MAX_SOCKETS, min(soft, 1 << 16))
    return context


_sized = False


def _async_context() -> zmq.asyncio.Context:
    # A shadow shares the process-wide context's I/O thread instead of starting another.
    return zmq.asyncio.Context.shadow(shared_context().underlying)


class KVEventPublisher:
    """Publishes ``EventBatch`` es on a PUB socket, with an optional ROUTER replay socket.

    ``endpoint`` follows vLLM's rule: one with ``*`` (or ``::``, ``ipc://``, ``inproc://``) is
    bound, any other is connected to. ``tcp://127.0.0.1:*`` binds a free port; ``endpoint`` then
    reports the address actually bound. Not thread-safe: call it from one thread.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        topic: str = "kv",
        replay_endpoint: str | None = None,
        buffer: int = 10_000,
        data_parallel_rank: int | None = 0,
        hwm: int = 100_000,
        legacy_array_format: bool = False,
    ) -> None:
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._next_seq = 0
        self._data_parallel_rank = data_parallel_rank
        self._legacy = legacy_array_format
        self._pub = shared_context().socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        allow_ipv6(self._pub, endpoint)
        if publisher_binds(endpoint):
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = _async_context().socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # A reply is the whole buffer (up to 10,000 batches); a ROUTER silently drops what
            # is over its high-water mark, the end marker with it.
            self._replay.setsockopt(zmq.SNDHWM, 0)
            allow_ipv6(self._replay, replay_endpoint)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._next_seq

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Publish ``events`` as one batch; returns its sequence number. Never blocks."""
        batch = EventBatch(
            ts=time.time() if ts is None else ts,
            events=list(events),
            data_parallel_rank=self._data_parallel_rank,
        )
        return self.publish_batch(batch)

    def publish_batch(self, batch: EventBatch) -> int:
        """Publish a prepared batch as is; returns its sequence number."""
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        payload = encode_payload(batch, legacy_array_format=self._legacy)
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            # A connecting PUB with no peer yet queues nothing; the replay buffer still has it.
            logger.debug("KV event batch %d not sent: no peer ready", seq)
        self._buffer.append((seq, payload))
        return seq

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled; returns at once without a replay socket."""
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring malformed KV-event replay request: %d frames", len(frames))
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # vLLM 0.32 frames each replayed batch as [empty, topic, seq, payload] and ends with
            # [empty, empty topic, seq -1, empty payload]; match it so one subscriber reads both.
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        (client_id, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Close both sockets; buffered batches are dropped."""
        if self._closed:
            return
        self._closed = True
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


@contextlib.asynccontextmanager
async def running_publisher(publisher: KVEventPublisher) -> AsyncIterator[KVEventPublisher]:
    """Serve ``publisher``'s replay socket in a task for the block's duration, then close it."""
    task = asyncio.create_task(publisher.serve_replay(), name="kv-event-replay")
    try:
        yield publisher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        publisher.close()
