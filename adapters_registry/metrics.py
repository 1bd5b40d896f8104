"""The adapter metrics of docs/metrics.md (section "Adapters"), in one small class.

Label values are server-controlled: ``adapter`` only ever holds catalogued adapters (requests for
unknown names are refused before anything is counted) and ``replica`` holds replica ids.

``/metrics`` is served on the port tenants call, so a *private* adapter (not ``public``) is
labelled with an opaque ``private-<12 hex>`` instead of its name (``private_adapter_label``): a
tenant must not learn other tenants' adapter names, or watch their traffic, from it. Public
adapters keep their name. ``GET /admin/adapters`` maps each label back to its adapter. The hash
is keyed with a secret of the deployment (``label_key``): unkeyed, a guessed name and a source
following the documented ``/adapters/<tenant>/<name>`` layout confirmed a label, and its
request counter then showed that adapter's traffic.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from collections.abc import Callable, Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

#: Cold starts range from milliseconds (host cache) to a minute (large adapters from S3).
COLD_START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


#: Environment variable holding the key of private adapters' labels (any string), set alike on
#: every gateway of a deployment; without it the key is derived from the policy's API key hashes.
LABEL_KEY_ENV = "FLEETGATE_ADAPTER_LABEL_KEY"


def label_key(key_hashes: Iterable[str]) -> bytes:
    """The key of private adapters' labels: ``$FLEETGATE_ADAPTER_LABEL_KEY``, else every
    tenant's API key hashes (in the policy file, never shown to tenants: each knows at most its
    own). Alike on every gateway sharing the policy; rotating a key changes the labels."""
    explicit = os.environ.get(LABEL_KEY_ENV)
    if explicit:
        return explicit.encode()
    return "\n".join(sorted(key_hashes)).encode()


def private_adapter_label(name: str, source: str, key: bytes = b"") -> str:
    """The ``adapter`` label of a private adapter: ``private-`` and 12 hex digits of an HMAC of
    its name and source under ``key`` (``label_key``). Stable across gateways and restarts;
    without the key no guess of a name (and source) can be confirmed from it, and new weights
    under the same name start a new series."""
    message = f"fleetgate/adapter-label/v2/{name}/{source}".encode()
    digest = hmac.new(key, message, hashlib.sha256).hexdigest()
    return f"private-{digest[:12]}"


class AdapterMetrics:
    """Counters, gauges and the cold-start histogram, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        #: (Adapter name, source of the weights or None for the catalog's) -> its ``adapter``
        #: label; the registry sets the catalog's (``AdapterCatalog.metrics_label``: private
        #: adapters get an opaque label).
        self.label_of: Callable[[str, str | None], str] = lambda name, source=None: name
        reg = REGISTRY if registry is None else registry
        self.requests = Counter(
            "fleetgate_adapter_requests_total", "Requests per catalogued adapter",
            ["adapter"], registry=reg,
        )
        self.loads = Counter(
            "fleetgate_adapter_loads_total", "Runtime adapter loads",
            ["adapter", "replica", "outcome"], registry=reg,
        )
        self.unloads = Counter(
            "fleetgate_adapter_unloads_total", "Runtime adapter unloads",
            ["adapter", "replica", "reason"], registry=reg,
        )
        self.cold_start = Histogram(
            "fleetgate_adapter_cold_start_seconds", "Time to load an adapter that was not resident",
            ["adapter"], buckets=COLD_START_BUCKETS, registry=reg,
        )
        self.slots_used = Gauge(
            "fleetgate_adapter_slots_used", "GPU LoRA slots in use", ["replica"], registry=reg,
        )
        self.thrash_events = Counter(
            "fleetgate_adapter_thrash_events_total", "Loads refused by the thrash guard",
            ["replica"], registry=reg,
        )

    def request(self, adapter: str) -> None:
        """One request for ``adapter``."""
        self.requests.labels(adapter=self.label_of(adapter, None)).inc()

    def load(
        self, adapter: str, replica: str, ok: bool, seconds: float | None = None,
        source: str | None = None,
    ) -> None:
        """One load attempt (of the weights at ``source``, None: the catalog's); a successful
        one also observes its cold-start time."""
        label = self.label_of(adapter, source)
        self.loads.labels(adapter=label, replica=replica, outcome="ok" if ok else "failed").inc()
        if ok and seconds is not None:
            self.cold_start.labels(adapter=label).observe(seconds)

    def unload(
        self, adapter: str, replica: str, reason: str, source: str | None = None
    ) -> None:
        """One unload (``lru``, ``admin``, ``prewarm`` or ``replaced``) of the weights at
        ``source`` (None: unknown, labelled as the catalog's)."""
        label = self.label_of(adapter, source)
        self.unloads.labels(adapter=label, replica=replica, reason=reason).inc()

    def set_slots_used(self, replica: str, used: int) -> None:
        """GPU LoRA slots in use on ``replica``."""
        self.slots_used.labels(replica=replica).set(used)

    def thrash_event(self, replica: str) -> None:
        """A load refused by the thrash guard."""
        self.thrash_events.labels(replica=replica).inc()

    def forget_replica(self, replica: str) -> None:
        """Drop the slot gauge of a replica that left (its counters keep their history)."""
        with contextlib.suppress(KeyError):
            self.slots_used.remove(replica)
