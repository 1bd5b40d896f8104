"""``fleet-cost`` policy: the request's own expected TTFT plus what the choice costs everyone else.

``expected-ttft`` minimises the time to first token of the request in hand. That is the right
goal for a lone request, and the wrong one for a fleet under load: a replica with a slightly
shorter queue wins even when sending the request there means prefilling, a second time, a prefix
another replica already holds. The queue difference it chased is transient (the next arrivals
fill the shorter queue anyway); the duplicated prefill is permanent work, and it is paid by every
request that queues behind it on that replica, by the decodes running there (chunked prefill
shares their steps), and by whoever owned the blocks its new KV evicts.

For every candidate replica the scorer computes, in milliseconds::

    cost_ms = expected_ttft_ms                   # expected-ttft's own terms (queue, prefill, …)
            + decode_interference_ms             # expected-ttft's recent-prefill duty cycle
            + duplicate_ms × duplicate_weight    # prefill that a better-placed replica would skip
            + externality_ms                     # this prefill, as paid by others on the replica
            + eviction_ms                        # the cached prefixes its new blocks push out
            + fragile_ms                         # short decodes it pushes past their TPOT

* ``duplicate_ms`` is this replica's prefill time minus the least prefill time of any candidate
  (the work the fleet would not do if the request went to the best-matched replica).
  ``duplicate_weight`` grows with **fleet congestion**: ``duplicate_base + duplicate_per_queued
  ×`` the fleet's mean number of requests queued per replica (engine gauges, or the gateway's
  in-flight requests not yet running, whichever is larger) beyond ``duplicate_free_depth``,
  capped at ``max_duplicate_weight``. On an idle fleet it is 0 (but where a busy holder still
  answers within the fleet's usual TTFT and the copy would overflow a full cache:
  ``slack_duplicate_weight``), and a shorter queue may beat a cache hit (balance wins TTFT). Once
  requests queue everywhere, duplicated work is what everyone waits for and affinity wins —
  "sticky until saturated", with the threshold set by the fleet's own queue depth rather than a
  tuned constant.
* ``externality_ms`` charges this request's prefill to the requests it delays on that replica:
  ``prefill_ms × (decode_weight × running + queue_weight × expected arrivals during its wait)``.
  Chunked prefill shares every engine step with the running decodes, so each of them waits out
  this prefill once: a 1 s prefill on a replica running 40 decodes costs 40 decode-seconds of
  TPOT, which expected-TTFT alone never sees. A decode spreads the stall over its output tokens:
  against SLOs of 2 s TTFT and 50 ms TPOT and a few hundred tokens, a decode-ms is worth ~0.1 of
  the newcomer's TTFT-ms (``decode_weight`` 0.09). A decode that asked for N tokens
  (``max_tokens``) takes X / N ms of TPOT from an X ms stall, and a TPOT-ms is worth
  ``decode_slo_ratio`` (40: a 2,000 ms TTFT SLO over a 50 ms TPOT SLO) TTFT-ms, so it weighs
  ``min(1, 40 / N)``: a 40-token answer takes the whole stall, a 1,000-token chat 4% of it (the
  replica's weight is the mean over its requests in flight; without ``max_tokens``, 0.09).
  Requests sent where their expected TTFT was past ``overflow_ttft_ms`` are late already: they
  are not counted (``decode_savable_only``). On Mooncake's arXiv slice (six in ten requests
  answer in 64 tokens or fewer) goodput past saturation doubled (docs/policies/fleet-cost.md,
  *Decodes by length*). But a decode charge costs goodput only when the decodes are short of
  TPOT slack, i.e. when the replica spends much of its time prefilling: the share
  is 0 up to a prefill duty cycle of ``decode_free_duty`` (0.4, the decayed prefill ms sent
  there per ms) and grows linearly to the decodes' weight at 1. Chosen on a public conversation
  trace and the generated workloads (docs/policies/fleet-cost.md, *What was tried*). The
  arrival term (``queue_weight``) is off by default: the duplicate weight prices the queue.
* ``eviction_ms`` charges the cached tokens a prefill pushes out of a replica's prefix cache
  (``routing/policies/cache_fill.py`` estimates each cache's fill) beyond what it pushes out on
  the roomiest candidate holding as much of the prompt, at ``evict_weight`` of their prefill
  time: evicted blocks are someone's prefix, prefilled again if it comes back. Only on a fleet
  that is not queueing (duplicate weight at its base). Once every cache is full (a fleet's
  steady state: prefix caches are LRU) it is 0 everywhere; it matters while caches fill (a cold
  start, a restarted or added replica), when a replica that has just gone idle would otherwise
  take every new prefix until it evicts the first ones. The charge is weighted by the age of what
  it evicts, ``exp(-age / evict_horizon_s)`` (3 s): charged at any age it cost up to two checks
  on Mooncake's arXiv slice, whose caches fill for most of its 134 s; at 3 s it changes no
  figure there (docs/policies/fleet-cost.md, *Cache fill*).
* ``fragile_ms`` protects **short decodes**. A request that asked for few tokens (``max_tokens``:
  classifiers, extractors, tool routers) averages its TPOT over few engine steps, so one step
  that carries a long prefill chunk puts it past the TPOT SLO: a 3-token answer has two decode
  steps, and a prefill of 2 x (TPOT SLO - decode step) ms in them is a miss. A prefill is
  charged ``fragile_loss_ms`` (1 s) per such request in flight on the replica that it would push
  past ``fragile_tpot_ms`` (its prefill ms > (max_tokens - 1) x (TPOT SLO - decode step)). The
  charge falls linearly to 0 as the queue ahead of the prefill grows to ``fragile_queue_ms``
  (1 s): the short decodes queued there run during the prefills ahead of it. Long prefills then
  go where no short decode is running, and short requests keep their cache hits. On a slice of
  Mooncake's public trace (a quarter of its requests answer in three tokens) goodput rose 4-10
  points at every load (docs/policies/fleet-cost.md). Requests without ``max_tokens`` are never
  counted.

**Overflow.** A request whose expected TTFT is past ``overflow_ttft_ms`` (1.25 × the TTFT SLO: the
one its tenant or route declares, else 2 s; ``overflow_limit_ms``) on every replica is late wherever
it goes, so its own TTFT stops counting; what its prefill costs others still does. It goes where
that prefill stalls the fewest requests that can still make
their SLOs: those in flight there that were not themselves sent as overflow. Past saturation
the late requests gather on one replica, whose queue grows, and the others keep theirs short
enough to meet the SLO; its picker lets it past the load bound (``RoutingRequest.overflow``).
At most ``overflow_max_share`` (7.5%) of recent decisions are overflow: the requests gathered
on that replica wait long, and past about 5% of all requests they become the fleet's p95 TTFT.
The cap has headroom over that 5% because a cap that binds in sustained overload makes it worse:
the late requests it turns away land among on-time ones, and those turn late in turn (a 4x
replay of a public conversation window fell to 7.7% goodput and a 64 s p95 at a 5% cap, 29.1%
and 10 s at 7.5%; docs/policies/fleet-cost.md, *Overflow*).

Scores are ``(best + floor) / (cost + floor)`` as in ``expected-ttft``, picked by ``max-score``
with its bounded-load guard (a hot prefix's holder over ``1.25 × mean + 2`` requests is passed
over, so the prefix is replicated onto the next-cheapest replica instead of piling up there,
unless its queue is mostly its own cache hits or it runs the request's LoRA adapter) and
near-equal costs (within 1%) taken in turns, least recently chosen first. Prefill speed, the
backlog drain and adapter load times are calibrated online exactly as in ``expected-ttft`` (this
scorer extends it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

from pydantic import Field

from routing.contracts import CandidatesSummary, RoutingRequest
from routing.engine import PluginTerms, Profile
from routing.gone_keys import refuse_gone_keys
from routing.policies.base import PluginKind, PluginParams
from routing.policies.cache_fill import CacheFill
from routing.policies.expected_ttft import TERM_NAMES as TTFT_TERM_NAMES
from routing.policies.expected_ttft import (
    ExpectedTtftScorer,
    LazyTerms,
    _Pending,
    relative_scores,
)
from routing.policies.max_score import MaxScorePicker
from routing.policies.placements import Placements
from routing.state import ReplicaState
from routing.types import ReplicaId

__all__ = [
    "TERM_NAMES",
    "ArrivalRate",
    "DecayedShare",
    "FleetCostScorer",
    "RunningQuantile",
    "profile",
]

#: The cost terms: expected-ttft's, then this scorer's own, the total last.
TERM_NAMES = (
    *TTFT_TERM_NAMES,
    "duplicate_ms",
    "duplicate_weight",
    "externality_ms",
    "eviction_ms",
    "fragile_ms",
    "savable_inflight",
    "overflow",
    "fleet_cost_ms",
)
_TTFT_COST = TTFT_TERM_NAMES.index("cost_ms")
_PREFILL = TTFT_TERM_NAMES.index("prefill_ms")
_QUEUE = TTFT_TERM_NAMES.index("queue_wait_ms")
_EXPECTED = TTFT_TERM_NAMES.index("expected_ttft_ms")
_STALE = TTFT_TERM_NAMES.index("stale_penalty_ms")
_UNCACHED = TTFT_TERM_NAMES.index("uncached_tokens")
_SPEED = TTFT_TERM_NAMES.index("prefill_tokens_per_s")
_SAVABLE = TERM_NAMES.index("savable_inflight")
_OVERFLOW = TERM_NAMES.index("overflow")
_FLEET_COST = TERM_NAMES.index("fleet_cost_ms")
#: A request whose expected TTFT is past this multiple of its TTFT SLO everywhere is overflow
#: (where its SLO is declared; ``overflow_ttft_ms`` otherwise): a prediction just past the SLO
#: is often wrong, and the request could still make it.
OVERFLOW_SLO_MULTIPLE = 1.25
#: Share of an overflow request's prefill kept as its cost where no savable request would wait
#: it out: between two such replicas, the one holding more of its prefix wins.
OVERFLOW_PREFILL_SHARE = 0.1


class ArrivalRate:
    """Requests per second routed by this plugin: a count decayed with time constant ``window_s``.

    ``rate = count / window`` once ``window_s`` has passed since the first request; before that,
    the count over the time elapsed so far (so a burst at start-up is not read as idle).
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._count = 0.0
        self._at: float | None = None
        self._first: float | None = None

    def tick(self, now: float) -> None:
        """One request arrived at ``now`` (monotonic seconds)."""
        self._decay(now)
        self._count += 1.0

    def _decay(self, now: float) -> None:
        if self._at is None:
            self._at = self._first = now
            return
        elapsed = now - self._at
        if elapsed > 0:
            self._count *= math.exp(-elapsed / self._window_s)
            self._at = now

    def rate(self, now: float) -> float:
        """Requests per second around ``now`` (0 before any request)."""
        if self._at is None or self._first is None:
            return 0.0
        self._decay(now)
        span = now - self._first
        # A decayed count over an exponential window of length w estimates rate × w; before the
        # window has filled, it counts only ``span`` seconds' worth.
        filled = self._window_s * (1.0 - math.exp(-span / self._window_s)) if span > 0 else 0.0
        return self._count / max(filled, 1e-3) if self._count > 0 else 0.0


class DecayedShare:
    """The share of recent decisions that were of one kind, recent meaning within ``window_s``.

    Two counts decayed together (every decision, and the marked ones), so their ratio is the
    recent share whatever the request rate; idle time alone does not change it.
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._all = 0.0
        self._marked = 0.0
        self._at: float | None = None

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            factor = math.exp(-(now - self._at) / self._window_s)
            self._all *= factor
            self._marked *= factor
        self._at = now if self._at is None else max(self._at, now)

    def share(self, now: float) -> float:
        """Marked decisions / all decisions, recently (0 before any)."""
        self._decay(now)
        return self._marked / self._all if self._all > 0 else 0.0

    def add(self, now: float, marked: bool) -> None:
        """Count one decision at ``now`` (monotonic seconds)."""
        self._decay(now)
        self._all += 1.0
        if marked:
            self._marked += 1.0


class RunningQuantile:
    """A running estimate of the ``quantile`` of a stream of positive values.

    Stochastic approximation in log space: each value moves the estimate up by ``step`` ×
    ``quantile`` when it is at or above it, down by ``step`` × (1 − ``quantile``) otherwise,
    so it settles where a share 1 − ``quantile`` of the values lie above it. O(1) per value
    and no history; at ``step`` 0.05 it follows a shifted distribution within a few hundred
    values, and wanders by a few per cent around a steady one.
    """

    def __init__(self, quantile: float, step: float = 0.05) -> None:
        if not 0 < quantile < 1:
            raise ValueError(f"quantile: must be in (0, 1) (got {quantile!r})")
        self._quantile = quantile
        self._step = step
        self._value: float | None = None

    @property
    def value(self) -> float | None:
        """The estimate (None before any value)."""
        return self._value

    def add(self, value: float) -> float:
        """Count one value; returns the new estimate."""
        if self._value is None:
            self._value = max(value, 1.0)  # below a millisecond, no TTFT is a scale
        else:
            above = 1.0 if value >= self._value else 0.0
            self._value *= math.exp(self._step * (above - (1.0 - self._quantile)))
        return self._value


class FleetCostScorer(ExpectedTtftScorer):
    """Scores replicas by own expected TTFT plus the delay the choice puts on everyone else."""

    type_name: ClassVar[str] = "fleet-cost"
    kind: ClassVar[PluginKind] = "scorer"
    needs_prefix: ClassVar[bool] = True
    prunable: ClassVar[bool] = True

    class Params(ExpectedTtftScorer.Params):
        """Parameters of ``fleet-cost`` (expected-ttft's, and the externality terms)."""

        #: Weight of duplicated prefill on an idle fleet (on top of its own TTFT share) ...
        duplicate_base: float = Field(default=0.0, ge=0.0)
        #: ... plus this per request waiting per replica (fleet mean).
        duplicate_per_queued: float = Field(default=2.0, ge=0.0)
        #: Queue depth (requests per replica, fleet mean) that costs nothing: the weight grows
        #: only with the depth beyond it.
        duplicate_free_depth: float = Field(default=0.5, ge=0.0)
        #: Weight of duplicated prefill that would overflow a full prefix cache (evicting
        #: someone's prefix) while the best-matched replica would still answer within the
        #: fleet's usual TTFT, ``slack_quantile`` below; the queue-depth weight applies when it
        #: is higher. 1: the duplicate counts once more, as the miss it causes later; 0: off.
        #: On by default since session 27: on Mooncake's synthetic trace it keeps 0.93-0.96 of
        #: the pooled hit rate at 1x-2x (0.87-0.92 without), and it changes no figure of the
        #: generated workloads (docs/policies/fleet-cost.md, *Stickiness while the holder has
        #: TTFT slack*) ...
        slack_duplicate_weight: float = Field(default=1.0, ge=0.0)
        #: ... the usual TTFT: this quantile of recent decisions' best expected TTFT.
        slack_quantile: float = Field(default=0.9, gt=0.0, lt=1.0)
        #: Ceiling on the duplicate weight (a pathological queue must not freeze all balance).
        max_duplicate_weight: float = Field(default=50.0, ge=0.0)
        #: Share of this prefill charged per decode running on a replica that prefills all the
        #: time (their TPOT stall), for a decode whose length is unknown; 0 turns the decode
        #: charge off ...
        decode_weight: float = Field(default=0.09, ge=0.0)
        #: ... and the prefill duty cycle (recent prefill ms per ms) up to which the decodes have
        #: TPOT slack and are not charged; the charge grows linearly from there to the
        #: decodes' weight at 1. None: charge every running decode its full weight.
        decode_free_duty: float | None = Field(default=0.4, ge=0.0, lt=1.0)
        #: A decode of N tokens spreads a prefill's stall over N steps: X ms of prefill adds
        #: X / N ms to its TPOT, worth ``decode_slo_ratio`` ms of a newcomer's TTFT (the TTFT
        #: SLO over the TPOT SLO, 2,000 / 50 ms). So a running decode that asked for N tokens
        #: (``max_tokens``) weighs ``min(decode_weight_max, decode_slo_ratio / N)``, and one that
        #: did not say weighs ``decode_weight`` (0.09: a few hundred tokens); the charge uses the
        #: mean weight of the requests in flight on the replica. None: every decode weighs
        #: ``decode_weight`` ...
        decode_slo_ratio: float | None = Field(default=40.0, gt=0.0)
        #: ... and no decode weighs more than this (the whole prefill: a decode is lost once).
        decode_weight_max: float = Field(default=1.0, gt=0.0)
        #: Charge only the running decodes that can still make their SLOs: a request sent where
        #: its expected TTFT was past ``overflow_ttft_ms`` (or as overflow) is late already,
        #: and stalling it costs no goodput. False: charge every running decode.
        decode_savable_only: bool = True
        #: Share of this prefill charged per request expected to arrive there during its wait.
        queue_weight: float = Field(default=0.0, ge=0.0)
        #: Share of this prefill charged per running decode while the replica's recent prefill
        #: duty cycle is below ``protect_duty`` (past it, those decodes are lost anyway) ...
        protect_weight: float = Field(default=0.0, ge=0.0)
        #: ... the duty cycle (recent prefill ms / window) at which decodes count as lost.
        protect_duty: float = Field(default=0.8, gt=0.0)
        #: Predicted TTFT (ms) that, on every replica, marks a request as lost wherever it goes
        #: (1.25 x the TTFT SLO: a prediction just past the SLO is often wrong, and the request
        #: could still make it). A lost request is placed where it stalls the fewest requests
        #: that can still make theirs, over the load bound if need be. None: off.
        overflow_ttft_ms: float | None = Field(default=2500.0, gt=0.0)
        #: Most of the recent decisions (over ``overflow_window_s``) that may be overflow ...
        overflow_max_share: float = Field(default=0.075, ge=0.0, le=1.0)
        #: ... and that window.
        overflow_window_s: float = Field(default=60.0, gt=0.0)
        #: Time constant of the arrival-rate estimate.
        rate_window_s: float = Field(default=5.0, gt=0.0)
        #: Share of their prefill time charged per cached token a prefill evicts beyond what it
        #: evicts on the roomiest equally matched candidate, before the age discount below: 1,
        #: an evicted prefix that comes back is prefilled again in full (0: off).
        evict_weight: float = Field(default=1.0, ge=0.0)
        #: Evicting content written ``s`` seconds ago is charged ``exp(-s / evict_horizon_s)`` of
        #: that: a prefix written moments ago is likely to come back (the burst that brought it
        #: goes on); one that has sat unused for longer has had its chance. At 3 s the term
        #: acts only where a cache turns over within seconds (small engines, bursts of new
        #: prefixes); 30 s cost goodput on the public traces (docs/policies/fleet-cost.md).
        evict_horizon_s: float = Field(default=3.0, gt=0.0)

        _gone = refuse_gone_keys(
            {
                "evict_threshold": (
                    "evict_threshold is gone: eviction_ms now counts the blocks a new prefix "
                    "evicts from each replica's prefix-cache fill, not a KV-usage threshold "
                    "(vLLM's usage gauge misses cached blocks no request holds). Remove it; "
                    "evict_weight (default 1; 0: off) and evict_horizon_s set the charge."
                )
            }
        )

        #: Cost (ms) of pushing one short decode past its TPOT SLO (about half the TTFT SLO: a
        #: newcomer may wait that much longer to spare one request its SLO). Charged to a
        #: prefill per request in flight on the replica that asked for so few tokens
        #: (``max_tokens``) that this prefill, shared out over its decode steps, would put it
        #: past ``fragile_tpot_ms``. 0: off.
        fragile_loss_ms: float = Field(default=1000.0, ge=0.0)
        #: The TPOT (ms) a short decode must keep.
        fragile_tpot_ms: float = Field(default=50.0, gt=0.0)
        #: Requests asking for more tokens than this are not tracked (a stall spreads thin).
        fragile_max_tokens: int = Field(default=64, ge=2)
        #: Expected queue wait (ms) ahead of this prefill at which the charge has fallen to 0: the
        #: short decodes queued there run during the prefills ahead of it, not during its own.
        #: None: it never falls.
        fragile_queue_ms: float | None = Field(default=1000.0, gt=0.0)

    params: Params

    def __init__(
        self,
        params: PluginParams | None = None,
        *,
        name: str | None = None,
        clock: Callable[[], float] = time.time,
        elapsed_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(params, name=name, clock=clock, elapsed_clock=elapsed_clock)
        self._arrivals = ArrivalRate(self.params.rate_window_s)
        self._overflow_share = DecayedShare(self.params.overflow_window_s)
        #: The fleet's usual TTFT: recent decisions' best expected TTFT, at ``slack_quantile``.
        self._usual_ttft = RunningQuantile(self.params.slack_quantile)
        #: Overflow requests in flight, by replica.
        self._overflow: Placements[None] = Placements(self.params.max_pending)
        #: Requests in flight sent where their expected TTFT was past ``overflow_ttft_ms``.
        self._late: Placements[None] = Placements(self.params.max_pending)
        #: Every request in flight, by replica: its decode weight (``decode_weight_of``).
        self._decode_weights: Placements[float] = Placements(self.params.max_pending)
        #: Short decodes in flight, by replica: their ``max_tokens`` and the TPOT they must keep.
        self._fragile: Placements[tuple[int, float]] = Placements(self.params.max_pending)
        #: Prefix-cache blocks written per replica (for ``eviction_ms``).
        self._fill = CacheFill()

    # ------------------------------------------------------------------ congestion

    def duplicate_weight(
        self, replicas: Sequence[ReplicaState], fleet: CandidatesSummary | None = None
    ) -> float:
        """Weight of duplicated prefill: base + per-queued × fleet-mean queue depth beyond the
        free depth, capped. ``fleet`` (every candidate, when the engine pruned) gives the mean;
        else ``replicas`` do."""
        p = self.params
        if fleet is not None:
            depth = fleet.mean_queued
        elif not replicas:
            return p.duplicate_base
        else:
            depth = sum(r.queued for r in replicas) / len(replicas)
        excess = depth - p.duplicate_free_depth if depth > p.duplicate_free_depth else 0.0
        return min(p.max_duplicate_weight, p.duplicate_base + p.duplicate_per_queued * excess)

    def decode_share(self, replica: ReplicaState, elapsed_now: float) -> float:
        """Share of a prefill on ``replica`` charged per running decode: the decodes' weight
        (``decode_weight``, or the mean by length of those in flight there), gated by the
        replica's prefill duty cycle."""
        p = self.params
        weight = p.decode_weight
        weights = self._decode_weights.on(replica.replica_id)
        if weights:
            weight = sum(weights) / len(weights)
        free = p.decode_free_duty
        if free is None:
            return weight
        window_ms = p.recent_prefill_window_s * 1000.0
        duty = self._recent.load_ms(replica.replica_id, elapsed_now) / window_ms
        return weight * max(0.0, duty - free) / (1.0 - free)

    def decode_weight_of(self, request: RoutingRequest) -> float:
        """What one decode of ``request`` weighs in the decode charge (see ``decode_slo_ratio``)."""
        p = self.params
        tokens = request.max_output_tokens
        if p.decode_slo_ratio is None or tokens is None or tokens <= 0:
            return p.decode_weight
        declared = None
        if request.ttft_slo_ms is not None and request.tpot_slo_ms is not None:
            declared = request.ttft_slo_ms / request.tpot_slo_ms
        return min(p.decode_weight_max, self._unless_set("decode_slo_ratio", declared) / tokens)

    def _unless_set(self, name: str, declared: float | None) -> float:
        """Parameter ``name`` where the policy sets it, else what the request's declared SLOs
        make of it (``declared``), else its default."""
        p = self.params
        if declared is None or name in p.model_fields_set:
            return getattr(p, name)
        return declared

    def overflow_limit_ms(self, request: RoutingRequest) -> float | None:
        """The expected TTFT past which ``request`` is late wherever it goes: ``overflow_ttft_ms``
        as set, else 1.25 x the TTFT SLO the request declares, else the default (1.25 x 2 s)."""
        if self.params.overflow_ttft_ms is None:
            return None  # off
        slo = request.ttft_slo_ms
        declared = None if slo is None else OVERFLOW_SLO_MULTIPLE * slo
        return self._unless_set("overflow_ttft_ms", declared)

    def fragile_tpot_of(self, request: RoutingRequest) -> float:
        """The TPOT a short decode of ``request`` must keep: ``fragile_tpot_ms`` as set, else the
        TPOT SLO the request declares, else the default (50 ms)."""
        return self._unless_set("fragile_tpot_ms", request.tpot_slo_ms)

    def savable_running(self, replica: ReplicaState) -> int:
        """Running decodes on ``replica`` that can still make their SLOs.

        Requests sent there late (expected TTFT past ``overflow_ttft_ms``) are late because of
        the queue, so they are counted against the queue first: only those beyond it run.
        """
        late_running = self._late.count(replica.replica_id) - replica.queued
        return max(0, replica.running_now - max(0, late_running))

    def _savable(self, replica: ReplicaState) -> int:
        """Requests in flight on ``replica`` that were not sent there as overflow (those can
        still make their SLOs)."""
        return max(0, replica.load - self._overflow.count(replica.replica_id))

    def on_request_start(self, request: RoutingRequest, replica: ReplicaId) -> None:
        """Calibration as in ``expected-ttft``; the request is counted on ``replica`` (once: a
        retry on a fallback moves it) as overflow, as late (its expected TTFT there was past
        ``overflow_ttft_ms``) and by its decode weight."""
        pending = self._pending.get(request.request_id)
        chosen = pending.terms.get(replica) if pending is not None else None
        limit = self.overflow_limit_ms(request)
        if request.overflow or (
            chosen is not None
            and limit is not None
            and chosen["expected_ttft_ms"] - chosen["stale_penalty_ms"] > limit
        ):
            self._late.place(request.request_id, replica, None)
        else:
            self._late.forget(request.request_id)  # a retry that is on time where it went now
        self._decode_weights.place(request.request_id, replica, self.decode_weight_of(request))
        super().on_request_start(request, replica)
        matches = request.prefix_matches
        cached = matches.get(replica, 0) * request.block_size if matches else 0
        self._fill.add(
            replica, request.prompt_tokens - cached, self._clock(), self._elapsed_clock()
        )
        if request.overflow:
            self._overflow.place(request.request_id, replica, None)
        p = self.params
        tokens = request.max_output_tokens
        if p.fragile_loss_ms > 0 and tokens is not None and 2 <= tokens <= p.fragile_max_tokens:
            budget = (tokens, self.fragile_tpot_of(request))
            self._fragile.place(request.request_id, replica, budget)

    def fragile_stalled(self, replica: ReplicaState, prefill_ms: float) -> int:
        """Short decodes in flight on ``replica`` that a prefill of ``prefill_ms`` would push
        past ``fragile_tpot_ms``: a decode of k tokens shares the stall over its k - 1 steps."""
        budgets = self._fragile.on(replica.replica_id)
        if not budgets or prefill_ms <= 0:
            return 0
        step = replica.decode_step_ms
        return sum(
            1 for tokens, tpot in budgets if prefill_ms > (tokens - 1) * max(1.0, tpot - step)
        )

    def on_request_complete(
        self,
        request: RoutingRequest,
        replica: ReplicaId,
        ttft_ms: float | None,
        cached_tokens: int | None,
        ok: bool,
    ) -> None:
        """Calibration as in ``expected-ttft``; the request leaves its replica's counts."""
        super().on_request_complete(request, replica, ttft_ms, cached_tokens, ok)
        self._overflow.forget(request.request_id)
        self._late.forget(request.request_id)
        self._decode_weights.forget(request.request_id)
        self._fragile.forget(request.request_id)

    @staticmethod
    def _overflow_costs(
        raw: dict[ReplicaId, tuple[float, ...]],
    ) -> dict[ReplicaId, tuple[float, ...]]:
        """Costs for a request that misses its TTFT SLO wherever it goes: the stall its prefill
        puts on the requests in flight there that can still make theirs.

        Its own TTFT no longer counts: it is late anywhere. What its prefill costs others does.
        Requests queued ahead of it start first (engines serve in arrival order), but each one
        decoding while it prefills waits its prefill out. Requests earlier sent as overflow are
        late already, so a replica that holds only those is free: lost requests gather on one
        replica and its queue grows, while the others keep theirs within the SLO. A tenth of the
        prefill is kept as a cost, so between two such replicas the one with the cached prefix
        wins.
        """
        return {
            rid: (
                *values[:_OVERFLOW],
                1.0,
                values[_PREFILL] * (values[_SAVABLE] + OVERFLOW_PREFILL_SHARE),
            )
            for rid, values in raw.items()
        }

    def _evicted_tokens(
        self,
        replicas: Sequence[ReplicaState],
        base: dict[ReplicaId, tuple[float, ...]],
        elapsed_now: float,
    ) -> dict[ReplicaId, float]:
        """Per replica, the cached tokens this request's prefill pushes out of its prefix cache
        beyond what it pushes out on the roomiest candidate that holds as much of its prompt.

        Compared only among replicas that hold the same share of the prompt: between a prefix
        holder and a replica without it, the extra prefill is what counts (``duplicate_ms``).
        The caller asks only while the fleet is not queueing, and evictions count by the age
        of what they evict (``evict_horizon_s``). All three limits are measured
        (docs/policies/fleet-cost.md, *Cache fill*): pushing requests off a full holder, or
        sending every new prompt to the one replica with room while queues build, lost 4-8
        points of goodput at 4x on Mooncake's conversation trace, and charging evictions of
        any age cost checks on its arXiv slice. Where every cache is full and turns over
        slowly it is 0. Replicas of unknown capacity are charged nothing.
        """
        if self.params.evict_weight <= 0:
            return {}
        horizon = self.params.evict_horizon_s
        evicts: dict[ReplicaId, tuple[float, float]] = {}
        for replica in replicas:
            room = self._fill.room_tokens(replica)
            if room is not None:
                uncached = base[replica.replica_id][_UNCACHED]
                evicted = max(0.0, uncached - room)
                if evicted > 0:
                    age = self._fill.tail_age_s(replica.replica_id, elapsed_now)
                    # Content no write of ours dates is charged nothing: nothing says it is
                    # recent.
                    evicted *= 0.0 if age is None else math.exp(-age / horizon)
                evicts[replica.replica_id] = (uncached, evicted)
        least: dict[float, float] = {}
        for uncached, n in evicts.values():
            least[uncached] = min(n, least.get(uncached, n))
        return {
            rid: n - least[uncached] for rid, (uncached, n) in evicts.items() if n > least[uncached]
        }

    def _slack_weight(
        self, base: dict[ReplicaId, tuple[float, ...]], least_uncached: float, weight: float
    ) -> float:
        """``slack_duplicate_weight`` while the best-matched replica answers within the fleet's
        usual TTFT, else 0; every decision updates the usual TTFT.

        Where the fleet does not queue, the duplicate weight is 0 and a busy holder loses the
        request to an idle replica for a few hundred ms of its TTFT; with smooth arrivals on
        Mooncake's conversation trace at 2x that cost 1 point of hit rate in 14. Where the
        duplicate lands in a full cache it evicts someone's prefix: a miss later. A holder that
        still answers within the usual TTFT keeps the request, so the TTFT it adds stays under
        the fleet's tail. The caller charges it only where the duplicate would evict: a cache
        with room takes it for idle compute alone (docs/policies/fleet-cost.md, *Stickiness
        while the holder has TTFT slack*).
        """
        p = self.params
        if p.slack_duplicate_weight <= 0:
            return 0.0
        usual = self._usual_ttft.add(min(values[_EXPECTED] for values in base.values()))
        if p.slack_duplicate_weight <= weight:
            return 0.0
        holder = min(
            values[_EXPECTED] for values in base.values() if values[_UNCACHED] == least_uncached
        )
        return p.slack_duplicate_weight if holder <= usual else 0.0

    def arrival_rate(self) -> float:
        """Requests per second this scorer has been asked to route, recently."""
        return self._arrivals.rate(self._elapsed_clock())

    # ------------------------------------------------------------------ scoring

    def score_with_terms(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> tuple[dict[ReplicaId, float], PluginTerms]:
        """``score`` plus every replica's cost terms; remembers them for calibration."""
        p = self.params
        now = self._clock()
        elapsed_now = self._elapsed_clock()
        self._arrivals.tick(elapsed_now)
        base: dict[ReplicaId, tuple[float, ...]] = {}
        cold_ours: set[ReplicaId] = set()
        for replica in replicas:
            values, cold_is_ours = self._terms(request, replica, now, elapsed_now)
            base[replica.replica_id] = values
            if cold_is_ours:
                cold_ours.add(replica.replica_id)
        if not base:
            terms = LazyTerms({}, TERM_NAMES)
            self._remember(request.request_id, _Pending(terms, cold_ours))
            return {}, terms

        least_uncached = min(values[_UNCACHED] for values in base.values())
        fleet = request.candidates
        weight = self.duplicate_weight(replicas, fleet)
        # Only on a fleet that is not queueing (see ``_evicted_tokens``).
        evicted = (
            self._evicted_tokens(replicas, base, elapsed_now) if weight <= p.duplicate_base else {}
        )
        slack = self._slack_weight(base, least_uncached, weight)
        window_ms = p.recent_prefill_window_s * 1000.0
        per_replica_rate = self._arrivals.rate(elapsed_now) / (
            fleet.count if fleet is not None else len(base)
        )
        raw: dict[ReplicaId, tuple[float, ...]] = {}
        for replica in replicas:
            values = base[replica.replica_id]
            prefill_ms = values[_PREFILL]
            # In tokens, at this replica's speed: replicas calibrated to different speeds must not
            # count a speed difference as duplicated work.
            duplicate_ms = (values[_UNCACHED] - least_uncached) / values[_SPEED] * 1000.0
            externality_ms = 0.0
            running = (
                self.savable_running(replica) if p.decode_savable_only else replica.running_now
            )
            if p.protect_weight > 0 and prefill_ms > 0 and running > 0:
                # The share of this prefill that lands while the replica's prefill duty cycle is
                # still below ``protect_duty``: past it, its decodes miss their TPOT anyway.
                duty = self._recent.load_ms(replica.replica_id, elapsed_now) / window_ms
                added = prefill_ms / window_ms
                cap = p.protect_duty
                below = max(0.0, min(duty + added, cap) - min(duty, cap)) / added
                externality_ms += p.protect_weight * running * prefill_ms * below
            if prefill_ms > 0:
                affected = 0.0
                if p.decode_weight > 0 and running > 0:
                    affected += self.decode_share(replica, elapsed_now) * running
                if p.queue_weight > 0:
                    wait_s = (values[_QUEUE] + prefill_ms) / 1000.0
                    affected += p.queue_weight * per_replica_rate * wait_s
                externality_ms += prefill_ms * affected
            eviction_ms = (
                p.evict_weight * evicted.get(replica.replica_id, 0.0) / values[_SPEED] * 1000.0
            )
            fragile_ms = 0.0
            if p.fragile_loss_ms > 0:
                fragile_ms = p.fragile_loss_ms * self.fragile_stalled(replica, prefill_ms)
                if p.fragile_queue_ms is not None:
                    fragile_ms *= max(0.0, 1.0 - values[_QUEUE] / p.fragile_queue_ms)
            replica_weight = weight
            if slack and duplicate_ms > 0:  # nonzero only above ``weight``
                room = self._fill.room_tokens(replica)
                if room is not None and room < values[_UNCACHED]:
                    replica_weight = slack
            total = (
                values[_TTFT_COST]
                + replica_weight * duplicate_ms
                + externality_ms
                + eviction_ms
                + fragile_ms
            )
            raw[replica.replica_id] = (
                *values,
                duplicate_ms,
                replica_weight,
                externality_ms,
                eviction_ms,
                fragile_ms,
                self._savable(replica),
                0.0,
                total,
            )
        overflow_ms = self.overflow_limit_ms(request)
        lost = (
            overflow_ms is not None
            and len(raw) > 1
            # Late by its predicted queue and prefill, not by distrust of old figures: with
            # every replica's /metrics unread for a minute, on-time requests on an idle fleet
            # went as overflow (the routing review, session 46).
            and min(values[_EXPECTED] - values[_STALE] for values in raw.values()) > overflow_ms
            and self._overflow_share.share(elapsed_now) < p.overflow_max_share
        )
        self._overflow_share.add(elapsed_now, lost)
        if lost:
            request.overflow = True
            raw = self._overflow_costs(raw)
        terms = LazyTerms(raw, TERM_NAMES)
        self._remember(request.request_id, _Pending(terms, cold_ours))
        floor = p.cost_floor_ms
        costs = {rid: values[_FLEET_COST] + floor for rid, values in raw.items()}
        return relative_scores(costs), terms


#: As in expected-ttft: near-equal costs within 1% count as ties.
TIE_TOLERANCE = 0.01


def profile() -> Profile:
    """The built-in ``fleet-cost`` profile: this scorer alone, picked by ``max-score``."""
    return Profile(
        name="fleet-cost",
        filters=(),
        scorers=((FleetCostScorer(), 1.0),),
        # A holder over the load bound whose queue is mostly its own cache hits is not passed
        # over: on Mooncake's synthetic trace (15-50k-token shared prompts) the request-count
        # bound alone duplicated multi-second prefills at 4x (docs/policies/fleet-cost.md). Nor
        # is one running the request's LoRA adapter: elsewhere it takes a scarce slot or waits
        # for one (b2b-lora: docs/policies/fleet-cost.md, *LoRA slots*).
        picker=MaxScorePicker(
            MaxScorePicker.Params(
                tie_tolerance=TIE_TOLERANCE, spare_cached_queues=True, spare_adapter_holders=True
            )
        ),
    )
