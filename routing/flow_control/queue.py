"""The gateway queue: strict priority between classes, weighted fair queuing inside a class,
one such queue per pool.

A *pool* is the set of replicas a request can go to (the gateway keys it by base model): a
request for an idle model never waits behind requests for a saturated one. Inside a pool,
classes are strictly ordered and tenants share a class by weight.

Inside a class every tenant gets a share of dequeues proportional to its weight, whatever the
size of its burst (start-time fair queuing over request counts). Each tenant's requests wait in
arrival order; only its oldest one is tagged, when it becomes the tenant's head: a virtual
finish tag ``max(class clock, tag of the tenant's last request served) + 1 / weight``, and the
smallest tag goes first. A tenant that was idle restarts from the class clock, so it cannot bank
credit either.

Tagging every request on arrival (as before) charged a tenant for requests that were never
served: under sustained overload the ones whose wait ran out kept its tags running ahead of the
clock, so each new one was tagged too late to be served before its SLO, and a tenant of weight 1
beside one of weight 3 got 19 of 139 requests served instead of a quarter (the flow-control
review). Now removal from the middle (a client that disconnected, a request whose wait ran out)
costs the tenant nothing: if it was the head, the next request takes its turn (its tag), so a
tenant that stays backlogged keeps its place.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from routing.flow_control.classes import FlowRequest, RequestClass

__all__ = ["FairQueue", "QueuedEntry"]


@dataclass(eq=False, slots=True)
class QueuedEntry:
    """A request waiting in the queue; its fair-queuing tag once it is its tenant's head."""

    request: FlowRequest
    sequence: int
    #: The estimate of its TTFT when it was last judged (ms; None: unknown).
    predicted_ttft_ms: float | None = None
    alive: bool = True
    finish_tag: float | None = None


@dataclass(slots=True)
class _ClassQueue:
    #: The tagged heads, one per tenant with requests waiting (removed ones leave lazily).
    heap: list[tuple[float, int, QueuedEntry]] = field(default_factory=list)
    #: Each tenant's waiting requests, oldest first (removed ones leave lazily).
    waiting: dict[str, deque[QueuedEntry]] = field(default_factory=dict)
    #: Virtual time: the start tag of the last entry dequeued.
    clock: float = 0.0
    #: Each tenant's tag of its last request served (a tenant with none waiting restarts from
    #: ``clock`` when that is later).
    served_tag: dict[str, float] = field(default_factory=dict)
    length: int = 0

    def tag_next(self, tenant: str, turn: float | None = None) -> None:
        """Tag the tenant's oldest waiting request and put it in the heap (if any waits):
        with ``turn``, the tag of a head that left unserved, which it takes over."""
        waiting = self.waiting.get(tenant)
        while waiting and not waiting[0].alive:
            waiting.popleft()
        if not waiting:
            self.waiting.pop(tenant, None)
            return
        head = waiting[0]
        if turn is None:
            start = max(self.clock, self.served_tag.get(tenant, 0.0))
            turn = start + 1.0 / head.request.weight
        head.finish_tag = turn
        heapq.heappush(self.heap, (head.finish_tag, head.sequence, head))


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
        entry = QueuedEntry(request, next(self._sequence), predicted_ttft_ms)
        waiting = queue.waiting.setdefault(request.tenant, deque())
        waiting.append(entry)
        queue.length += 1
        self._entries[request.request_id] = entry
        if len(waiting) == 1:  # the tenant's head: tagged now, the rest when their turn comes
            queue.tag_next(request.tenant)
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
        request = entry.request
        queue = self._pools[request.pool][request.request_class]
        heapq.heappop(queue.heap)
        assert entry.finish_tag is not None  # a head is tagged
        queue.clock = max(queue.clock, entry.finish_tag - 1.0 / request.weight)
        queue.served_tag[request.tenant] = entry.finish_tag
        self._forget(entry, served=True)
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
                e
                for classes in self._pools.values()
                for waiting in classes[lower].waiting.values()
                for e in waiting
                if e.alive
            ]
            if live:
                return max(live, key=lambda e: e.sequence)
        return None

    def entries(self) -> Iterator[QueuedEntry]:
        """Every live entry, in no particular order."""
        return iter(list(self._entries.values()))

    def _forget(self, entry: QueuedEntry, served: bool = False) -> None:
        """Take ``entry`` out (served or removed). When it was its tenant's head, the next
        request is tagged: after the one served, or with the removed one's turn (a request
        that left unserved costs its tenant nothing, and a tenant still waiting keeps its
        place: re-tagged from the clock, each expiry pushed it back a whole turn)."""
        request = entry.request
        entry.alive = False
        queue = self._pools[request.pool][request.request_class]
        queue.length -= 1
        del self._entries[request.request_id]
        if entry.finish_tag is not None:  # the tenant's head (in the heap): the next one's turn
            queue.tag_next(request.tenant, None if served else entry.finish_tag)

    @staticmethod
    def _top(queue: _ClassQueue) -> QueuedEntry | None:
        while queue.heap and not queue.heap[0][2].alive:
            heapq.heappop(queue.heap)
        return queue.heap[0][2] if queue.heap else None
