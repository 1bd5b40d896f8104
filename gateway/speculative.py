"""The speculative index write: "the chosen replica is about to hold this prompt's blocks".

Every routed request tells the index that its replica will hold the prompt's block chain (the
entry expires after ``speculative_ttl_s`` unless the engine's KV events confirm it), so the next
request with that prefix is routed to the warm cache even before any event arrives.

Most of a prompt is usually a prefix the replica already holds (a system prompt, a conversation
so far): the decision's match says so, ``depth`` blocks deep. Rewriting those blocks on every
request only pushes their expiry out, so ``SpeculativeWriter`` writes them only when their last
full write through this gateway is older than half the TTL, and otherwise writes just the blocks
past ``depth``. A hot prefix is thus rewritten about twice per TTL, never expires while it is
used, and a request costs an index write proportional to its new blocks (for the in-memory index,
CPU on the request path; for Redis, script time and bytes on the wire).

The write runs beside the upstream call (``start``): a callback for an index whose writes never
wait (``InProcessRecord``: the in-memory index), a task for any other (Redis, the mirror), which
the handler awaits (``done``) before answering; either way the next request from the same client
already sees the blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from gateway.background import run_in_background
from routing.contracts import BlockIndex
from routing.state import ReplicaState
from routing.types import BlockHash, Epoch, ReplicaId

log = logging.getLogger(__name__)

#: Remembered prefixes (replica, last block of the prefix) before the table starts over.
MAX_REMEMBERED = 65_536
#: A redis (or any non-memory) index write is abandoned past this: routing must not wait on it.
REMOTE_WRITE_TIMEOUT_S = 0.05


@runtime_checkable
class InProcessRecord(Protocol):
    """An index whose writes never wait (the in-memory index): ``record_now`` is called directly."""

    def record_now(
        self,
        replica: ReplicaId,
        epoch: Epoch,
        blocks: Sequence[BlockHash],
        ttl_s: float | None = None,
    ) -> None: ...


def in_process_record(index: object) -> InProcessRecord | None:
    """``index`` itself when its writes never wait, else None (checked once, not per request).

    Only when the class that defines ``record_now`` also defines the ``record`` in use: a
    subclass that overrides the async ``record`` (tests do, to count or fail writes) is written
    through that ``record``.
    """
    if not isinstance(index, InProcessRecord):
        return None
    mro = type(index).__mro__
    record_owner = next((k for k in mro if "record" in k.__dict__), None)
    record_now_owner = next((k for k in mro if "record_now" in k.__dict__), None)
    return index if record_owner is record_now_owner else None


class ReplicaLookup(Protocol):
    """The replicas the gateway knows (their epoch goes with every index write)."""

    def get(self, replica: ReplicaId) -> ReplicaState | None: ...


@dataclass(frozen=True)
class SpeculativeTarget:
    """Where the writes go and what they need: the gateway's index, replicas, TTL, task set."""

    index: BlockIndex
    replicas: ReplicaLookup
    ttl_s: float
    #: Counts a failed write (``fleetgate_index_errors_total`` of this gateway's backend).
    count_error: Callable[[], None]
    #: Short-lived tasks the app awaits or cancels on shutdown (the Redis writes).
    background: set[asyncio.Task[Any]]
    #: ``index`` when its writes never wait (``in_process_record``), else None.
    in_process: InProcessRecord | None = None
    #: Counts a write dropped for outlasting ``REMOTE_WRITE_TIMEOUT_S``
    #: (``fleetgate_speculative_writes_slow_total``): late, not failed.
    count_slow: Callable[[], None] = lambda: None


class SpeculativeWriter:
    """Writes each routed prompt's blocks to the index for the chosen replica (see module doc)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: (replica, hash of the prefix's last block) -> when the whole prefix was last written.
        self._written_at: dict[tuple[ReplicaId, BlockHash], float] = {}
        self.full_writes = 0
        self.partial_writes = 0
        self.skipped_writes = 0

    def blocks_to_write(
        self, replica: ReplicaId, chain: Sequence[BlockHash], depth: int, ttl_s: float
    ) -> Sequence[BlockHash]:
        """The part of ``chain`` to write, given that ``replica`` holds its first ``depth``."""
        depth = min(max(depth, 0), len(chain))
        if depth == 0:
            self.full_writes += 1
            return chain
        now = self._clock()
        key = (replica, chain[depth - 1])
        written_at = self._written_at.get(key)
        if written_at is not None and now - written_at < ttl_s / 2:
            if depth == len(chain):
                self.skipped_writes += 1
            else:
                self.partial_writes += 1
            return chain[depth:]
        if len(self._written_at) >= MAX_REMEMBERED:
            self._written_at.clear()  # forgetting only costs full writes until it refills
        self._written_at[key] = now
        self.full_writes += 1
        return chain

    def start(
        self,
        target: SpeculativeTarget,
        replica: ReplicaId,
        chain: Sequence[BlockHash],
        depth: int,
    ) -> asyncio.Task[None] | None:
        """Start the write for a request routed to ``replica`` (matched ``depth`` blocks deep).

        Returns the task, or None when there is nothing to write.
        """
        if not chain or target.replicas.get(replica) is None:
            return None
        blocks = self.blocks_to_write(replica, chain, depth, target.ttl_s)
        if not blocks:
            return None
        loop = asyncio.get_running_loop()
        if target.in_process is not None:
            # In-process and never suspends: a plain callback, run once the handler waits on
            # the replica (the request's bytes are out by then), costs less than a task.
            loop.call_soon(_write_now, target, target.in_process, replica, list(blocks))
            return None
        return run_in_background(
            target.background, _write(target, replica, list(blocks)), "fleetgate-speculative"
        )


def _write_now(
    target: SpeculativeTarget, index: InProcessRecord, replica: ReplicaId, blocks: list[BlockHash]
) -> None:
    """The write of an index whose writes never wait (``record_now``)."""
    state = target.replicas.get(replica)
    if state is None:
        return
    try:
        index.record_now(replica, state.epoch, blocks, ttl_s=target.ttl_s)
    except Exception as exc:  # a bug must not take the event loop's callback down with it
        target.count_error()
        log.warning("speculative index insert failed: %s", exc)


async def _write(target: SpeculativeTarget, replica: ReplicaId, blocks: list[BlockHash]) -> None:
    # The task's first step runs once the handler waits on the replica: the upstream client
    # writes the request synchronously before that (gateway/upstream_client), so this write
    # overlaps the replica's work instead of preceding it.
    state = target.replicas.get(replica)
    if state is None:
        return
    try:
        async with asyncio.timeout(REMOTE_WRITE_TIMEOUT_S):
            await target.index.record(replica, state.epoch, blocks, ttl_s=target.ttl_s)
    except TimeoutError:
        # Our own budget ran out (Redis answered late: a busy gateway or Redis). Counted as an
        # index error, a burst of requests paged "Redis unavailable" with Redis healthy (the
        # load review: 298 in a burst of 300); a Redis down fails the calls, counted below,
        # and fails the mirror's tail and the lookups, which the alert reads too.
        target.count_slow()
        log.debug("speculative index insert outlasted %s s; dropped", REMOTE_WRITE_TIMEOUT_S)
    except Exception as exc:  # index down: routing still works, just less informed
        target.count_error()
        log.debug("speculative index insert failed: %s", exc)


async def done(task: asyncio.Task[None] | None) -> None:
    """Wait for a write ``start`` began (it bounds itself and never raises)."""
    if task is not None and not task.done():
        await asyncio.shield(task)  # a cancelled handler must not cancel the index write
