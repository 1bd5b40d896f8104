"""Which request is being tried on which replica right now, and aborting those a dead replica holds.

A replica that hangs (accepts connections, never answers) is marked unhealthy by the health
loop after a few seconds; new requests then go elsewhere, but the ones already sent to it would
wait for it as long as their clients wait (a non-streamed answer's headers only come at the
end of the generation, so no first-byte deadline can tell "hung" from "long"). When the health
loop marks a replica down, every attempt on it whose answer has not started reaching the client
is aborted here and retried on a fallback by ``gateway/proxy.py``: nothing reached the client,
so nothing is duplicated. Attempts whose answer has started are left alone (a stream is never
replayed elsewhere).

The abort is a task cancellation tagged with ``REPLICA_DOWN``: the proxy tells it from a client
disconnect (which also cancels the handler) by ``Attempt.aborted``, and takes the cancellation
back (``Task.uncancel``) before retrying.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from routing.types import ReplicaId

#: The cancellation message of an attempt aborted because its replica was marked down.
REPLICA_DOWN = "fleetgate: replica marked down"
#: ... and of a stream ended because its replica was marked down while it had gone silent.
STREAM_STALLED = "fleetgate: stream stalled on a replica marked down"


class Progress(Protocol):
    """What an attempt's request has done so far (``proxy.UpstreamOutcome``)."""

    #: The answer has started reaching the client: never aborted from then on.
    responded: bool
    #: When the last bytes of its stream arrived (monotonic; None: no stream yet).
    last_byte_at: float | None
    #: Set by ``cut_stalled``: the stream is to end with the API's in-band error.
    stall_cut: bool
    #: The relay waits for the client to take bytes: the stream's silence is the client's.
    writing_to_client: bool


def _always() -> bool:
    return True


@dataclass(eq=False, slots=True)
class Attempt:
    """One request being tried on one replica."""

    request_id: str
    replica: ReplicaId
    task: asyncio.Task[object] | None
    progress: Progress
    #: Whether another replica could take the request if this attempt were aborted: with none
    #: left, the attempt waits on (a replica marked down under overload may still answer).
    can_retry: Callable[[], bool] = _always
    #: Cancelled by ``abort_unanswered`` (not by the client leaving).
    aborted: bool = False


@dataclass
class AttemptsInFlight:
    """The attempts under way on each replica, as this gateway sees them."""

    _by_replica: dict[ReplicaId, set[Attempt]] = field(default_factory=dict)
    _by_request: dict[str, Attempt] = field(default_factory=dict)

    def begin(
        self,
        request_id: str,
        replica: ReplicaId,
        progress: Progress,
        can_retry: Callable[[], bool] = _always,
    ) -> Attempt:
        """The current task starts trying ``replica`` for ``request_id``."""
        attempt = Attempt(request_id, replica, asyncio.current_task(), progress, can_retry)
        self._by_replica.setdefault(replica, set()).add(attempt)
        self._by_request[request_id] = attempt
        return attempt

    def end(self, attempt: Attempt) -> None:
        """The attempt is over (answered, failed, aborted or the client left)."""
        on_replica = self._by_replica.get(attempt.replica)
        if on_replica is not None:
            on_replica.discard(attempt)
            if not on_replica:
                del self._by_replica[attempt.replica]
        if self._by_request.get(attempt.request_id) is attempt:
            del self._by_request[attempt.request_id]

    def replica_of(self, request_id: str) -> ReplicaId | None:
        """The replica ``request_id`` is being tried on now (None if none)."""
        attempt = self._by_request.get(request_id)
        return attempt.replica if attempt is not None else None

    def count(self, replica: ReplicaId) -> int:
        """Attempts under way on ``replica``."""
        return len(self._by_replica.get(replica, ()))

    def cut_stalled(self, replica: ReplicaId, silent_since: float) -> int:
        """End every stream on ``replica`` that has relayed nothing since ``silent_since`` (when
        the first of the health polls that marked it down was sent), with the API's in-band
        error; how many. Such a
        stream cannot be replayed elsewhere (the client has its first tokens), and without
        this it would wait out ``upstream_timeout_s`` (600 s by default) on a replica the
        gateway already knows is gone."""
        cut = 0
        for attempt in list(self._by_replica.get(replica, ())):
            progress, task = attempt.progress, attempt.task
            last = progress.last_byte_at
            if not progress.responded or last is None or last > silent_since:
                continue
            if progress.writing_to_client:
                continue  # a slow reader, not a stalled replica (client_stall_timeout_s's)
            if task is None or task.done() or progress.stall_cut:
                continue
            progress.stall_cut = True
            task.cancel(STREAM_STALLED)
            cut += 1
        return cut

    def abort_unanswered(self, replica: ReplicaId) -> int:
        """Cancel every attempt on ``replica`` whose answer has not started and that another
        replica could take; how many."""
        aborted = 0
        for attempt in list(self._by_replica.get(replica, ())):
            if attempt.progress.responded or attempt.aborted or attempt.task is None:
                continue
            if attempt.task.done() or not attempt.can_retry():
                continue
            attempt.aborted = True
            attempt.task.cancel(REPLICA_DOWN)
            aborted += 1
        return aborted
