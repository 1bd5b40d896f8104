"""The replica registry: what the gateway knows about each replica, kept fresh by polling.

Replicas come from the policy file / command line (static) and, with ``--redis``, from agents
registered in the fleet store. A health loop polls each replica's ``/health``, ``/v1/models``
(served base models and loaded adapters) and ``/metrics`` (queue and KV usage); a circuit breaker
per replica takes request-path failures into account between polls.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import aiohttp

from gateway.attempts import AttemptsInFlight
from gateway.breaker import CircuitBreaker
from gateway.inflight import InflightTracker
from gateway.policy_view import PoolSpeeds, ReplicaSpec
from routing.fleet import Fleet
from routing.lora_slots import LORA_INFO_METRIC, LoraInfo, latest_lora_info
from routing.recent_itl import RecentItl
from routing.redis_clients import redacted
from routing.state import MAX_REQUEST_COUNT, ReplicaState
from routing.types import Epoch, ReplicaId

log = logging.getLogger(__name__)

# vLLM gauge names -> ReplicaState fields they fill.
_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    # A histogram's running sum and count: the recent mean time between tokens (RecentItl).
    "vllm:inter_token_latency_seconds_sum": "itl_sum_s",
    "vllm:inter_token_latency_seconds_count": "itl_count",
}


def _label_pairs(line: str) -> dict[str, str]:
    labels = line.split("{", 1)[1].rsplit("}", 1)[0]
    pairs = {}
    for pair in labels.split('",'):
        key, _, value = pair.partition("=")
        pairs[key.strip()] = value.strip().strip('"')
    return pairs


def parse_lora_info(text: str) -> LoraInfo | None:
    """The current ``vllm:lora_requests_info`` sample, if the engine exports one (a line scan:
    this runs on every poll of every replica)."""
    prefix = LORA_INFO_METRIC + "{"
    samples = []
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        samples.append((_label_pairs(line), value))
    return latest_lora_info(samples)


#: vLLM's info gauge of its cache configuration: labels ``block_size`` and ``num_gpu_blocks``.
CACHE_CONFIG_METRIC = "vllm:cache_config_info"


def parse_kv_capacity_tokens(text: str) -> int | None:
    """The engine's KV cache size in tokens (``num_gpu_blocks`` x ``block_size`` of
    ``vllm:cache_config_info``, summed over its engine cores), or None where it does not say.

    fleet-cost's eviction charge and its stickiness while the holder has TTFT slack need the
    capacity (``routing/policies/cache_fill.py``); a replica agent reads it from the same gauge,
    and a replica listed statically had none without this."""
    prefix = CACHE_CONFIG_METRIC + "{"
    total = 0
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels = _label_pairs(line)
        try:
            blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            continue  # "None" before the engine has profiled its memory
        if blocks > 0 and size > 0:
            total += blocks * size
    return total or None


#: Gauges read as the fullest of the engine's label sets rather than their sum: a fraction per
#: data-parallel rank (two ranks at 60% are not 120% full), as the replica agent reads it.
_FULLEST = frozenset({"kv_usage"})

#: The highest each field can truly read; past it a sample is a glitch.
_LIMITS = {"running": MAX_REQUEST_COUNT, "waiting": MAX_REQUEST_COUNT}


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Each of the gauges in ``_GAUGES`` across label sets (one engine, possibly DP ranks):
    counts summed, the KV cache usage the fullest rank's."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        field = _GAUGES.get(name)
        if field is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        # Gauges and counters here are never negative, infinite or absurdly large: such a
        # sample is a scrape glitch, not a figure to route on. It makes its field NaN (with the
        # other label sets too), which the poll treats as unread (``_finite``).
        if not math.isfinite(value) or value < 0 or value > _LIMITS.get(field, math.inf):
            value = math.nan
        before = values.get(field)
        if before is None:
            values[field] = value
        elif field in _FULLEST:
            # The fullest rank that reads: one glitched rank must not hide a full one (it
            # would keep the last reading, an empty cache perhaps, while the others fill).
            values[field] = value if math.isnan(before) else max(before, value)
        else:
            values[field] = before + value
    return values


#: The engine figures a poll copies into the state, and their types.
_QUEUE_GAUGES: dict[str, type[int] | type[float]] = {
    "running": int,
    "waiting": int,
    "kv_usage": float,
}


def _finite(gauges: Mapping[str, float], name: str) -> bool:
    value = gauges.get(name)
    return value is not None and math.isfinite(value)


class ReplicaRegistry:
    """Replica states, their breakers, and the adapters each replica reports."""

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 10.0,
        unhealthy_after_polls: int = 2,
        discovery_grace_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._states: dict[ReplicaId, ReplicaState] = {}
        #: ``_states`` as the engine reads it (routing/fleet.py), kept in step by ``_put``;
        #: rebuilt by ``routable`` after a replica is added or removed (None until then).
        self._fleet: Fleet | None = None
        #: Replicas whose circuit breaker has opened (open or half-open): only these can be
        #: routable copies marked unhealthy, so ``routable`` need not ask every breaker.
        self._tripped: set[ReplicaId] = set()
        #: Replicas whose engine figures were replaced since ``refresh_inflight`` last ran: their
        #: ``finished_since_read`` is to be counted again against the new reading.
        self._figures_replaced: set[ReplicaId] = set()
        #: A discovered replica missing from the fleet store's listing is kept this long before
        #: it is forgotten: a restarted (empty) Redis lists nobody until the agents register
        #: again, and dropping every replica then answered 503 with the whole fleet up. Health
        #: polls go on meanwhile, so a replica that is really gone is unhealthy, not routed.
        self.discovery_grace_s = discovery_grace_s
        self._clock = clock
        #: Told the id of each replica that leaves the fleet (the adapter registry forgets its
        #: placement and slot gauges).
        self.on_remove: list[Callable[[ReplicaId], None]] = []
        self._missing_since: dict[ReplicaId, float] = {}
        #: Why the fleet store (where agents register replicas) could not be read last time;
        #: None when it was, or when there is none.
        self.discovery_error: str | None = None
        #: Consecutive failed /health polls per replica; ``unhealthy_after_polls`` in a row
        #: mark it unhealthy.
        self._failed_polls: dict[ReplicaId, int] = {}
        self.unhealthy_after_polls = max(1, unhealthy_after_polls)
        #: What each registered replica's agent last said of its engine's health. A replica is
        #: healthy only while both say so, its agent and this gateway's polls: each sees
        #: failures the other cannot (a hung engine the agent's probe missed; a network path
        #: from here that is down while the engine answers its localhost agent).
        self._registered_healthy: dict[ReplicaId, bool] = {}
        #: Discovered replicas whose agents removed them from the fleet (a clean stop) and that
        #: have not registered again: down whatever their polls say, until forgotten.
        self._departed: set[ReplicaId] = set()
        self._breakers: dict[ReplicaId, CircuitBreaker] = {}
        self._static: set[ReplicaId] = set()
        self._discovered: set[ReplicaId] = set()
        #: Pool -> the engine speeds the policy configures for it: a registered replica's
        #: agent reports its engine's figures, not what routing should start from.
        self._pool_speeds: dict[str, PoolSpeeds] = {}
        self._failure_threshold = failure_threshold
        self._cooldown_s = cooldown_s
        #: adapter name -> base model, as replicas list them in ``/v1/models`` (``parent``).
        self.served_adapters: dict[str, str] = {}
        #: When each replica's adapter list was read. Separate from ``metrics_read_at`` (the
        #: gauges' time): ``/v1/models`` can answer while ``/metrics`` does not, and the
        #: adapter registry must know how fresh the adapter list is, not the queue figures.
        self._adapters_read_at: dict[ReplicaId, float] = {}
        #: The requests being tried on each replica; those a replica holds unanswered when it
        #: is marked down are aborted and retried elsewhere (``gateway/attempts.py``).
        self.attempts = AttemptsInFlight()
        #: Each replica's recent inter-token latency, from its engine's ITL histogram.
        self._itl: dict[ReplicaId, RecentItl] = {}
        #: Discovered replicas whose registration expired but which still answer (warned once).
        self._orphans: set[ReplicaId] = set()
        #: How long such a replica is kept at most: a removal its agent could not write (Redis
        #: refusing writes) must not keep it routed for ever.
        self.orphan_max_s = 3600.0
        #: When each replica last passed a health poll (``clock`` time).
        self._answered_at: dict[ReplicaId, float] = {}
        #: When the first health poll of a replica's current run of failed polls was sent.
        self._failing_since: dict[ReplicaId, float] = {}
        #: Replicas whose engine refused an adapter load as running without LoRA: no GPU slot
        #: (``max_loras`` 0) until the engine reports slots of its own.
        self._lora_disabled: set[ReplicaId] = set()

    # ------------------------------------------------------------------ membership

    def set_static(self, specs: Iterable[ReplicaSpec]) -> None:
        """Replace the statically configured replicas (policy reload keeps known states)."""
        wanted = {ReplicaId(s.replica_id): s for s in specs}
        for rid in self._static - set(wanted):
            self.remove(rid)
        for rid, spec in wanted.items():
            old = self._states.get(rid) if rid in self._static else None
            if old is not None and old.url != spec.url:
                # Another engine under the same id: nothing learnt of the old one holds for it.
                if rid.rsplit("/", 1)[-1].isdigit():  # positional: removing one renames others
                    log.warning(
                        "replica %s is now %s (was %s): a static replica listed as a bare URL "
                        "is named by its position, so removing one renames the others, and the "
                        "prefix index entries their agents record under these ids name the "
                        "wrong engines until the agents are restarted with the new ids. Give "
                        "static replicas names ({name, url}; docs/policy.md).",
                        rid, redacted(spec.url), redacted(old.url),
                    )
                else:
                    log.warning(
                        "replica %s moved to %s (was %s): its state starts afresh; restart the "
                        "agent beside it if the engine changed.",
                        rid, redacted(spec.url), redacted(old.url),
                    )
                self.remove(rid)
            self.upsert(
                ReplicaState(
                    replica_id=rid,
                    url=spec.url,
                    pool=spec.pool,
                    models=spec.models,
                    block_size=spec.block_size,
                )
            )
            # New or reloaded, its pool's configuration is the file's (a reload's speeds and
            # declared LoRA slots were kept at the first load's until a restart: the re-check
            # review).
            self._put(self._configured(self._states[rid], spec.speeds))
        self._static = set(wanted)

    def _configured(self, state: ReplicaState, speeds: PoolSpeeds | None) -> ReplicaState:
        """``state`` with its pool's configuration (``speeds``; None: the policy names none),
        and its LoRA slots as known: none where its engine refused a load for want of LoRA or
        its pool declares ``max_loras: 0`` (an engine's own report of slots wins), unknown
        again where a declaration was taken away."""
        learned = state.replica_id in self._lora_disabled
        max_loras = state.max_loras
        if max_loras is None and (learned or (speeds is not None and speeds.lora_off)):
            max_loras = 0
        elif max_loras == 0 and speeds is not None and not speeds.lora_off and not learned:
            max_loras = None
        if speeds is None:
            return state if max_loras == state.max_loras else replace(state, max_loras=max_loras)
        return replace(
            state,
            prefill_tokens_per_s=speeds.prefill_tokens_per_s,
            decode_step_ms=speeds.decode_step_ms,
            max_loras=max_loras,
        )

    def set_pool_speeds(self, speeds: Mapping[str, PoolSpeeds]) -> None:
        """The policy's engine speeds per pool (on every load): applied to the registered
        replicas of those pools now and at each sync."""
        self._pool_speeds = dict(speeds)
        for rid in self._discovered:
            state = self._states.get(rid)
            if state is not None:
                self._put(self._with_pool_speeds(state))

    def _with_pool_speeds(self, state: ReplicaState) -> ReplicaState:
        return self._configured(state, self._pool_speeds.get(state.pool))

    def upsert(self, state: ReplicaState) -> None:
        """Add a replica or update its identity (url, pool, models, epoch), keeping live figures."""
        old = self._states.get(state.replica_id)
        if old is None:
            self._put(state)
            self._breakers[state.replica_id] = CircuitBreaker(
                self._failure_threshold,
                self._cooldown_s,
                on_trip=lambda tripped, rid=state.replica_id: self._on_trip(rid, tripped),
            )
            return
        self._put(
            replace(
                old,
                url=state.url,
                pool=state.pool,
                models=state.models or old.models,
                block_size=state.block_size,
                epoch=state.epoch,
            )
        )

    def sync_discovered(
        self, states: Iterable[ReplicaState], departed: Iterable[ReplicaId] = ()
    ) -> None:
        """Take the agents' view of registered replicas; forget those that left.

        An agent scrapes its engine several times a second, so its figures (queue, KV usage,
        adapters, epoch) replace ours; only the gateway's own in-flight counts are kept, and
        its health verdict is combined with ours (``_health_verdict``), not taken over. A
        replica missing from ``states`` past ``discovery_grace_s`` is forgotten if it was
        removed on purpose (``departed``) or no longer answers its health polls. One that still
        answers is kept (with a warning): its heartbeat expired because its agent is down or
        Redis refuses writes (full), and dropping every such replica would refuse all traffic
        while the engines serve.
        """
        seen = set()
        for state in states:
            if state.replica_id in self._static:
                continue  # listed statically: the policy file wins over a registration
            seen.add(state.replica_id)
            self._missing_since.pop(state.replica_id, None)
            self._registered_healthy[state.replica_id] = state.healthy
            state = self._with_pool_speeds(state)
            old = self._states.get(state.replica_id)
            if old is None:
                self.upsert(state)
            else:
                # Replacing ours with the agent's undid this gateway's missed polls at every
                # sync: a hung engine its agent still called up flapped between healthy and
                # not, drawing requests in each healthy spell.
                healthy = self._health_verdict(state.replica_id)
                healthy_by_polls = self._polls_ok(state.replica_id)
                self._put(
                    replace(
                        state,
                        healthy=healthy,
                        inflight_requests=old.inflight_requests,
                        inflight_prefill_tokens=old.inflight_prefill_tokens,
                        # The gateway's own reading (agents do not send one): dropping it left
                        # flow control without the engine's decode pace until the next poll.
                        decode_itl_ms=(
                            state.decode_itl_ms
                            if state.decode_itl_ms is not None
                            else old.decode_itl_ms
                        ),
                        # Read off the engine's /v1/models by this gateway's polls (agents send
                        # none): dropping it let routing send a long prompt to a short context.
                        max_model_len=(
                            state.max_model_len
                            if state.max_model_len is not None
                            else old.max_model_len
                        ),
                    )
                )
                if old.healthy and not healthy and state.draining and healthy_by_polls:
                    # Stopped on purpose: nothing new goes there, and what it holds finishes
                    # there. Moving it (as for an engine reported down) reran every unanswered
                    # request from its first token on another replica (live review, a rolling
                    # restart of two real vLLM replicas: 1.8 s requests took 7-8 s).
                    log.warning(
                        "replica %s (%s) draining (its agent is stopping it): sent nothing "
                        "new; the %d request(s) it holds finish there",
                        state.replica_id,
                        redacted(state.url),
                        self.attempts.count(state.replica_id),
                    )
                elif not healthy and old.healthy:
                    self._marked_down(state, "its agent reports the engine down")
                elif not healthy and old.draining and not state.draining:
                    # The drain is over: its engine is down. What it still holds (past
                    # ``--drain-timeout``) goes to a fallback; a drain that ended empty is no
                    # outage worth a warning.
                    if self.attempts.count(state.replica_id):
                        self._marked_down(state, "its engine stopped after its drain")
                    else:
                        log.info("replica %s (%s) stopped after its drain",
                                 state.replica_id, redacted(state.url))
                elif healthy and not old.healthy:
                    log.warning(
                        "replica %s (%s) healthy again (its agent reports the engine up)",
                        state.replica_id, redacted(state.url),
                    )
            # The agent read the adapters with its metrics: its time goes with its list.
            self._adapters_read_at[state.replica_id] = state.metrics_read_at
        now = self._clock()
        gone = set(departed)
        # Removed on purpose: down at once, whatever its polls say until it is forgotten. The
        # polls alone decided once the registration was gone, and an engine stopped less than
        # two polls before was routable again for a second or two (live review).
        self._departed = (gone & self._discovered) - seen
        for rid in self._discovered - seen:
            current = self._states.get(rid)
            if current is None:
                continue
            if rid not in self._departed:
                # Its registration expired (an agent that died, maybe mid-drain): whatever it
                # said last no longer holds, and the polls decide (``_health_verdict``).
                if current.draining:
                    self._put(replace(current, draining=False))
                continue
            # Nothing new goes there; what it holds is left to it, and it shows as draining
            # meanwhile: a standalone agent's engine (``fleetgate agent`` beside vLLM) still
            # runs after its agent stops (the pool manifest's preStop hook waits for it), and an
            # engine that stopped fails those requests over on the request path.
            held = self.attempts.count(rid)
            if current.healthy:
                log.warning(
                    "replica %s (%s) removed from the fleet by its agent: sent nothing new; the "
                    "%d request(s) it holds finish there",
                    rid, redacted(current.url), held,
                )
            if current.healthy or current.draining != (held > 0):
                self._put(replace(current, healthy=False, draining=held > 0))
        self._orphans -= seen  # registered again: a later expiry is worth a warning again
        for rid in self._discovered - seen:
            since = self._missing_since.setdefault(rid, now)
            if now - since < self.discovery_grace_s:
                seen.add(rid)  # still known: within the grace period
            elif rid in gone and self.attempts.count(rid) and now - since < self.orphan_max_s:
                # Removed, still finishing what it holds (a drain outlasts the grace period):
                # kept, out of routing, so /admin/replicas and its metrics still show it.
                seen.add(rid)
            elif rid in gone or not self._answering(rid):
                log.warning(
                    "replica %s left the fleet (%s): no longer routed to",
                    rid,
                    "removed by its agent" if rid in gone else "registration expired, "
                    "and it no longer answers its health polls",
                )
                self.remove(rid)
            else:
                if rid not in self._orphans:
                    log.warning(
                        "replica %s: its registration expired %.0f s ago but it still answers "
                        "its health polls; still routed to (is its agent down, or Redis refusing "
                        "writes?)",
                        rid,
                        now - since,
                    )
                    self._orphans.add(rid)
                seen.add(rid)
        self._discovered = seen

    def _health_verdict(self, replica: ReplicaId) -> bool:
        """Healthy unless this gateway missed ``unhealthy_after_polls`` polls in a row or the
        agent's current registration says its engine is down (after a sync or a poll alike,
        so neither undoes the other)."""
        # An expired registration says nothing any more: the polls alone decide (an orphan).
        return self._polls_ok(replica) and not self._agent_reports_down(replica)

    def _polls_ok(self, replica: ReplicaId) -> bool:
        """This gateway has not missed ``unhealthy_after_polls`` health polls in a row."""
        return self._failed_polls.get(replica, 0) < self.unhealthy_after_polls

    def _agent_reports_down(self, replica: ReplicaId) -> bool:
        """The replica's current (unexpired) registration says its engine is down, or its
        agent removed it from the fleet (a clean stop) and it has not registered again."""
        if replica in self._departed:
            return True
        return replica not in self._missing_since and not self._registered_healthy.get(
            replica, True
        )

    def _answering(self, replica: ReplicaId) -> bool:
        """The replica passed its latest health poll, one made after its registration went
        missing (a replica this gateway never polled does not count)."""
        state = self._states.get(replica)
        missing_since = self._missing_since.get(replica, math.inf)
        # Healthy as routing sees it (one missed poll is not an outage: it takes
        # ``unhealthy_after_polls`` in a row), and heard from since the registration went.
        return (
            state is not None
            and state.healthy
            and self._answered_at.get(replica, -math.inf) >= missing_since
            and self._clock() - missing_since < self.orphan_max_s
        )

    def remove(self, replica: ReplicaId) -> None:
        """Forget a replica (and tell ``on_remove``)."""
        if self._states.pop(replica, None) is not None:
            self._fleet = None  # membership changed: the next ``routable`` builds a new one
            for listener in self.on_remove:
                listener(replica)
        self._breakers.pop(replica, None)
        self._tripped.discard(replica)
        self._adapters_read_at.pop(replica, None)
        self._failed_polls.pop(replica, None)
        self._registered_healthy.pop(replica, None)
        self._missing_since.pop(replica, None)
        self._itl.pop(replica, None)
        self._lora_disabled.discard(replica)
        self._answered_at.pop(replica, None)
        self._failing_since.pop(replica, None)
        self._orphans.discard(replica)
        self._departed.discard(replica)

    # ------------------------------------------------------------------ reading

    def get(self, replica: ReplicaId) -> ReplicaState | None:
        return self._states.get(replica)

    def breaker(self, replica: ReplicaId) -> CircuitBreaker:
        return self._breakers[replica]

    def all(self) -> list[ReplicaState]:
        """Every known replica (healthy or not), for the admin API."""
        return list(self._states.values())

    def routable(self) -> Fleet:
        """The replicas as policies should see them: unhealthy if the circuit is open.

        The same ``Fleet`` from call to call while nothing trips a breaker (its states are
        replaced as they change); a copy with unhealthy states for replicas whose breaker holds
        requests back. Callers read it, they never change it.
        """
        fleet = self._fleet
        if fleet is None:
            fleet = self._fleet = Fleet(self._states.values())
        held_back = [
            replace(self._states[rid], healthy=False)
            for rid in self._tripped
            if rid in self._states and not self._breakers[rid].allows()
        ]
        return fleet.with_states(held_back) if held_back else fleet

    def _put(self, state: ReplicaState, *, inflight_only: bool = False) -> None:
        """Store ``state`` (new or replacing the replica's), keeping the fleet view in step.

        ``inflight_only``: only the gateway's in-flight figures changed (``set_inflight``).
        """
        self._states[state.replica_id] = state
        if not inflight_only:
            self._figures_replaced.add(state.replica_id)
        fleet = self._fleet
        if fleet is not None and not fleet.put(state):
            self._fleet = None  # a new replica: the next ``routable`` builds a new fleet

    def _on_trip(self, replica: ReplicaId, tripped: bool) -> None:
        """A breaker opened (``tripped``) or closed again."""
        if tripped and replica in self._breakers:  # not a removed replica's late failure
            self._tripped.add(replica)
        else:
            self._tripped.discard(replica)

    def last_resort(self, model: str) -> list[ReplicaState]:
        """Replicas of ``model`` that missed their health polls but whose circuit is closed,
        as routable copies: where to send a request when no replica of the model is healthy.

        A replica under heavy load can miss ``/health`` polls while it still serves (a busy CPU,
        a long GC pause); when that takes out every replica, answering 503 fails requests that a
        replica would have served. Circuit breakers still apply: a replica that refused or
        dropped requests on the request path is left out, so a truly dead fleet still gets 503.
        So is one whose own agent reports its engine down (or leaving): the agent probes it
        from beside it, so that is no busy spell but a dead, hung or draining engine. A hung
        one still accepts connections (the kernel's backlog), so its breaker never opened, and
        requests sent to it waited for the upstream timeout (live review, a stopped engine).
        """
        out = []
        for rid, state in self._states.items():
            if state.healthy or model not in state.models:
                continue
            if self._agent_reports_down(rid):
                continue
            if self._breakers[rid].allows():
                out.append(replace(state, healthy=True))
        return out

    def adapters_read_at(self, replica: ReplicaId) -> float:
        """When ``replica``'s adapter list was last read (0.0: never)."""
        return self._adapters_read_at.get(replica, 0.0)

    def adapter_view(self, state: ReplicaState) -> ReplicaState:
        """``state`` as the adapter registry needs it: ``metrics_read_at`` is the adapter list's
        read time (the registry reads that field as "when the engine reported its adapters")."""
        return replace(state, metrics_read_at=self.adapters_read_at(state.replica_id))

    def adapter_states(self) -> list[ReplicaState]:
        """``routable()`` through ``adapter_view``, for the registry's refresh and admin calls."""
        return [self.adapter_view(state) for state in self.routable()]

    def base_models(self) -> set[str]:
        """Base models at least one replica (healthy or not) serves."""
        return {m for s in self._states.values() for m in s.models}

    def never_listed_models(self) -> list[ReplicaState]:
        """Replicas with no model known: neither configured nor read from their ``/v1/models``
        (an engine not up yet, or at a wrong URL)."""
        return [
            s
            for rid, s in self._states.items()
            if not s.models and rid not in self._adapters_read_at
        ]

    def lora_disabled(self, replica: ReplicaId) -> None:
        """``replica``'s engine refused an adapter load as running without LoRA (vLLM without
        ``--enable-lora``): it has no GPU slot, so adapter requests go elsewhere rather than
        each paying a failed load there first (the heterogeneous-fleet review: 31 retries for
        30 adapter requests on a fleet whose pools did not declare ``max_loras: 0``). Until its
        engine reports slots (``vllm:lora_requests_info``), or a pool setting says otherwise."""
        self._lora_disabled.add(replica)
        state = self._states.get(replica)
        if state is not None and state.max_loras is None:
            self._put(replace(state, max_loras=0))

    def max_model_len(self, model: str) -> int | None:
        """The longest context a replica of ``model`` accepts, for ``/v1/models``: the largest
        any healthy one reports (any if none is healthy); None until one has reported it.
        Routing sends a request only where it fits (``serves-model``), so a fleet mixing
        context lengths takes, at most, the longest."""
        reported = [
            (s.healthy, s.max_model_len)
            for s in self._states.values()
            if model in s.models and s.max_model_len is not None
        ]
        limits = [n for healthy, n in reported if healthy] or [n for _, n in reported]
        return max(limits) if limits else None

    def ready_models(self) -> dict[str, bool]:
        """Per base model: is at least one replica serving it healthy with a closed circuit?"""
        ready: dict[str, bool] = {m: False for m in self.base_models()}
        for state in self.routable():
            if state.healthy:
                for model in state.models:
                    ready[model] = True
        return ready

    # ------------------------------------------------------------------ polling

    async def poll_once(self, session: aiohttp.ClientSession, timeout_s: float = 2.0) -> None:
        """Poll every replica once, concurrently."""
        await asyncio.gather(
            *(self._poll(session, s, timeout_s) for s in list(self._states.values()))
        )

    async def _poll(
        self, session: aiohttp.ClientSession, state: ReplicaState, timeout_s: float
    ) -> None:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        asked_at = self._clock()
        # Health comes from /health alone: a slow /metrics or /v1/models scrape on a busy engine
        # says nothing about whether it can serve, and must not take it out of routing.
        failure = ""
        try:
            async with session.get(f"{state.url}/health", timeout=timeout) as resp:
                answered_ok = resp.status == 200
                if not answered_ok:
                    failure = f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("health poll of %s failed: %s", state.replica_id, exc)
            answered_ok = False
            failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if answered_ok:
            self._failed_polls[state.replica_id] = 0
            self._answered_at[state.replica_id] = self._clock()
            self._failing_since.pop(state.replica_id, None)
        else:
            self._failed_polls[state.replica_id] = self._failed_polls.get(state.replica_id, 0) + 1
            self._failing_since.setdefault(state.replica_id, asked_at)
        # One missed poll (a CPU stall, a GC pause) is not an outage: it takes
        # ``unhealthy_after_polls`` in a row. Request-path failures open the circuit breaker
        # between polls, so a truly dead replica stops receiving traffic sooner than this. A
        # registered replica's agent must say its engine is up too.
        healthy = self._health_verdict(state.replica_id)
        models_body: dict[str, Any] | None = None
        models_read_at = 0.0
        gauges: dict[str, float] = {}
        lora: LoraInfo | None = None
        capacity_tokens: int | None = None
        if answered_ok:
            try:
                async with session.get(f"{state.url}/v1/models", timeout=timeout) as resp:
                    if resp.status == 200:
                        models_read_at = time.time()
                        models_body = await resp.json()
                # The figures are as old as the ask, not the answer: a request that ended while
                # a busy engine rendered the page may still be in them (finished_since_read).
                metrics_asked_at = time.time()
                async with session.get(f"{state.url}/metrics", timeout=timeout) as resp:
                    if resp.status == 200:
                        text = await resp.text()
                        gauges = parse_vllm_metrics(text)
                        lora = parse_lora_info(text)
                        capacity_tokens = parse_kv_capacity_tokens(text)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.debug("metrics/models read of %s failed: %s", state.replica_id, exc)
        current = self._states.get(state.replica_id)
        if current is None:  # removed while polling
            return
        updates: dict[str, Any] = {"healthy": healthy}
        if answered_ok:
            self._breakers[state.replica_id].health_ok()
            # Only an answered /v1/models says which adapters are loaded: a failed read keeps
            # the last list (and its read time) instead of claiming, freshly, that there are none.
            if isinstance(models_body, dict):
                bases, adapters = set(), set()
                limits: list[int] = []
                for entry in models_body.get("data", []):
                    parent = entry.get("parent")
                    if parent:
                        adapters.add(str(entry["id"]))
                        self.served_adapters[str(entry["id"])] = str(parent)
                    else:
                        bases.add(str(entry.get("id")))
                        limit = entry.get("max_model_len")
                        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                            limits.append(limit)
                if bases:
                    updates["models"] = frozenset(bases)
                updates["loaded_adapters"] = frozenset(adapters)
                if limits:  # one engine, one context length (its served names are aliases)
                    updates["max_model_len"] = min(limits)
                self._adapters_read_at[state.replica_id] = models_read_at
            if capacity_tokens is not None:
                # In the state's own blocks: the index may hash in another block size.
                updates["kv_capacity_blocks"] = capacity_tokens // max(1, current.block_size)
            if lora is not None:
                if lora.max_loras is not None:
                    updates["max_loras"] = lora.max_loras
                    if lora.max_loras > 0:  # restarted with LoRA on
                        self._lora_disabled.discard(state.replica_id)
                updates["running_adapters"] = lora.running
                updates["waiting_adapters"] = lora.waiting
            if gauges:
                glitched = False
                for name, kind in _QUEUE_GAUGES.items():
                    if _finite(gauges, name):
                        updates[name] = kind(gauges[name])
                    elif name in gauges:
                        # Keeps its last value. A request count so kept leaves the reading
                        # stale (the staleness penalty applies); a KV usage does not: a rank
                        # whose usage stayed NaN froze the reading of fresh counts, and after a
                        # minute the replica took no request (the routing review, session 46).
                        glitched = glitched or name != "kv_usage"
                    else:
                        updates[name] = kind(0)  # not exported: none
                if not glitched:
                    updates["metrics_read_at"] = metrics_asked_at
                if _finite(gauges, "itl_count") and _finite(gauges, "itl_sum_s"):
                    itl = self._itl.setdefault(state.replica_id, RecentItl())
                    updates["decode_itl_ms"] = itl.observe(
                        metrics_asked_at, gauges.get("itl_sum_s", 0.0), gauges["itl_count"]
                    )
        self._put(replace(current, **updates))
        if healthy and not current.healthy and answered_ok:
            log.warning(
                "replica %s (%s) answers its health polls again",
                state.replica_id,
                redacted(state.url),
            )
        if current.healthy and not healthy:
            self._marked_down(
                current,
                f"{self._failed_polls[state.replica_id]} health polls missed, the last: "
                f"{failure or 'unknown'}",
            )

    def _marked_down(self, state: ReplicaState, why: str) -> None:
        """``state``'s replica was healthy and is not any more: the requests it holds
        unanswered go to a fallback at once (a hung replica would hold them until their
        timeout), and the log says why."""
        aborted = self.attempts.abort_unanswered(state.replica_id)
        # Streams silent since its polls began to fail stalled with it (a frozen process, a
        # hung engine): a stream still flowing on a replica whose /health alone fails is left.
        failing_since = self._failing_since.get(state.replica_id)
        cut = 0
        if failing_since is not None:
            cut = self.attempts.cut_stalled(state.replica_id, failing_since)
        log.warning(
            "replica %s (%s) marked unhealthy (%s); %d request(s) it held unanswered go to a "
            "fallback; %d stream(s) silent since its health polls began to fail end with an "
            "error event",
            state.replica_id,
            redacted(state.url),
            why,
            aborted,
            cut,
        )

    def set_inflight(
        self,
        counts: dict[ReplicaId, tuple[int, int]],
        ended_since: Callable[[ReplicaId, float], int] | None = None,
        awaiting_prefill: Callable[[ReplicaId], int] | None = None,
    ) -> None:
        """Copy in-flight (requests, unprefilled prompt tokens) per replica into the states.

        ``ended_since(replica, read_at)`` (the in-flight tracker's) counts the requests sent
        there before the engine figures were read that have ended since: the ``running`` gauge
        still counts them, and they become the state's ``finished_since_read``.
        ``awaiting_prefill(replica)`` counts those still waiting for their first token
        (``inflight_unprefilled``).
        """
        for rid, state in self._states.items():
            self._set_inflight_of(state, counts.get(rid, (0, 0)), ended_since, awaiting_prefill)

    def refresh_inflight(self, tracker: InflightTracker) -> None:
        """``set_inflight`` from ``tracker``, for the replicas where something changed.

        On the request path: only replicas whose counts or ended requests the tracker saw
        change, and those whose engine figures were replaced since (``finished_since_read`` is
        counted against the new reading), are looked at. The others' figures are as they were:
        a 1,000-replica fleet pays for the few that moved, not for all of them per request.
        """
        changed = tracker.take_changed()
        changed |= self._figures_replaced
        self._figures_replaced = set()
        states = self._states
        for rid in changed:
            state = states.get(rid)
            if state is not None:
                self._set_inflight_of(
                    state, tracker.count(rid), tracker.ended_since, tracker.awaiting_prefill
                )

    def _set_inflight_of(
        self,
        state: ReplicaState,
        count: tuple[int, int],
        ended_since: Callable[[ReplicaId, float], int] | None,
        awaiting_prefill: Callable[[ReplicaId], int] | None = None,
    ) -> None:
        requests, tokens = count
        unprefilled = awaiting_prefill(state.replica_id) if awaiting_prefill else None
        # Nothing to take off a gauge of 0 (most replicas of a large, lightly loaded fleet):
        # skip the tracker's look-up.
        since_read = (
            ended_since(state.replica_id, state.metrics_read_at)
            if ended_since and state.running
            else 0
        )
        if (
            state.inflight_requests,
            state.inflight_prefill_tokens,
            state.finished_since_read,
            state.inflight_unprefilled,
        ) != (requests, tokens, since_read, unprefilled):
            self._put(
                replace(
                    state,
                    inflight_requests=requests,
                    inflight_prefill_tokens=tokens,
                    finished_since_read=since_read,
                    inflight_unprefilled=unprefilled,
                ),
                inflight_only=True,
            )

    def set_epoch(self, replica: ReplicaId, epoch: Epoch) -> None:
        state = self._states.get(replica)
        if state is not None:
            self._put(replace(state, epoch=epoch))
