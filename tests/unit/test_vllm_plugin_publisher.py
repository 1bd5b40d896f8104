"""The vLLM plugin's throttled publisher: timing decisions driven by an explicit clock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import pytest

from replica.vllm_plugin.log import LOGGER_NAME
from replica.vllm_plugin.publisher import StatePublisher


class Recorder:
    """A write function that records what it was given, and can be told to fail."""

    def __init__(self) -> None:
        self.calls: list[Mapping[str, str] | None] = []
        self.fail = False

    def __call__(self, fields: Mapping[str, str] | None) -> None:
        if self.fail:
            raise ConnectionError("redis is down")
        self.calls.append(dict(fields) if fields is not None else None)


def make(min_interval_s: float = 0.05, heartbeat_s: float = 3.0,
         retry_s: float = 1.0) -> tuple[StatePublisher, Recorder]:
    rec = Recorder()
    return StatePublisher(rec, min_interval_s, heartbeat_s, retry_s=retry_s), rec


def test_offer_does_no_io_and_first_pump_writes_it() -> None:
    pub, rec = make()
    pub.offer({"running": "1"})
    assert rec.calls == []  # offer only hands over; the thread does the writing
    pub.pump(100.0)
    assert rec.calls == [{"running": "1"}]


def test_writes_are_throttled_and_only_the_newest_pending_snapshot_is_written() -> None:
    pub, rec = make(min_interval_s=0.05)
    pub.offer({"running": "1"})
    pub.pump(100.0)
    for n in (2, 3, 4):
        pub.offer({"running": str(n)})
    wait = pub.pump(100.01)  # inside the interval: nothing is written
    assert rec.calls == [{"running": "1"}]
    assert wait == pytest.approx(0.04)
    pub.pump(100.05)
    # 2 and 3 were superseded before they could be written: the mailbox holds one snapshot.
    assert rec.calls == [{"running": "1"}, {"running": "4"}]
    assert pub.offered == 4 and pub.writes == 2


def test_trailing_snapshot_is_written_after_a_burst() -> None:
    pub, rec = make(min_interval_s=0.05)
    pub.offer({"running": "3"})
    pub.pump(10.0)
    pub.offer({"running": "0"})  # the engine went idle right after a write
    assert pub.pump(10.02) == pytest.approx(0.03)
    pub.pump(10.05)
    assert rec.calls[-1] == {"running": "0"}


def test_heartbeat_rewrites_the_last_snapshot_when_nothing_changes() -> None:
    pub, rec = make(min_interval_s=0.05, heartbeat_s=3.0)
    assert pub.pump(0.0) == pytest.approx(3.0)  # nothing yet: the heartbeat is due at once
    assert rec.calls == [None]  # no snapshot yet: refresh keys only
    pub.offer({"running": "2"})
    pub.pump(0.1)
    assert pub.pump(1.0) == pytest.approx(2.1)  # idle: wait for the heartbeat
    assert len(rec.calls) == 2
    pub.pump(3.1)
    assert rec.calls == [None, {"running": "2"}, {"running": "2"}]


def test_failures_are_counted_logged_once_retried_and_keep_the_snapshot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub, rec = make(min_interval_s=0.05, retry_s=1.0)
    rec.fail = True
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        pub.offer({"running": "1"})
        pub.pump(0.0)
        assert pub.pump(0.5) == pytest.approx(0.5)  # backing off: no attempt before 1.0
        pub.pump(1.0)
        pub.pump(2.0)
        assert pub.failures == 3
        rec.fail = False
        pub.pump(3.0)
    assert rec.calls == [{"running": "1"}]  # the unwritten snapshot survived the outage
    messages = [r.getMessage() for r in caplog.records]
    assert sum("state failed" in m for m in messages) == 1
    assert sum("works again" in m for m in messages) == 1


def test_a_newer_offer_during_an_outage_replaces_the_kept_snapshot() -> None:
    pub, rec = make(retry_s=1.0)
    rec.fail = True
    pub.offer({"running": "1"})
    pub.pump(0.0)
    pub.offer({"running": "5"})
    rec.fail = False
    pub.pump(1.0)
    assert rec.calls == [{"running": "5"}]


def test_offer_returns_while_the_writer_thread_is_stuck_in_io() -> None:
    entered, release = threading.Event(), threading.Event()
    written: list[Mapping[str, str] | None] = []

    def slow_write(fields: Mapping[str, str] | None) -> None:
        entered.set()
        release.wait()  # a Redis call hanging on a dead socket
        written.append(fields)

    pub = StatePublisher(slow_write, min_interval_s=0.001, heartbeat_s=0.003).start()
    try:
        assert entered.wait(timeout=30)
        for n in range(1000):  # would deadlock here if offer() waited for the writer
            pub.offer({"running": str(n)})
        assert pub.offered == 1000
    finally:
        release.set()
        pub.stop(timeout_s=5)


def test_rejects_non_positive_intervals() -> None:
    with pytest.raises(ValueError):
        StatePublisher(Recorder(), min_interval_s=0, heartbeat_s=1)
