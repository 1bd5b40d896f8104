"""Run-time settings of one gateway process (from the command line, not the policy file)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from adapters_registry.registry import RegistrySettings
from routing.config.infra import GatewaySettings, IndexSettings
from routing.index.factory import DEFAULT_INDEX_MODE
from routing.index.redis_client import is_cluster_url
from routing.policies.registry import DEFAULT_PROFILE
from routing.redis_clients import redacted

_GATEWAY = GatewaySettings()
_INDEX = IndexSettings()


#: Settings only a restart applies, and how a reload's warning names them.
_RESTART_ONLY = {
    "index_url": "index backend (redis url)",
    "index_mode": "index mode",
    "index_key_prefix": "index key prefix",
    "idle_timeout_s": "gateway idle_timeout_s",
}


@dataclass
class GatewayConfig:
    """Settings that shape the process; routing policy lives in the policy file instead."""

    #: Policy YAML path; None runs policy-less (open default tenant, one route).
    policy_path: str | None = None
    #: Profile of the default route in policy-less mode.
    default_profile: str = DEFAULT_PROFILE
    #: Redis URL for the shared index, in-flight counts and agent-registered replicas.
    redis_url: str | None = None
    #: The block index's own Redis when it is a Redis Cluster (the policy's ``index.redis_url``
    #: with the ``redis+cluster://`` scheme); None: the index lives in ``redis_url``.
    index_redis_url: str | None = None
    #: Redis key prefix of the block index; None: the backend's default (the agents' too).
    index_key_prefix: str | None = None
    #: With Redis: ``lookup`` (a Redis script per lookup) or ``mirror`` (an in-process copy fed
    #: by Redis streams); agents must write the same mode (docs/index.md).
    index_mode: str = DEFAULT_INDEX_MODE
    tokenizer_dir: str | None = None
    remote_tokenizer_url: str | None = None
    #: Block size for hashing when a replica does not say (tokens; characters in text mode).
    block_size: int = 16
    #: Key for ``/admin/``; None disables the admin API.
    admin_key: str | None = None
    #: Largest request body accepted (bytes); larger gets 413.
    max_body_bytes: int = _GATEWAY.max_body_bytes
    #: Seconds a request body may take to arrive after its headers; slower gets 408.
    body_timeout_s: float = _GATEWAY.body_timeout_s
    #: Seconds a connection may go without completing request headers (read at start).
    idle_timeout_s: float = _GATEWAY.idle_timeout_s
    # The defaults below are the policy file's (``routing/config/infra.py``), so a gateway
    # behaves the same with a policy file or without one.
    #: Seconds to wait for an upstream's response headers (and, streaming, each next chunk).
    upstream_timeout_s: float = _GATEWAY.upstream_timeout_s
    connect_timeout_s: float = _GATEWAY.connect_timeout_s
    #: Seconds a streaming client may leave its answer unread before it is dropped.
    client_stall_timeout_s: float = _GATEWAY.client_stall_timeout_s
    #: Speculative index entries (the gateway's own decisions) live this long unconfirmed.
    speculative_ttl_s: float = _INDEX.speculative_ttl_s
    health_interval_s: float = _GATEWAY.health_check_interval_s
    #: Consecutive failures that open a replica's circuit, and how long it stays open.
    #: Bound on one block-index lookup; past it the decision degrades to load only.
    index_timeout_s: float = _INDEX.lookup_timeout_ms / 1000
    #: Retries on fallback replicas, only before the first byte reached the client.
    max_retries: int = _GATEWAY.max_retries
    breaker_failures: int = 3
    breaker_cooldown_s: float = 10.0
    #: In-flight streams get this long to finish on shutdown.
    drain_timeout_s: float = 30.0
    #: On SIGTERM, ``/ready`` turns 503 at once but the gateway keeps accepting and serving for
    #: this long before it stops listening: load balancers (Kubernetes endpoints) need a moment
    #: to stop sending, and a connection that arrives after the listener closed is refused or
    #: reset instead of served (the in-process form of a preStop sleep).
    stop_delay_s: float = 2.0
    #: After the drain, the most the clean-up may take (background tasks, adapter loads, Redis
    #: and upstream connections): a step that overruns is abandoned and logged, so SIGTERM ends
    #: the process in bounded time even with Redis or an engine hung.
    cleanup_timeout_s: float = 10.0
    #: Seconds between policy-file modification checks (0 disables polling).
    policy_poll_s: float = 2.0
    #: Routing decisions kept for ``/admin/decisions``.
    decision_log_size: int = 200
    #: OTLP/HTTP traces endpoint; None keeps tracing off.
    otlp_endpoint: str | None = None
    #: False: ``/metrics`` answers 404 instead of this process's registry (``serve --workers N``
    #: needs it: N processes behind one port would each answer with their own counters).
    metrics_enabled: bool = True
    #: The settings as the command line gave them, before the policy file's (set at start-up):
    #: a reload's restart check (``needs_restart``) works out start-up again from here.
    before_policy: GatewayConfig | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    #: Poll the agents' Redis fleet store for registered replicas.
    use_fleet_store: bool = False
    #: Sliding window for hit rate and cost gauges.
    window_s: float = 300.0
    #: Redis key prefix of the adapter placement (shared by every gateway of a fleet).
    adapter_key_prefix: str = "fleetgate:"
    #: Seconds between adapter pre-warm rounds; None turns pre-warming off.
    adapter_prewarm_interval_s: float | None = 30.0
    #: ``adapters_registry.RegistrySettings`` (loader timeouts, thrash guard, pre-warm budget);
    #: None: the registry's defaults.
    adapter_settings: RegistrySettings | None = None

    def __post_init__(self) -> None:
        if self.redis_url is not None and is_cluster_url(self.redis_url):
            raise ValueError(
                f"--redis {redacted(self.redis_url)}: a Redis Cluster holds the block index only. "
                "Give --redis one Redis server (fleet store, in-flight counts, token budgets) and "
                "put the Cluster under the policy's index.redis_url (docs/index.md, Redis Cluster)"
            )

    @property
    def index_url(self) -> str | None:
        """Where the block index lives: its own Redis (a Cluster) or ``redis_url``."""
        return self.index_redis_url or self.redis_url

    def needs_restart(self, policy: Any) -> list[str]:
        """Where ``policy`` would put the index (backend, Redis, mode, keys), and the listener's
        idle timeout, if the gateway started with it now, where that differs from the running
        ones; a reload keeps the running ones. Worked out as start-up does (the command line's
        ``--redis`` wins over the file), so reloading the file the gateway started with names
        nothing."""
        if self.before_policy is None:
            return []
        trial = dataclasses.replace(self.before_policy)
        trial.apply_policy(policy, startup=True)
        # No index URL is the in-memory index: said so, not "None" (no other setting is None);
        # a password written in a URL is not repeated (this goes to the log and /admin/policy).
        def shown(value: Any) -> str:
            return redacted(value) if isinstance(value, str) else str(value or "memory")

        return [
            f"{label}: {shown(getattr(trial, name) or 'memory')} "
            f"(running: {shown(getattr(self, name) or 'memory')})"
            for name, label in _RESTART_ONLY.items()
            if getattr(trial, name) != getattr(self, name)
        ]

    def apply_policy(self, policy: Any, startup: bool = False) -> None:
        """Take the policy's ``gateway:`` and ``index:`` settings over the process defaults.

        On a reload (``startup=False``) only settings that can change live are taken; the index
        backend and its Redis URL need a restart.
        """
        if startup and self.before_policy is None:
            self.before_policy = dataclasses.replace(self)
        settings = getattr(policy, "gateway", None)
        if settings is not None:
            self.max_body_bytes = settings.max_body_bytes
            self.body_timeout_s = settings.body_timeout_s
            if startup:  # the listener's, set once (``needs_restart`` names a change)
                self.idle_timeout_s = settings.idle_timeout_s
            self.upstream_timeout_s = settings.upstream_timeout_s
            self.connect_timeout_s = settings.connect_timeout_s
            self.client_stall_timeout_s = settings.client_stall_timeout_s
            self.health_interval_s = settings.health_check_interval_s
            self.max_retries = settings.max_retries
        index = getattr(policy, "index", None)
        if index is None:
            return
        self.speculative_ttl_s = index.speculative_ttl_s
        self.index_timeout_s = index.lookup_timeout_ms / 1000
        if not startup:
            return
        if index.backend == "redis":
            if is_cluster_url(index.redis_url):
                # A Cluster holds the index only: the fleet store, in-flight counts and budgets
                # stay on ``redis_url`` (one server), if there is one.
                self.index_redis_url = index.redis_url
            elif self.redis_url is None:
                self.redis_url = index.redis_url
        # Gateways and agents must share keys; every component defaults to "fleetgate:".
        self.index_key_prefix = index.key_prefix
        self.index_mode = index.mode
