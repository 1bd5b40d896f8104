"""An asyncio subscriber for vLLM's KV-event stream, with gap replay.

``recv()`` returns the next ``(seq, EventBatch)``; iterating the subscriber does the same but logs
and skips malformed messages (the caller sees the skipped sequence number as a gap, which is what
it must react to anyway). ``request_replay(start_seq)`` asks the publisher's ROUTER socket for the
buffered batches from ``start_seq`` on.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from replica.kv_events.codec import EventBatch, KVEventDecodeError, decode_payload
from replica.kv_events.endpoints import allow_ipv6, subscriber_binds
from replica.kv_events.publisher import END_SEQ, shared_context

logger = logging.getLogger(__name__)


class KVEventSubscriber:
    """Receives KV-event batches from one vLLM engine (or a simulated one).

    ``endpoint`` is the subscriber's own side of the rule: a wildcard address
    (``tcp://*:5557``) is bound, for a publisher configured to connect; any other address
    (``tcp://10.0.0.7:5557``) is connected to, for a publisher that binds. ``bind`` overrides.
    Use ``subscriber_endpoint_for(publisher_endpoint)`` to derive it from the engine's setting.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "kv",
        replay_endpoint: str | None = None,
        bind: bool | None = None,
    ) -> None:
        self._ctx = zmq.asyncio.Context.shadow(shared_context().underlying)
        self._topic = topic.encode("utf-8")
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        allow_ipv6(self._sub, endpoint)
        should_bind = subscriber_binds(endpoint) if bind is None else bind
        if should_bind:
            self._sub.bind(endpoint)
            self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sub.connect(endpoint)
            self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        #: Messages dropped because they could not be decoded (by ``__aiter__``).
        self.decode_errors = 0
        self._closed = False

    async def recv(self) -> tuple[int, EventBatch]:
        """The next batch and its sequence number; ``KVEventDecodeError`` if it is malformed."""
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3:
                raise KVEventDecodeError(f"expected 3 frames, got {len(frames)}")
            topic, seq_bytes, payload = frames
            # SUBSCRIBE matches prefixes; "kv" must not also receive a topic "kv2".
            if topic != self._topic and self._topic:
                continue
            if len(seq_bytes) != 8:
                raise KVEventDecodeError(f"sequence frame has {len(seq_bytes)} bytes, not 8")
            return int.from_bytes(seq_bytes, "big"), decode_payload(payload)

    def __aiter__(self) -> AsyncIterator[tuple[int, EventBatch]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, EventBatch]]:
        while not self._closed:
            try:
                yield await self.recv()
            except KVEventDecodeError as exc:
                self.decode_errors += 1
                logger.warning("dropping malformed KV-event message: %s", exc)

    async def request_replay(
        self, start_seq: int, timeout_s: float = 5.0, *, partial: bool = False
    ) -> list[tuple[int, EventBatch]]:
        """Buffered batches with ``seq >= start_seq`` from the publisher's replay socket.

        Raises ``RuntimeError`` without a replay endpoint, ``TimeoutError`` when the publisher
        does not finish answering within ``timeout_s`` between messages. With ``partial``, a
        timeout after some batches returns those instead: a ROUTER drops what exceeds its
        high-water mark (the end marker included), so a long buffer arrives only in part.
        """
        if self.replay_endpoint is None:
            raise RuntimeError("no replay endpoint configured for this subscriber")
        # A fresh DEALER per request: a reply still in flight from an abandoned request can
        # never be mistaken for this one's.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # take a whole buffer's reply, however long
        allow_ipv6(dealer, self.replay_endpoint)
        dealer.connect(self.replay_endpoint)
        timeout_ms = int(timeout_s * 1000)
        batches: list[tuple[int, EventBatch]] = []
        try:
            await dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(timeout_ms):
                    if partial and batches:
                        return batches
                    raise TimeoutError(
                        f"KV-event replay from {self.replay_endpoint} timed out after {timeout_s}s"
                    )
                frames = await dealer.recv_multipart()
                # vLLM 0.32 replies [empty, topic, seq, payload]; accept the topic-less
                # three-frame form too, which earlier fleetgate publishers sent.
                if len(frames) == 4:
                    _, _topic, seq_bytes, payload = frames
                elif len(frames) == 3:
                    _, seq_bytes, payload = frames
                else:
                    raise KVEventDecodeError(
                        f"replay message has {len(frames)} frames, expected 4 (vLLM) or 3"
                    )
                if seq_bytes == END_SEQ:
                    return batches
                batches.append((int.from_bytes(seq_bytes, "big"), decode_payload(payload)))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        """Close the socket; a pending ``recv`` is cancelled by ZMQ."""
        if not self._closed:
            self._closed = True
            self._sub.close(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> KVEventSubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
