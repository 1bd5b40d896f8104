"""Settings of the gateway process itself: the block index backend and request limits."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from routing.config.base import (
    IndexRedisUrl,
    KeyPrefix,
    Name,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StrictModel,
)
from routing.index.factory import DEFAULT_INDEX_MODE


class IndexSettings(StrictModel):
    """Where the prefix-block index lives.

    ``memory`` is per gateway process (fine for one gateway, or for ``fleetgate up``); ``redis`` is
    shared by every gateway replica and written by the replica agents.
    """

    backend: Literal["memory", "redis"] = "memory"
    #: One Redis server, or (mirror mode) a Redis Cluster as ``redis+cluster://NODE[,NODE...]``.
    redis_url: IndexRedisUrl | None = None
    #: With ``redis``: ``lookup`` asks Redis on every request; ``mirror`` keeps an in-process
    #: copy fed by Redis streams (docs/index.md). Agents must run the same mode.
    mode: Literal["lookup", "mirror"] = DEFAULT_INDEX_MODE  # type: ignore[assignment]
    key_prefix: KeyPrefix = "fleetgate:"
    #: Lifetime of entries the gateway inserts for its own routing decisions, until an engine
    #: event confirms them. Short: a wrong guess should not steer traffic for long; long enough
    #: for a long prompt's prefill to end and its events to arrive (the simulator's and the
    #: benchmarks' value, and ``fleetgate up``'s).
    speculative_ttl_s: PositiveFloat = 30.0
    #: Upper bound on index entries (memory backend); ``None`` means unbounded.
    max_entries: PositiveInt | None = None
    #: Give up on an index lookup after this long and route on load alone.
    lookup_timeout_ms: PositiveFloat = 20.0

    @model_validator(mode="after")
    def _redis_needs_url(self) -> IndexSettings:
        if self.backend == "redis" and self.redis_url is None:
            raise ValueError("backend 'redis' needs 'redis_url'")
        if self.backend == "memory" and self.redis_url is not None:
            raise ValueError("'redis_url' is set but backend is 'memory'; set backend: redis")
        if (self.redis_url or "").split("://")[0].endswith("+cluster") and self.mode != "mirror":
            raise ValueError(
                "a Redis Cluster index needs mode: mirror (lookup mode keeps the whole index in "
                "one hash slot)"
            )
        return self


class GatewaySettings(StrictModel):
    """Request limits and upstream timeouts of the gateway."""

    #: Larger request bodies are refused with 413 before any parsing.
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    #: A request body must arrive within this many seconds of its headers, else 408 and the
    #: connection closes: a client trickling its body (slowloris) must not hold a connection and
    #: its handler for as long as it likes. 60 s passes 8 MiB at ~140 KB/s.
    body_timeout_s: PositiveFloat = 60.0
    #: A connection that completes no request headers within this many seconds (sends nothing,
    #: half its headers, or idles between keep-alive requests) is closed: aiohttp's keep-alive
    #: timeout. Read at start (a reload does not change it).
    idle_timeout_s: PositiveFloat = 75.0
    #: Whole upstream request, first byte to last (long generations need minutes).
    upstream_timeout_s: PositiveFloat = 600.0
    #: A streaming client that has stopped reading is dropped, as one that disconnected, once
    #: its connection's buffers are full (the kernel's send buffer first) and it takes nothing
    #: for this many seconds: otherwise it holds its engine slot and counts in flight for as
    #: long as it keeps the connection open.
    client_stall_timeout_s: PositiveFloat = 60.0
    connect_timeout_s: PositiveFloat = 5.0
    #: Retries on another replica, only before the first byte reached the client.
    max_retries: NonNegativeInt = 2
    #: Seconds between replica health checks (each also reads the engine's queue gauges, which
    #: routing weighs: fresher is better).
    health_check_interval_s: PositiveFloat = 2.0
    #: Tenant that requests without an API key act as; ``None`` refuses them (401).
    anonymous_tenant: Name | None = None

    @model_validator(mode="after")
    def _timeouts_ordered(self) -> GatewaySettings:
        if self.connect_timeout_s > self.upstream_timeout_s:
            raise ValueError(
                f"connect_timeout_s ({self.connect_timeout_s}) must be <= upstream_timeout_s "
                f"({self.upstream_timeout_s})"
            )
        return self
