"""The gateway's Prometheus metrics, named exactly as docs/metrics.md (gateway section) lists them.

Each app gets its own ``CollectorRegistry`` so several gateways (tests, workers) never collide.
Labels are server-controlled only: route and profile names from the policy, replica ids, pools,
base models the replicas serve, status codes, stable error codes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase

from gateway import errors

if TYPE_CHECKING:
    from gateway.policy_view import Route

class OptionalGauge:
    """An unlabelled gauge with a sample only while it has a value (its HELP and TYPE always):
    prometheus_client's own exports 0 from registration, which for a figure that is not known
    yet (flow control off) reads as a real value, and one out of its range."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self.value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self.value = value

    def clear(self) -> None:
        self.value = None

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self._name, self._documentation)]

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._documentation)
        if self.value is not None:
            family.add_metric([], self.value)
        return [family]


# No ``*_created`` series (prometheus_client exports one per labelled counter and histogram by
# default): nothing reads them, and they double the series count. Process-wide, at import.
disable_created_metrics()

# TTFT spans sub-10 ms cache hits to multi-second cold prefills.
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
# Request lengths in tokens: fine where --max-model-len is usually set (1k-16k), then doubling
# past 128k to 2M for long-context models. `fleetgate advise` reads the top non-empty bucket as
# the longest request, so a length above the top bucket (+Inf) is unknown to it, not 128k.
_LENGTH_BUCKETS = (
    16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576,
    32768, 49152, 65536, 98304, 131072, 262144, 524288, 1048576, 2097152,
)
# Routing decisions should take well under a millisecond; resolve that range finely.
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
# Gateway queue time: sub-millisecond when the gateway only routes, but it also holds requests in
# flow control (waits up to max_queue_wait) and while a LoRA adapter loads (tens of seconds).
_QUEUE_BUCKETS = (*_DECISION_BUCKETS, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Label values created at 0 for every route (``GatewayMetrics.precreate``): the errors a routed
# request can end in (the no-healthy-replica alert reads one), the retry reasons of any fleet.
_ROUTE_ERROR_CODES = (errors.NO_HEALTHY_REPLICA, errors.UPSTREAM_TIMEOUT, errors.UPSTREAM_ERROR)
_RETRY_REASONS = ("connect_failed", "upstream_dropped", "upstream_5xx", "context_length")


class CachedLabels:
    """A labelled metric whose children are looked up once per label values, then reused.

    ``prometheus_client``'s ``labels()`` validates, locks and builds a key on every call; the
    request path calls it about ten times per request. Label values are server-controlled, so the
    cache stays as small as the metric's own set of children. Anything else goes to the metric.
    """

    __slots__ = ("_children", "metric")

    def __init__(self, metric: MetricWrapperBase) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str, **by_name: str) -> Any:
        if by_name:
            return self.metric.labels(*values, **by_name)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values: str) -> None:
        """Drop a child from the metric and from the cache (a cached child left behind would
        take the next ``labels()`` call's samples without ever being exported again)."""
        self._children.pop(values, None)
        self.metric.remove(*values)

    def clear(self) -> None:
        """Drop every child, from the metric and from the cache (as ``remove``: cleared from the
        metric alone, the next ``labels()`` handed back a child no longer exported)."""
        self._children.clear()
        self.metric.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)


class GatewayMetrics:
    """All gateway metrics, registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fleetgate_requests",
            "Requests answered",
            ["route", "model", "replica", "status"],
            registry=r,
        )
        self.errors = Counter(
            "fleetgate_errors",
            "Error responses by stable error code",
            ["route", "code"],
            registry=r,
        )
        self.ttft = Histogram(
            "fleetgate_ttft_seconds",
            "Time to first token at the gateway",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "fleetgate_tpot_seconds",
            "Time per output token after the first (request mean)",
            ["route", "model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "fleetgate_itl_seconds",
            "Inter-token latency between stream chunks",
            ["route", "model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "fleetgate_e2e_latency_seconds",
            "Request start to last byte",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "fleetgate_queue_time_seconds",
            "Arrival to upstream request sent (routing, flow-control waits, adapter loads)",
            ["route"],
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "fleetgate_prompt_tokens",
            "Prompt tokens (upstream usage)",
            ["route", "model"],
            registry=r,
        )
        # Per-request length distributions: `fleetgate advise` sets --max-model-len from the
        # p99 of prompt + output, per pool (flags are per pool) and route (traffic is per route).
        self.request_prompt_tokens = Histogram(
            "fleetgate_request_prompt_tokens",
            "Prompt tokens per request (upstream usage)",
            ["route", "pool"],
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        self.request_output_tokens = Histogram(
            "fleetgate_request_output_tokens",
            "Output tokens per request (upstream usage)",
            ["route", "pool"],
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        self.request_context_tokens = Histogram(
            "fleetgate_request_context_tokens",
            "Prompt + output tokens per request: what --max-model-len bounds",
            ["route", "pool"],
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        # vLLM refuses a request whose prompt + max_tokens exceeds --max-model-len, generated or
        # not: advise never cuts the flag below the longest of these.
        self.request_budget_tokens = Histogram(
            "fleetgate_request_budget_tokens",
            "Prompt tokens + the output budget the request asked for (max_completion_tokens, "
            "max_tokens or max_output_tokens), for requests that state one",
            ["route", "pool"],
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            "fleetgate_cached_tokens",
            "Prompt tokens served from the prefix cache",
            ["route", "model"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "fleetgate_completion_tokens",
            "Output tokens",
            ["route", "model"],
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "fleetgate_prefix_hit_rate",
            "Cached / prompt tokens over a sliding window",
            ["route"],
            registry=r,
        )
        self.replica_seconds = Counter(
            "fleetgate_replica_seconds",
            "Replica time attributed to the route",
            ["route", "pool"],
            registry=r,
        )
        self.cost_per_1m = Gauge(
            "fleetgate_cost_per_1m_tokens_usd",
            "USD per 1M tokens over a sliding window, as this gateway pod's traffic sees the "
            "pool bill (several pods: compute it fleet-wide from the counters, docs/cost.md)",
            ["route"],
            registry=r,
        )
        self.pool_bill = Gauge(
            "fleetgate_pool_bill_usd_per_hour",
            "What a pool's replicas cost per hour (price x replicas): the fleet-wide cost per "
            "1M tokens splits it by fleetgate_replica_seconds_total (docs/cost.md)",
            ["pool"],
            registry=r,
        )
        self.predicted_cached = Counter(
            "fleetgate_predicted_cached_tokens",
            "Cached tokens the index predicted",
            ["route"],
            registry=r,
        )
        self.cache_prediction = Counter(
            "fleetgate_cache_prediction",
            "Index prediction vs the engine's cached_tokens",
            ["route", "outcome"],
            registry=r,
        )
        self.slo_requests = Counter(
            "fleetgate_slo_requests",
            "Requests that met / missed the route's SLOs: slo=ttft|tpot, and all (both: goodput)",
            ["route", "slo", "outcome"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "fleetgate_routing_decision_seconds",
            "Time to decide (index lookup + plugins)",
            ["policy"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.index_lookup_seconds = Histogram(
            "fleetgate_index_lookup_seconds",
            "Block-index lookup latency",
            ["backend"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.index_errors = Counter(
            "fleetgate_index_errors",
            "Index calls that failed",
            ["backend"],
            registry=r,
        )
        self.speculative_slow = Counter(
            "fleetgate_speculative_writes_slow",
            "Speculative index writes dropped for outlasting their 50 ms budget: Redis answered "
            "late (a busy gateway or Redis), not an index failure",
            ["backend"],
            registry=r,
        )
        self.degraded = Counter(
            "fleetgate_degraded_decisions",
            "Decisions made on load alone",
            ["route", "reason"],
            registry=r,
        )
        self.last_resort = Counter(
            "fleetgate_last_resort_decisions",
            "Decisions among replicas marked unhealthy by missed health polls, made because every "
            "replica of the model was (circuit breakers still apply)",
            ["route"],
            registry=r,
        )
        self.overflow = Counter(
            "fleetgate_overflow_decisions",
            "Requests predicted to miss their TTFT SLO on every replica, placed where they stall "
            "the fewest requests that can still make theirs (fleet-cost's overflow; sustained, "
            "the fleet is past saturation)",
            ["route"],
            registry=r,
        )
        self.upstream_retries = Counter(
            "fleetgate_upstream_retries",
            "Retries on another replica before the first byte",
            ["route", "reason"],
            registry=r,
        )
        self.upstream_connections = Gauge(
            "fleetgate_upstream_connections",
            "Keep-alive connections to replicas open now (idle or serving a request)",
            registry=r,
        )
        self.gateway_inflight = Gauge(
            "fleetgate_gateway_inflight_requests",
            "Requests this gateway process holds now (queued in flow control or upstream): "
            "its own load, what the gateway HPA scales on",
            registry=r,
        )
        self.replica_inflight = Gauge(
            "fleetgate_replica_inflight",
            "Requests in flight on the replica as this gateway sees them: with Redis, every "
            "gateway's (the fleet view, the same on each gateway); without, this gateway's",
            ["replica"],
            registry=r,
        )
        self.replica_healthy = Gauge(
            "fleetgate_replica_healthy",
            "1 healthy, 0 unhealthy or circuit open",
            ["replica"],
            registry=r,
        )
        self.replica_decode_itl = Gauge(
            "fleetgate_replica_decode_itl_seconds",
            "The engine's mean time between output tokens over the last seconds, as flow control "
            "reads it (absent while unknown)",
            ["replica"],
            registry=r,
        )
        self.prefix_repeat_fraction = Gauge(
            "fleetgate_prefix_repeat_fraction",
            "Share of prompt tokens repeating a prefix seen before",
            ["route"],
            registry=r,
        )
        self.cache_busting_layout = Gauge(
            "fleetgate_cache_busting_layout",
            "1 when a cache-busting prompt layout is detected",
            ["route"],
            registry=r,
        )
        self.policy_reloads = Counter(
            "fleetgate_policy_reloads",
            "Policy reloads",
            ["outcome"],
            registry=r,
        )
        for outcome in ("ok", "rejected"):  # born at 0: increase() sees the first reload
            self.policy_reloads.labels(outcome)
        self.policy_info = Gauge(
            "fleetgate_policy_info",
            "1, labelled with the digest of the policy this gateway runs (pods whose digests "
            "differ run different policies: a reload that reached some pods only)",
            ["digest"],
            registry=r,
        )
        self.route_slo = Gauge(
            "fleetgate_route_slo_seconds",
            "The p95 objectives each route declares in the policy (slo=ttft|tpot): what "
            "`fleetgate triage` checks the route's latency against. Absent for a route that "
            "declares none (its fleetgate_slo_requests_total counts against the defaults)",
            ["route", "slo"],
            registry=r,
        )
        # Flow control (docs/flow-control.md): tenants are policy names, classes a fixed set.
        self.flow_queue_length = Gauge(
            "fleetgate_flow_queue_length",
            "Requests waiting in the gateway's flow-control queue",
            ["request_class"],
            registry=r,
        )
        self.flow_queue_wait = Histogram(
            "fleetgate_flow_queue_wait_seconds",
            "Time requests spent in the flow-control queue (admitted, refused or abandoned)",
            ["request_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.flow_itl_bound = OptionalGauge(
            "fleetgate_flow_itl_bound_ratio",
            "The inter-token bound flow control holds requests by, as a fraction of their TPOT "
            "SLO: starts at saturation_itl_fraction, lowered by each TPOT miss and raised by each "
            "TPOT met (tpot_target); absent while flow control is off",
            r,
        )
        self.flow_decisions = Counter(
            "fleetgate_flow_decisions",
            "Flow-control decisions: admitted, queued, shed, abandoned (a queued client that "
            "went away) or failed (routing it again failed; the gateway stopped), by reason",
            ["tenant", "request_class", "decision", "reason"],
            registry=r,
        )
        self.flow_priority_header_ignored = Counter(
            "fleetgate_flow_priority_header_ignored",
            "Requests whose x-fleetgate-priority header was ignored: their tenant may not set "
            "it (allow_priority_header), so they kept the tenant's class",
            ["tenant"],
            registry=r,
        )
        self.flow_priority_field_dropped = Counter(
            "fleetgate_flow_priority_field_dropped",
            "Requests whose body carried vLLM's priority field for a tenant that may not choose "
            "its priority (allow_priority_header): the field was dropped before the engine",
            ["tenant"],
            registry=r,
        )
        self.flow_steered = Counter(
            "fleetgate_flow_steered",
            "Requests flow control moved off the replica routing chose, whose decodes ran too "
            "slow for their TPOT SLO, to one with room: critical ones (steer_critical), and "
            "others it would have held on a calm fleet (steer_when_calm); and queue heads held "
            "for their chosen replica's backlog, moved to an idle replica",
            ["tenant", "request_class"],
            registry=r,
        )
        for name, metric in list(vars(self).items()):
            if isinstance(metric, MetricWrapperBase) and metric._labelnames:
                setattr(self, name, CachedLabels(metric))

    def set_policy(self, digest: str, routes: Iterable[Route] = ()) -> None:
        """This gateway now runs the policy with ``digest`` and ``routes`` (the series of the
        last one go)."""
        self.policy_info.clear()
        self.policy_info.labels(digest).set(1)
        self.route_slo.clear()
        for route in routes:
            if not route.slo_declared:
                continue
            for slo, ms in (("ttft", route.ttft_slo_ms), ("tpot", route.tpot_slo_ms)):
                if ms is not None:
                    self.route_slo.labels(route.name, slo).set(ms / 1000.0)

    def forget_replica(self, replica_id: str) -> None:
        """Drop the per-replica gauges of a replica that left the fleet (a frozen ``healthy=1``
        or in-flight count would outlive it). Counters keep their series: they are history."""
        for gauge in (self.replica_healthy, self.replica_inflight, self.replica_decode_itl):
            gauge.remove(replica_id)

    def precreate(
        self,
        routes: Iterable[tuple[str, Iterable[str]]],
        models: Iterable[str],
        backend: str,
        pools: Iterable[str] = (),
    ) -> None:
        """Create, at 0, the label sets that dashboards and alerts select, before any event.

        A series that does not exist yet is "No data" on a panel instead of 0, and ``rate()`` /
        ``increase()`` miss the first event of a counter born at 1. Token counters matter most:
        Prometheus extrapolates each series' rate on its own, so a cached-tokens series born at a
        different value than its prompt-tokens series can make their ratio exceed 1. ``routes``:
        each route's name and the SLOs it is measured against (``ttft``, ``tpot``); ``models``:
        the base models known now; ``pools``: the replica pools (the fleet-wide cost per 1M
        tokens is a rate of replica seconds: born at its first request's charge, a series showed
        no increase at all when one scrape saw the whole burst). Idempotent (cached).
        """
        self.index_errors.labels(backend)
        models = list(models)
        pools = list(pools)
        for route, slos in routes:
            for pool in pools:
                self.replica_seconds.labels(route, pool)
            for model in models:
                for tokens in (self.prompt_tokens, self.cached_tokens, self.completion_tokens):
                    tokens.labels(route, model)
            for code in _ROUTE_ERROR_CODES:
                self.errors.labels(route, code)
            for reason in _RETRY_REASONS:
                self.upstream_retries.labels(route, reason)
            self.degraded.labels(route, "index_unavailable")
            self.overflow.labels(route)
            checked = list(slos)
            for slo in [*checked, "all"] if checked else []:
                for outcome in ("met", "missed"):
                    self.slo_requests.labels(route, slo, outcome)
