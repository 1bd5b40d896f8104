"""The replica agent's configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from routing.index.factory import DEFAULT_INDEX_MODE, INDEX_MODES
from routing.index.redis_client import check_cluster_url, is_cluster_url
from routing.redis_sentinel import check_primary_url


@dataclass
class AgentConfig:
    """Everything one agent needs to know about its replica and the fleet's shared state."""

    #: Stable replica id, e.g. ``pool-a/replica-0``.
    replica_id: str
    #: The engine's HTTP base URL as the agent reaches it (``http://127.0.0.1:8000``).
    engine_url: str
    #: The URL gateways use to reach the engine; defaults to ``engine_url``.
    advertise_url: str | None = None
    pool: str = "default"
    #: Served model name fleetgate hashes requests under; default: the engine's first model.
    model: str | None = None
    #: Subscriber side of the KV-event stream (``tcp://127.0.0.1:5557`` connects to a binding
    #: engine, ``tcp://*:5557`` binds for a connecting one); None: no events (load-only).
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv"
    #: The engine's replay ROUTER socket, asked for missed batches on a sequence gap.
    replay_endpoint: str | None = None
    #: Block index URL (``redis://...``, a Redis Cluster's ``redis+cluster://...`` or
    #: ``memory``) and fleet store URL (default: the same; one Redis server).
    index_url: str | None = None
    fleet_url: str | None = None
    #: Key prefixes: the index's hash tag, and the fleet store's prefix.
    index_key_prefix: str = "fleetgate:"
    #: Redis index layout to write: ``lookup`` or ``mirror`` (streams); the gateways' mode.
    index_mode: str = DEFAULT_INDEX_MODE
    fleet_key_prefix: str = "fleetgate:"
    scrape_interval_s: float = 0.25
    #: How long the replica stays listed (and its index entries match) without a heartbeat.
    heartbeat_ttl_s: float = 3.0
    #: How often a dirty index (after a Redis outage) is retried.
    resync_interval_s: float = 0.5
    #: Longest silence while a gap is repaired from the replay socket.
    replay_timeout_s: float = 2.0
    #: Longest silence while a new agent replays the engine's buffered history (an engine under
    #: load, with thousands of batches to send, can take longer than a gap repair may wait).
    catch_up_timeout_s: float = 10.0
    map_capacity: int = 262_144
    #: ``--max-cpu-loras`` of the engine (vLLM does not export it).
    max_cpu_loras: int | None = None
    #: An engine that holds requests but finishes no step for this long is stalled (a hung
    #: EngineCore or GPU, while its server still answers /health): reported down until it
    #: moves again. None: never. Only for engines that export ``vllm:iteration_tokens_total``.
    stall_after_s: float | None = 120.0
    #: Where the agent serves its own /metrics and /health; port 0 picks a free one, None: off.
    listen_host: str = "127.0.0.1"
    listen_port: int | None = 0

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id must be a non-empty string")
        if not self.engine_url.startswith(("http://", "https://")):
            raise ValueError(f"engine_url must be an http(s) URL (got {self.engine_url!r})")
        for name in ("scrape_interval_s", "heartbeat_ttl_s", "resync_interval_s",
                     "replay_timeout_s", "catch_up_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)!r})")
        if self.heartbeat_ttl_s <= self.scrape_interval_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed scrape_interval_s "
                f"({self.scrape_interval_s}): the replica would expire between heartbeats"
            )
        if self.stall_after_s is not None and not self.stall_after_s > 0:
            raise ValueError(f"stall_after_s must be > 0 or None (got {self.stall_after_s!r})")
        if self.replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("replay_endpoint is set but kv_events_endpoint is not")
        if self.index_mode not in INDEX_MODES:
            raise ValueError(
                f"index_mode must be one of {', '.join(INDEX_MODES)} (got {self.index_mode!r})"
            )
        if self.index_url and is_cluster_url(self.index_url):
            try:
                check_cluster_url(self.index_url)
            except ValueError as exc:
                raise ValueError(f"index_url: {exc}") from None
            if self.index_mode != "mirror":
                raise ValueError("a Redis Cluster index_url needs index_mode 'mirror'")
            if self.fleet_url is None:
                raise ValueError(
                    "index_url is a Redis Cluster, which holds the block index only: give "
                    "fleet_url (--fleet-url), one Redis server for the fleet store"
                )
        for name in ("index_url", "fleet_url"):
            url = getattr(self, name)
            if not url or url.startswith("memory"):
                continue
            try:
                check_primary_url(url)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if self.map_capacity < 1:
            raise ValueError(f"map_capacity must be >= 1 (got {self.map_capacity})")

    @property
    def public_url(self) -> str:
        """The URL published for gateways."""
        return (self.advertise_url or self.engine_url).rstrip("/")
