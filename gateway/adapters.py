"""The gateway side of multi-LoRA serving: one ``AdapterRegistry`` per gateway process.

``adapters_registry/`` owns the catalog, placement and loading; this module only connects it to the
request path:

- which ``model`` names an adapter, and may this tenant use it (``resolve_model``);
- what ``/v1/models`` lists for a tenant (``model_cards``);
- the per-replica cold-load estimates routing reads (``fill_cold_load_estimates``);
- holding the adapter loaded on the replica a request is sent to (``hold_adapter``), turning the
  registry's "try elsewhere" errors into ``ReplicaUnsuitable`` for the proxy's fallback loop;
- opening and closing the registry with the app (``open_registry``).

The registry is on in policy mode (the file's ``adapters:``, runtime additions through the admin
API, reloads) and in ``fleetgate up --adapters N``; without a policy file the gateway passes the
engines' own adapters through unmanaged, as before.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from adapters_registry import (
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterRegistry,
    LoadResult,
    NoAdapterSlot,
    RedisPlacementStore,
    RegistrySettings,
    ThrashGuardTripped,
)
from adapters_registry.prewarm import ReconcileReport
from gateway import errors
from gateway.config import GatewayConfig
from gateway.engine_api import EngineLoraClient
from gateway.errors import GatewayError, model_not_found
from gateway.policy_view import GatewayPolicy, Tenant
from gateway.proxy import ReplicaUnsuitable
from gateway.replicas import ReplicaRegistry
from gateway.state import GatewayState
from routing.config import Policy
from routing.contracts import RoutingRequest
from routing.state import ReplicaState
from routing.types import ReplicaId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSetup:
    """How to build this gateway's adapter registry once the upstream session exists."""

    #: The catalog's policy: the policy file's, or a generated one (``fleetgate up --adapters``).
    policy: Policy
    #: Shared placement in Redis (every gateway sees the same loads and locks); None: in memory.
    redis_url: str | None = None
    key_prefix: str = "fleetgate:"
    settings: RegistrySettings = field(default_factory=RegistrySettings)
    #: Seconds between pre-warm rounds; None turns pre-warming off (refresh still runs).
    prewarm_interval_s: float | None = 30.0


def setup_from_policy(policy: Policy | None, config: GatewayConfig) -> AdapterSetup | None:
    """The registry setup of policy mode (``policy`` is the loaded file); None without one."""
    if policy is None:
        return None
    return AdapterSetup(
        policy=policy,
        redis_url=config.redis_url,
        key_prefix=config.adapter_key_prefix,
        settings=config.adapter_settings or RegistrySettings(),
        prewarm_interval_s=config.adapter_prewarm_interval_s,
    )


def open_registry(gw: GatewayState, setup: AdapterSetup) -> AdapterRegistry:
    """The registry over the gateway's pooled session, its metrics in the gateway's registry."""
    engine = EngineLoraClient(gw.http(), setup.settings.loader.load_timeout_s)
    kwargs: dict[str, Any] = {
        "settings": setup.settings,
        # The gateway's own registry: /metrics shows adapter metrics, and several gateway apps in
        # one process (tests, workers) never register the same metric twice.
        "metrics_registry": gw.metrics.registry,
    }
    if setup.redis_url:
        store = RedisPlacementStore.from_url(setup.redis_url, setup.key_prefix)
        return AdapterRegistry(setup.policy, store, engine, **kwargs)
    return AdapterRegistry.in_memory(setup.policy, engine, **kwargs)


# --------------------------------------------------------------------------- request path


def resolve_model(
    registry: AdapterRegistry,
    policy: GatewayPolicy,
    replicas: ReplicaRegistry,
    tenant: Tenant,
    model: str,
) -> tuple[str, str | None]:
    """(base model, adapter) for ``model`` through the registry's catalog; 404 otherwise.

    Base models: the policy's, else those the replicas serve. An adapter the tenant may not use
    raises the same 404 as a name that does not exist.
    """
    if model in (policy.known_models or replicas.base_models()):
        return model, None
    try:
        adapter = registry.authorize(tenant.name, model)
    except AdapterNotFound:
        raise model_not_found(model) from None
    return adapter.base_model, adapter.name


def model_cards(gw: GatewayState, tenant: Tenant) -> list[tuple[str, str | None]]:
    """(id, parent) for ``/v1/models``: base models, then the adapters ``tenant`` may use."""
    registry = gw.adapters
    assert registry is not None
    bases = sorted(gw.policy.known_models or gw.registry.base_models())
    adapters = sorted((a.name, a.base_model) for a in registry.visible_to(tenant.name))
    return [(m, None) for m in bases] + [(name, base) for name, base in adapters]


def fill_cold_load_estimates(
    registry: AdapterRegistry | None,
    replicas: ReplicaRegistry,
    request: RoutingRequest,
    candidates: Sequence[ReplicaState],
) -> None:
    """Set ``request.adapter_cold_load_ms`` so expected-TTFT routing prefers warm replicas."""
    if registry is None or request.adapter is None:
        return
    request.adapter_cold_load_ms = ColdLoadEstimates(
        registry, replicas, request.adapter, candidates
    )


class ColdLoadEstimates(Mapping[ReplicaId, float]):
    """``RoutingRequest.adapter_cold_load_ms`` of one request, each replica's estimate worked
    out when a scorer first reads it.

    An estimate costs several microseconds (the adapter's placement, load times, the thrash
    guard), and a pruned decision over 1,000 replicas scores about thirty of them: working out
    all 1,000 up front cost milliseconds per adapter request.
    """

    def __init__(
        self,
        registry: AdapterRegistry,
        replicas: ReplicaRegistry,
        adapter: str,
        candidates: Sequence[ReplicaState],
    ) -> None:
        self._registry = registry
        self._replicas = replicas
        self._adapter = adapter
        self._candidates = candidates
        self._known: dict[ReplicaId, float] = {}

    def get(self, key: ReplicaId, default: Any = None) -> Any:  # type: ignore[override]
        known = self._known.get(key)
        if known is not None:
            return known
        state = self._replicas.get(key)
        if state is None:
            return default
        known = self._known[key] = self._registry.cold_load_ms(
            self._replicas.adapter_view(state), self._adapter
        )
        return known

    def __getitem__(self, key: ReplicaId) -> float:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return float(value)

    def __iter__(self) -> Iterator[ReplicaId]:
        return (state.replica_id for state in self._candidates)

    def __len__(self) -> int:
        return len(self._candidates)


@contextlib.asynccontextmanager
async def hold_adapter(
    registry: AdapterRegistry,
    replicas: ReplicaRegistry,
    replica: ReplicaState,
    adapter: str,
    last_resort: bool,
) -> AsyncIterator[LoadResult]:
    """Keep ``adapter`` loaded on ``replica`` (loading it first) for one upstream attempt.

    Raises ``ReplicaUnsuitable`` when the proxy should try the next candidate: no evictable slot,
    the thrash guard (unless ``last_resort``), or the engine refused or failed the load. Loads
    finish before any byte is sent, so a failure here can always move on.
    """
    view = replicas.adapter_view(replica)
    async with contextlib.AsyncExitStack() as stack:
        try:
            result = await stack.enter_async_context(
                registry.serving(view, adapter, last_resort=last_resort)
            )
        except NoAdapterSlot as exc:
            log.info("%s; trying another replica", exc)
            raise ReplicaUnsuitable("no_adapter_slot", _no_slot(adapter)) from exc
        except ThrashGuardTripped as exc:
            log.info("%s; trying another replica", exc)
            raise ReplicaUnsuitable("adapter_thrash_guard", _no_slot(adapter)) from exc
        except AdapterLoadFailed as exc:
            # The engine's own message is for the SRE's log, never for the client.
            log.warning("%s", exc)
            if names_lora_disabled(exc.engine_message):
                replicas.lora_disabled(replica.replica_id)
            raise ReplicaUnsuitable(
                "adapter_load_failed", _load_failed(adapter), unreachable=exc.unreachable
            ) from exc
        except AdapterNotFound:
            raise model_not_found(adapter) from None  # removed from the catalog meanwhile
        yield result


def learn_lora_disabled(replicas: ReplicaRegistry, report: ReconcileReport) -> None:
    """Pre-warm's refusals teach what a request's do (``serving``): an engine that refused a
    load as running without LoRA has no slot (the heterogeneous-fleet re-check: replicas only
    pre-warm had tried stayed candidates for adapter requests)."""
    for step, why in report.failed:
        if names_lora_disabled(why):
            replicas.lora_disabled(step.replica)


def names_lora_disabled(engine_message: str) -> bool:
    """True for an engine's refusal to load any adapter because it runs without LoRA (vLLM:
    "LoRA is not enabled. Use --enable-lora ..."; the simulated engine: "LoRA is disabled on
    this engine"). Only those sentences: a load error quotes the adapter's path, and an
    adapter-specific refusal ("... without --enable-lora-bias") is not the engine's (the diff
    review)."""
    return _LORA_DISABLED.search(engine_message) is not None


_LORA_DISABLED = re.compile(r"\bLoRA is (?:not enabled|disabled on this engine)\b")


def _no_slot(adapter: str) -> GatewayError:
    return GatewayError(
        503,
        errors.NO_ADAPTER_SLOT,
        f"No replica has a free LoRA slot for `{adapter}` right now.",
        "model",
        headers={"Retry-After": "1"},
    )


def _load_failed(adapter: str) -> GatewayError:
    return GatewayError(
        502, errors.ADAPTER_LOAD_FAILED, f"Loading the adapter `{adapter}` failed.", "model"
    )
