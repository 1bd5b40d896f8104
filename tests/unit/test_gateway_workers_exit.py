"""``fleetgate serve --workers N``: the command's exit code from its workers'.

A worker still starting up when the parent forwards Ctrl-C (its interpreter not yet running our
code) is killed by that SIGINT: exit code -2. That is the stop the operator asked for, not a
failure (a fresh-clone test run under load caught the command exiting 2 after a clean stop).
"""

from __future__ import annotations

import signal

import pytest

from gateway.server import workers_exit_code

INT, TERM, KILL = int(signal.SIGINT), int(signal.SIGTERM), int(signal.SIGKILL)


@pytest.mark.parametrize(
    ("codes", "forwarded", "expected"),
    [
        ([0, 0], {INT}, 0),
        ([0, -INT], {INT}, 0),  # one worker stopped during start-up by the forwarded Ctrl-C
        ([-TERM, -TERM], {TERM}, 0),
        ([0, -INT], set(), INT),  # a SIGINT nobody forwarded: not ours, a failure
        ([0, -TERM], {INT}, TERM),
        ([0, -KILL], {INT, TERM}, KILL),  # killed by something else
        ([1, -INT], {INT}, 1),  # a worker that failed still fails the command
        ([], {INT}, 0),
    ],
)
def test_workers_exit_code(codes: list[int], forwarded: set[int], expected: int) -> None:
    assert workers_exit_code(codes, forwarded) == expected
