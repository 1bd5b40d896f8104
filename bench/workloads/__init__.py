"""Synthetic workloads in the Mooncake/Dynamo trace format, for the simulator and replay.

Run ``python -m bench.workloads --help`` for the command line.
"""

from __future__ import annotations

from bench.workloads.arrivals import ARRIVALS, BurstParams
from bench.workloads.generators import generate
from bench.workloads.shapes import SHAPES
from traces.format import (
    DEFAULT_BLOCK_SIZE,
    TraceFormatError,
    TraceRecord,
    iter_trace,
    read_trace,
    write_trace,
)

__all__ = [
    "ARRIVALS",
    "DEFAULT_BLOCK_SIZE",
    "SHAPES",
    "BurstParams",
    "TraceFormatError",
    "TraceRecord",
    "generate",
    "iter_trace",
    "read_trace",
    "write_trace",
]
