"""In-flight load per replica: requests, not-yet-prefilled prompt tokens, and the requests still
waiting for their first token.

One gateway counts in memory. Several gateways share counts through Redis: each publishes its own
counts in a field of one hash per fleet and reads the sum of everyone's (``RedisInflight``; a
crashed gateway's field is dropped once it stops changing). Publishing is periodic, never on the
request path, so Redis being slow or down costs a little freshness and no latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Protocol

from routing.types import ReplicaId

log = logging.getLogger(__name__)

#: The least time between two "in-flight sync failed" warnings (the sync runs 4 times a second).
_WARN_EVERY_S = 30.0

Counts = dict[ReplicaId, tuple[int, int]]

#: Ended requests remembered per replica for ``ended_since``: more than end in one scrape
#: interval on any engine (a few hundred a second at most, read several times a second).
ENDED_KEPT = 512


class InflightTracker(Protocol):
    """Counts requests in flight per replica."""

    def start(self, replica: ReplicaId, prefill_tokens: int) -> None: ...

    def prefilled(self, replica: ReplicaId, prefill_tokens: int) -> None: ...

    def finish(
        self,
        replica: ReplicaId,
        prefill_tokens: int,
        started_at: float | None = None,
        awaiting_prefill: bool = False,
    ) -> None: ...

    def counts(self) -> Counts: ...

    def awaiting_prefill(self, replica: ReplicaId) -> int:
        """Requests in flight on ``replica`` whose first token has not arrived."""
        ...

    def count(self, replica: ReplicaId) -> tuple[int, int]:
        """(requests, unprefilled prompt tokens) in flight on ``replica``."""
        ...

    def take_changed(self) -> set[ReplicaId]:
        """The replicas whose counts or ended requests changed since the last call (and forget
        them): what a reader of ``count`` and ``ended_since`` has to look at again."""
        ...

    def ended_since(self, replica: ReplicaId, read_at: float) -> int: ...

    def others_in_flight(self, replica: ReplicaId) -> int:
        """Requests other gateways have in flight on ``replica`` (0 alone), as last synced."""
        ...

    async def sync(self) -> None: ...

    async def close(self) -> None: ...


class MemoryInflight:
    """This gateway's own counts."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._requests: dict[ReplicaId, int] = defaultdict(int)
        self._tokens: dict[ReplicaId, int] = defaultdict(int)
        #: Per replica, the requests in flight whose first token has not arrived.
        self._awaiting: dict[ReplicaId, int] = defaultdict(int)
        #: Per replica, the last requests that ended: (sent at, ended at), wall-clock seconds.
        self._ended: dict[ReplicaId, deque[tuple[float, float]]] = {}
        self._clock = clock
        #: Replicas whose figures changed since ``take_changed`` last ran.
        self._changed: set[ReplicaId] = set()

    def start(self, replica: ReplicaId, prefill_tokens: int) -> None:
        """A request was sent to ``replica``; its prompt is not prefilled yet."""
        self._requests[replica] += 1
        self._tokens[replica] += prefill_tokens
        self._awaiting[replica] += 1
        self._changed.add(replica)

    def prefilled(self, replica: ReplicaId, prefill_tokens: int) -> None:
        """The first byte arrived: the engine has prefilled the prompt."""
        self._tokens[replica] = max(0, self._tokens[replica] - prefill_tokens)
        self._awaiting[replica] = max(0, self._awaiting[replica] - 1)
        self._changed.add(replica)

    def finish(
        self,
        replica: ReplicaId,
        prefill_tokens: int,
        started_at: float | None = None,
        awaiting_prefill: bool = False,
    ) -> None:
        """The request ended; ``prefill_tokens`` is what is still counted as unprefilled (or 0),
        and ``awaiting_prefill`` whether its first token never arrived (``prefilled`` was not
        called for it).

        ``started_at`` (wall clock) is when it was sent: with it, ``ended_since`` can tell an
        engine reading that still counted this request.
        """
        self._requests[replica] = max(0, self._requests[replica] - 1)
        self._tokens[replica] = max(0, self._tokens[replica] - prefill_tokens)
        if awaiting_prefill:
            self._awaiting[replica] = max(0, self._awaiting[replica] - 1)
        self._changed.add(replica)
        if started_at is not None:
            ended = self._ended.get(replica)
            if ended is None:
                ended = self._ended[replica] = deque(maxlen=ENDED_KEPT)
            ended.append((started_at, self._clock()))

    def counts(self) -> Counts:
        return {r: (n, self._tokens[r]) for r, n in self._requests.items()}

    def count(self, replica: ReplicaId) -> tuple[int, int]:
        return self._requests.get(replica, 0), self._tokens.get(replica, 0)

    def awaiting_prefill(self, replica: ReplicaId) -> int:
        return self._awaiting.get(replica, 0)

    def take_changed(self) -> set[ReplicaId]:
        changed, self._changed = self._changed, set()
        return changed

    def ended_since(self, replica: ReplicaId, read_at: float) -> int:
        """Requests this gateway sent to ``replica`` before ``read_at`` that have ended since.

        An engine reading taken at ``read_at`` may still count them as running: they are the
        ones it is stale about. Requests sent after the reading were never in it.
        """
        ended = self._ended.get(replica)
        if not ended or ended[-1][1] <= read_at:
            return 0  # the usual case: nothing ended since the reading
        count = 0
        for sent_at, ended_at in reversed(ended):
            if ended_at <= read_at:
                break
            if sent_at <= read_at:
                count += 1
        return count

    def others_in_flight(self, replica: ReplicaId) -> int:
        return 0

    async def sync(self) -> None:
        return None

    async def close(self) -> None:
        return None


class RedisInflight(MemoryInflight):
    """Local counts plus the other gateways' counts, shared through Redis.

    One Redis hash per fleet (``fleetgate:inflight:<fleet>``), one field per gateway: its counts
    and a sequence number that each sync moves on. A sync writes its field and reads the hash in
    one round trip, whatever else the Redis holds. A field whose sequence has not moved for
    ``ttl_s`` (on the reader's own clock: no two machines' clocks are compared) is a gateway that
    stopped without removing it, and is dropped; so is a field that cannot be read (one such
    field must not stop every gateway's sync). The whole hash expires ``ttl_s`` after the last
    write. The counts were one key per gateway, found by a SCAN of the whole keyspace four times
    a second: 0.6 s per sync beside 300,000 keys (a lookup-mode index, stored responses), seconds
    with a million, and so stale figures. Gateways of builds before it keep those keys: during an
    upgrade from one, old and new gateways do not see each other's counts.
    """

    KEY_PREFIX = "fleetgate:inflight:"

    def __init__(
        self,
        redis_url: str,
        ttl_s: float = 5.0,
        gateway_id: str | None = None,
        fleet: str | None = None,
    ) -> None:
        """``fleet`` names the gateways that share counts (the index key prefix: gateways
        sharing an index route the same replicas); gateways of other fleets on the same Redis,
        and gateways of this one stopped less than ``ttl_s`` ago, must not count here."""
        super().__init__()
        #: The fleet's hash of per-gateway counts.
        self.key = f"{self.KEY_PREFIX}{fleet or 'default'}"
        from routing.redis_clients import bounded_client

        self._redis = bounded_client(redis_url, 0.5)
        self._ttl_s = ttl_s
        self.gateway_id = gateway_id or uuid.uuid4().hex
        self._others: Counts = {}
        #: Each sync's number, written with our counts (readers see it move).
        self._seq = 0
        #: Other gateways' fields: (their last sequence number, when we saw it move, monotonic).
        self._seen: dict[str, tuple[object, float]] = {}
        #: The other gateways' requests awaiting their first token, per replica (a gateway that
        #: does not publish them counts all its requests).
        self._others_awaiting: dict[ReplicaId, int] = {}
        #: When a sync last read the other gateways' counts (monotonic seconds).
        self._synced_at = time.monotonic()
        self._warned_at = -math.inf

    def count(self, replica: ReplicaId) -> tuple[int, int]:
        n, t = super().count(replica)
        on, ot = self._others.get(replica, (0, 0))
        return n + on, t + ot

    def awaiting_prefill(self, replica: ReplicaId) -> int:
        return super().awaiting_prefill(replica) + self._others_awaiting.get(replica, 0)

    def others_in_flight(self, replica: ReplicaId) -> int:
        return self._others.get(replica, (0, 0))[0]

    def counts(self) -> Counts:
        own = super().counts()
        merged: dict[ReplicaId, tuple[int, int]] = dict(self._others)
        for rid, (n, t) in own.items():
            on, ot = merged.get(rid, (0, 0))
            merged[rid] = (on + n, ot + t)
        return merged

    async def sync(self) -> None:
        """Publish our counts and read everyone else's; errors only cost freshness."""
        try:
            published = {
                rid: (n, t, self._awaiting.get(rid, 0))  # our own, not the merged count
                for rid, (n, t) in super().counts().items()
            }
            self._seq += 1
            entry = json.dumps({"seq": self._seq, "counts": published})
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(self.key, self.gateway_id, entry)
                # The whole hash goes when no gateway has written for a while (all stopped).
                pipe.pexpire(self.key, int(self._ttl_s * 1000))
                pipe.hgetall(self.key)
                *_, fields = await pipe.execute()
            now = time.monotonic()
            others: dict[ReplicaId, tuple[int, int]] = {}
            others_awaiting: dict[ReplicaId, int] = {}
            gone = []
            seen: dict[str, tuple[object, float]] = {}
            for field_name, raw in fields.items():
                name = field_name.decode() if isinstance(field_name, bytes) else field_name
                if name == self.gateway_id:
                    continue
                try:
                    other = json.loads(raw)
                    figures_by_replica = {
                        ReplicaId(rid): (int(f[0]), int(f[1]), int(f[2]) if len(f) > 2 else None)
                        for rid, f in other["counts"].items()
                    }
                    seq = other["seq"]
                except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                    gone.append(name)  # unreadable: dropped, never a reason to stop syncing
                    continue
                last_seq, moved_at = self._seen.get(name, (None, now))
                if seq != last_seq:
                    moved_at = now
                elif now - moved_at > self._ttl_s:
                    gone.append(name)  # a gateway that stopped without removing its field
                    continue
                seen[name] = (seq, moved_at)
                for replica, (n, t, awaiting) in figures_by_replica.items():
                    on, ot = others.get(replica, (0, 0))
                    others[replica] = (on + n, ot + t)
                    # [requests, tokens] only: all of its requests may be waiting.
                    waiting = n if awaiting is None else awaiting
                    others_awaiting[replica] = others_awaiting.get(replica, 0) + waiting
            self._seen = seen
            # Where the other gateways' counts moved, readers must look again.
            previous, previous_awaiting = self._others, self._others_awaiting
            moved = previous.keys() | others.keys()
            self._changed.update(
                rid
                for rid in moved
                if previous.get(rid) != others.get(rid)
                or previous_awaiting.get(rid) != others_awaiting.get(rid)
            )
            self._others = others
            self._others_awaiting = others_awaiting
            if self._warned_at > -math.inf and self._synced_at < self._warned_at:
                log.info("in-flight sync through Redis works again")
            self._synced_at = time.monotonic()
            if gone:
                await self._redis.hdel(self.key, *gone)
        except Exception as exc:  # redis errors, bad JSON from a foreign field
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # redis-py can turn the cancellation of a command in flight into a connection
                # error: swallowed here, the sync loop would outlive a shutdown that cancelled it
                # (seen: a gateway's loop teardown waiting on it until the test timed out).
                raise asyncio.CancelledError from exc
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:  # 4 syncs a second: say it once a while
                self._warned_at = now
                log.warning("in-flight sync through Redis failed: %s", exc)
            if self._others and time.monotonic() - self._synced_at > self._ttl_s:
                # The other gateways' counts expire in Redis after ``ttl_s``; kept here through a
                # long outage they would keep steering traffic away from replicas long since
                # freed. Count our own requests only until Redis answers again.
                self._changed.update(self._others)
                self._others = {}
                self._others_awaiting = {}

    async def close(self) -> None:
        # Shutting down: a failed delete is harmless, the other gateways drop the field once it
        # stops changing (and the hash expires when none is left).
        with contextlib.suppress(Exception):
            await self._redis.hdel(self.key, self.gateway_id)
        await self._redis.aclose()
