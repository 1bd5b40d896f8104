"""The gateway queue: strict priority between classes, weighted fair queuing inside a class.

Inside a class every tenant gets a share of dequeues proportional to its weight, whatever the
size of its burst: each entry carries a virtual finish tag ``max(class clock, tenant's last
tag) + 1 / weight`` (start-time fair queuing over request counts), and the smallest tag goes
first. A tenant that was idle restarts from the class clock, so it cannot bank credit either.

Removal from the middle (a client that disconnected, a request whose wait ran out) marks the
entry dead and drops it from the length at once; dead entries leave the heap when they reach
its top (O(log n) amortised instead of a linear search).
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
    length: int = 0


class FairQueue:
    """Priority classes, each a weighted-fair queue over tenants; ``len`` counts live entries."""

    def __init__(self) -> None:
        self._classes = {c: _ClassQueue() for c in RequestClass}
        self._entries: dict[str, QueuedEntry] = {}
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def length(self, request_class: RequestClass) -> int:
        """Live entries of one class."""
        return self._classes[request_class].length

    def push(self, request: FlowRequest, predicted_ttft_ms: float | None = None) -> QueuedEntry:
        """Queue ``request`` behind its tenant's earlier requests, by weight."""
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already queued")
        if not request.weight > 0:
            raise ValueError(f"weight must be > 0 (got {request.weight!r})")
        queue = self._classes[request.request_class]
        start = max(queue.clock, queue.last_tag.get(request.tenant, 0.0))
        tag = start + 1.0 / request.weight
        queue.last_tag[request.tenant] = tag
        entry = QueuedEntry(request, tag, next(self._sequence), predicted_ttft_ms)
        heapq.heappush(queue.heap, (tag, entry.sequence, entry))
        queue.length += 1
        self._entries[request.request_id] = entry
        return entry

    def head(self) -> QueuedEntry | None:
        """The entry that goes next: highest class first, smallest tag inside it."""
        for request_class in RequestClass:
            entry = self._top(self._classes[request_class])
            if entry is not None:
                return entry
        return None

    def waiting_at_or_above(self, request_class: RequestClass) -> int:
        """Live entries that would go before a new request of ``request_class``."""
        return sum(self._classes[c].length for c in RequestClass if c.rank <= request_class.rank)

    def pop_head(self) -> QueuedEntry:
        """Dequeue the head (``IndexError`` when empty); advances its class's virtual clock."""
        entry = self.head()
        if entry is None:
            raise IndexError("the queue is empty")
        queue = self._classes[entry.request.request_class]
        heapq.heappop(queue.heap)
        queue.clock = max(queue.clock, entry.finish_tag - 1.0 / entry.request.weight)
        self._forget(entry)
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
            live = [e for _, _, e in self._classes[lower].heap if e.alive]
            if live:
                return max(live, key=lambda e: e.sequence)
        return None

    def entries(self) -> Iterator[QueuedEntry]:
        """Every live entry, in no particular order."""
        return iter(list(self._entries.values()))

    def _forget(self, entry: QueuedEntry) -> None:
        entry.alive = False
        self._classes[entry.request.request_class].length -= 1
        del self._entries[entry.request.request_id]

    @staticmethod
    def _top(queue: _ClassQueue) -> QueuedEntry | None:
        while queue.heap and not queue.heap[0][2].alive:
            heapq.heappop(queue.heap)
        return queue.heap[0][2] if queue.heap else None
