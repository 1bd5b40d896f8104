"""Sequence-number bookkeeping for one KV-event stream.

vLLM numbers batches 0, 1, 2, ... per engine process. A jump forward means batches were lost
(PUB/SUB drops at its high-water mark, or the agent was slow to connect); a jump backward means a
new engine process started numbering again.
"""

from __future__ import annotations

import enum


class SeqVerdict(enum.Enum):
    """What a received sequence number means for the stream."""

    #: The expected next batch (or the first one seen).
    IN_ORDER = "in_order"
    #: Batches between the expected one and this one were missed.
    GAP = "gap"
    #: Lower than expected: a new engine process restarted the numbering.
    RESTART = "restart"


class SequenceTracker:
    """Tracks the next expected sequence number of one stream."""

    def __init__(self) -> None:
        #: The sequence number the next batch should carry; None before the first batch.
        self.expected: int | None = None

    def classify(self, seq: int) -> SeqVerdict:
        """Classify ``seq`` without accepting it."""
        if seq < 0:
            raise ValueError(f"sequence numbers are non-negative (got {seq})")
        if self.expected is None or seq == self.expected:
            return SeqVerdict.IN_ORDER
        return SeqVerdict.GAP if seq > self.expected else SeqVerdict.RESTART

    def accept(self, seq: int) -> None:
        """Record that batch ``seq`` was applied; the next one expected is ``seq + 1``."""
        self.expected = seq + 1

    def reset(self) -> None:
        """Forget the stream position (a known engine restart): the next batch starts afresh."""
        self.expected = None
