"""``AttemptsInFlight``: which request is on which replica; aborting a dead replica's attempts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from gateway.attempts import REPLICA_DOWN, STREAM_STALLED, AttemptsInFlight
from routing.types import ReplicaId

R1, R2 = ReplicaId("r1"), ReplicaId("r2")


@dataclass
class Progress:
    responded: bool = False
    last_byte_at: float | None = None
    stall_cut: bool = False
    writing_to_client: bool = False


async def _waiting_attempt(
    attempts: AttemptsInFlight,
    request_id: str,
    replica: ReplicaId,
    progress: Progress,
    started: asyncio.Event,
    can_retry: bool = True,
) -> str:
    """An attempt that waits forever for its replica; how it ended."""
    attempt = attempts.begin(request_id, replica, progress, lambda: can_retry)
    started.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError as exc:
        return f"cancelled: {exc.args[0] if exc.args else ''} aborted={attempt.aborted}"
    finally:
        attempts.end(attempt)
    return "never"


async def test_aborts_only_unanswered_retryable_attempts_on_the_replica_marked_down() -> None:
    attempts = AttemptsInFlight()
    cases = {
        "waiting": (R1, Progress(), True),
        "streaming": (R1, Progress(responded=True), True),
        "no-fallback": (R1, Progress(), False),
        "elsewhere": (R2, Progress(), True),
    }
    tasks: dict[str, asyncio.Task[str]] = {}
    for request_id, (replica, progress, can_retry) in cases.items():
        started = asyncio.Event()
        tasks[request_id] = asyncio.create_task(
            _waiting_attempt(attempts, request_id, replica, progress, started, can_retry)
        )
        await started.wait()
    assert attempts.count(R1) == 3 and attempts.replica_of("elsewhere") == R2

    assert attempts.abort_unanswered(R1) == 1
    assert await tasks["waiting"] == f"cancelled: {REPLICA_DOWN} aborted=True"
    assert attempts.replica_of("waiting") is None  # its attempt ended
    assert attempts.abort_unanswered(R1) == 0  # nothing left that may be aborted
    for request_id in ("streaming", "no-fallback", "elsewhere"):
        assert not tasks[request_id].done(), request_id
        tasks[request_id].cancel()
    results = await asyncio.gather(*(tasks[r] for r in ("streaming", "no-fallback", "elsewhere")))
    assert all(r == "cancelled:  aborted=False" for r in results), results
    assert attempts.count(R1) == 0 and attempts.count(R2) == 0


async def test_a_later_attempt_of_the_same_request_is_the_one_reported() -> None:
    attempts = AttemptsInFlight()
    first = attempts.begin("q", R1, Progress())
    second = attempts.begin("q", R2, Progress())  # a retry, before the first's bookkeeping ended
    attempts.end(first)
    assert attempts.replica_of("q") == R2
    attempts.end(second)
    assert attempts.replica_of("q") is None


@pytest.mark.parametrize("replica", [R1, ReplicaId("unknown")])
def test_abort_with_nothing_in_flight_is_a_no_op(replica: ReplicaId) -> None:
    assert AttemptsInFlight().abort_unanswered(replica) == 0


async def test_only_streams_silent_since_the_polls_failed_are_cut_not_a_slow_readers() -> None:
    """``cut_stalled``: a stream silent since its replica's polls began to fail ends; one that
    relayed since, one not yet answered, and one whose silence is its client's (the relay
    waits for the client to take bytes: the diff review saw a slow reader's stream cut) go on."""
    attempts = AttemptsInFlight()
    cases = {
        "stalled": Progress(responded=True, last_byte_at=10.0),
        "flowing": Progress(responded=True, last_byte_at=30.0),
        "unanswered": Progress(),
        "slow-reader": Progress(responded=True, last_byte_at=10.0, writing_to_client=True),
    }
    tasks: dict[str, asyncio.Task[str]] = {}
    for request_id, progress in cases.items():
        started = asyncio.Event()
        tasks[request_id] = asyncio.create_task(
            _waiting_attempt(attempts, request_id, R1, progress, started)
        )
        await started.wait()
    assert attempts.cut_stalled(R1, silent_since=20.0) == 1
    assert await tasks["stalled"] == f"cancelled: {STREAM_STALLED} aborted=False"
    assert cases["stalled"].stall_cut
    assert attempts.cut_stalled(R1, silent_since=20.0) == 0
    for request_id in ("flowing", "unanswered", "slow-reader"):
        assert not tasks[request_id].done(), request_id
        tasks[request_id].cancel()
    await asyncio.gather(*(tasks[r] for r in ("flowing", "unanswered", "slow-reader")))
