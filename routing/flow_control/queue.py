"""The gateway queue: strict priority between classes, weighted fair queuing inside a class,
one such queue per pool.

A *pool* is the set of replicas a request can go to (the gateway keys it by base model): a
request for an idle model never waits behind requests for a saturated one. Inside a pool,
classes are strictly ordered and tenants share a class by weight.

Inside a class every tenant gets a share of dequeues proportional to its weight, whatever the
size of its burst: each entry carries a virtual finish tag ``max(class clock, tenant's last
tag) + 1 / weight`` (start-time fair queuing over request counts), and the smallest tag goes
first. A tenant that was idle restarts from the class clock, so it cannot bank credit either.

Removal from the middle (a client that disconnected, a request whose wait ran out) marks the
entry dead and drops it from the length at once; dead entries leave the heap when they reach
its top (O(log n) amortised instead of a linear search). A tenant whose last live entry was
removed restarts from the class clock, like an idle one: requests refused while queued are no
debt against its next ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from routing.flow_control.classes import FlowRequest, RequestClass

__all__ = ["FairQueue", "QueuedEntry"]


@dataclass(eq=False, slots=True)
class QueuedEntry:
    """A request waiting in the queue, with its fair-queuing tag."""

    request: FlowRequest
    finish_tag: float
    sequence: int
    #: The estimate of its TTFT when it was last judged (ms; None: unknown).
    predicted_ttft_ms: float | None = None
    alive: bool = True


@dataclass(slots=True)
class _ClassQueue:
    heap: list[tuple[float, int, QueuedEntry]] = field(default_factory=list)
    #: Virtual time: the tag of the last entry dequeued.
    clock: float = 0.0
    last_tag: dict[str, float] = field(default_factory=dict)
    #: Live entries per tenant (a tenant with none left restarts from ``clock``).
    live: dict[str, int] = field(default_factory=dict)
    length: int = 0


class FairQueue:
    """Priority classes, each a weighted-fair queue over tenants; ``len`` counts live entries."""

    def __init__(self) -> None:
        self._pools: dict[str, dict[RequestClass, _ClassQueue]] = {}
        self._entries: dict[str, QueuedEntry] = {}
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def length(self, request_class: RequestClass) -> int:
        """Live entries of one class, in every pool."""
        return sum(classes[request_class].length for classes in self._pools.values())

    def pools(self) -> list[str]:
        """The pools with live entries, the one whose head goes first (class, then age) first."""
        heads = [(pool, self.head(pool)) for pool in list(self._pools)]
        live = [
            (entry.request.request_class.rank, entry.sequence, pool)
            for pool, entry in heads
            if entry is not None
        ]
        return [pool for _, _, pool in sorted(live)]

    def push(self, request: FlowRequest, predicted_ttft_ms: float | None = None) -> QueuedEntry:
        """Queue ``request`` behind its tenant's earlier requests, by weight."""
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already queued")
        if not request.weight > 0:
            raise ValueError(f"weight must be > 0 (got {request.weight!r})")
        classes = self._pools.get(request.pool)
        if classes is None:
            classes = self._pools[request.pool] = {c: _ClassQueue() for c in RequestClass}
        queue = classes[request.request_class]
        start = max(queue.clock, queue.last_tag.get(request.tenant, 0.0))
        tag = start + 1.0 / request.weight
        queue.last_tag[request.tenant] = tag
        queue.live[request.tenant] = queue.live.get(request.tenant, 0) + 1
        entry = QueuedEntry(request, tag, next(self._sequence), predicted_ttft_ms)
        heapq.heappush(queue.heap, (tag, entry.sequence, entry))
        queue.length += 1
        self._entries[request.request_id] = entry
        return entry

    def head(self, pool: str | None = None) -> QueuedEntry | None:
        """The entry that goes next in ``pool`` (highest class first, smallest tag inside it);
        with no pool given, the head of the pool that goes first (``pools``)."""
        if pool is None:
            first = self.pools()
            return self.head(first[0]) if first else None
        classes = self._pools.get(pool)
        if classes is None:
            return None
        for request_class in RequestClass:
            entry = self._top(classes[request_class])
            if entry is not None:
                return entry
        return None

    def waiting_at_or_above(self, request_class: RequestClass, pool: str = "") -> int:
        """Live entries of ``pool`` that would go before a new request of ``request_class``."""
        classes = self._pools.get(pool)
        if classes is None:
            return 0
        return sum(classes[c].length for c in RequestClass if c.rank <= request_class.rank)

    def pop_head(self, pool: str | None = None) -> QueuedEntry:
        """Dequeue the head of ``pool`` (as ``head``; ``IndexError`` when empty); advances its
        class's virtual clock."""
        entry = self.head(pool)
        if entry is None:
            raise IndexError("the queue is empty")
        queue = self._pools[entry.request.pool][entry.request.request_class]
        heapq.heappop(queue.heap)
        queue.clock = max(queue.clock, entry.finish_tag - 1.0 / entry.request.weight)
        self._forget(entry, popped=True)
        return entry

    def remove(self, request_id: str) -> QueuedEntry | None:
        """Take a request out wherever it is (disconnect, expiry); None if it is not queued."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        self._forget(entry)
        return entry

    def newest_below(self, request_class: RequestClass) -> QueuedEntry | None:
        """The most recently queued entry of the lowest class ranked below ``request_class``."""
        for lower in reversed(RequestClass):
            if lower.rank <= request_class.rank:
                return None
            live = [
                e for classes in self._pools.values() for _, _, e in classes[lower].heap if e.alive
            ]
            if live:
                return max(live, key=lambda e: e.sequence)
        return None

    def entries(self) -> Iterator[QueuedEntry]:
        """Every live entry, in no particular order."""
        return iter(list(self._entries.values()))

    def _forget(self, entry: QueuedEntry, popped: bool = False) -> None:
        request = entry.request
        entry.alive = False
        queue = self._pools[request.pool][request.request_class]
        queue.length -= 1
        left = queue.live[request.tenant] - 1
        if left:
            queue.live[request.tenant] = left
        else:
            del queue.live[request.tenant]
            if not popped:
                # Its last request left without being served: no debt (it restarts from the
                # clock, as an idle tenant does).
                queue.last_tag.pop(request.tenant, None)
        del self._entries[request.request_id]

    @staticmethod
    def _top(queue: _ClassQueue) -> QueuedEntry | None:
        while queue.heap and not queue.heap[0][2].alive:
            heapq.heappop(queue.heap)
        return queue.heap[0][2] if queue.heap else None
