"""Notes on a trace the replaying commands print on stderr before they start.

A recorded trace is replayed as it is; these say where "as it is" is probably not what the user
meant, and what to pass instead: requests recorded with no output (replayed as one token),
timestamps that look like seconds rather than the format's milliseconds, and arrivals bucketed
at coarse timestamps (spread them with ``--arrival-spread-ms``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from traces.format import TraceRecord, fractional_timestamps, zero_outputs
from traces.spread import coarse_timestamps

__all__ = ["trace_notes"]

#: Average arrivals per second beyond which a trace's timestamps are probably seconds: a
#: thousand requests a second, sustained over a whole trace, is no fleet's recorded traffic.
SECONDS_SUSPECT_RATE = 1000.0
#: Too few requests say nothing about a rate.
_MIN_REQUESTS = 100
#: Groups of arrivals this close (ms) are whole seconds, not buckets of a recorder.
_SECONDS_LIKE_BUCKET_MS = 5


def trace_notes(
    path: str | Path, records: Sequence[TraceRecord], arrival_spread_ms: int = 0
) -> list[str]:
    """The notes for ``records`` (read from ``path``), each one line naming what to do."""
    notes = []
    zeros = zero_outputs(path, len(records))
    if zeros:
        notes.append(
            f"note: {path}: {zeros} requests record output_length 0; replayed as 1 token, the "
            "least an engine generates"
        )
    span_ms = records[-1].timestamp - records[0].timestamp if records else 0
    fractions, example = fractional_timestamps(path, len(records))
    if fractions >= max(1, len(records) // 2):
        # The format's milliseconds are whole: decimals on most lines are a trace in seconds.
        rate = len(records) / (span_ms / 1000) if span_ms else math.inf
        notes.append(
            f"note: {path}: {fractions:,} of {len(records):,} timestamps have a fraction "
            f"(e.g. {example}), replayed as milliseconds: {rate:,.0f} req/s. If they are "
            "seconds, multiply them by 1000 to replay the recorded rate"
        )
    elif len(records) >= _MIN_REQUESTS and span_ms == 0:
        notes.append(
            f"note: {path}: every request has the same timestamp; they all arrive at once, and "
            "a rate scale changes nothing"
        )
    elif len(records) >= _MIN_REQUESTS and len(records) / (span_ms / 1000) > SECONDS_SUSPECT_RATE:
        rate = len(records) / (span_ms / 1000)
        notes.append(
            f"note: {path}: {len(records):,} requests in {span_ms:,} ms ({rate:,.0f} req/s): "
            "are its timestamps in seconds? The format counts milliseconds; multiply them by "
            "1000 to replay the recorded rate"
        )
    elif not arrival_spread_ms:
        coarse = coarse_timestamps(records)
        if coarse is not None and coarse.bucket_ms <= _SECONDS_LIKE_BUCKET_MS:
            # Groups a millisecond or so apart: whole seconds written as milliseconds, seen on
            # too few requests for the rate test above.
            notes.append(
                f"note: {path} stamps its arrivals in groups ({coarse.requests_per_timestamp:.1f}"
                f" requests per timestamp, {coarse.bucket_ms} ms apart): are its timestamps in "
                "seconds? The format counts milliseconds; multiply them by 1000 to replay the "
                "recorded rate"
            )
        elif coarse is not None:
            notes.append(
                f"note: {path} stamps its arrivals in groups ({coarse.requests_per_timestamp:.1f}"
                f" requests per timestamp, about {coarse.bucket_ms} ms apart): replayed as "
                f"recorded, each group arrives at one instant. --arrival-spread-ms "
                f"{coarse.bucket_ms} spreads each over its interval (traces/README.md, Coarse "
                "timestamps)"
            )
    return notes
