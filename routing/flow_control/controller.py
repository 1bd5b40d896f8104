"""SLO-aware admission: admit, queue or shed each request, by class, against predicted TTFT.

Pure logic on an injected clock (seconds) and no I/O: the gateway drives it with asyncio and the
real monotonic clock, ``fleetgate simulate`` with its virtual clock. Each caller routes first
and hands over the ``FleetEstimate`` of that decision, so flow control judges by the numbers
routing chose by.

* The fleet is **saturated** when every candidate is full, by what its engine reports: requests
  already waiting to start there (``saturation_backlog_requests``: vLLM's waiting queue, or this
  gateway's in-flight requests beyond what the engine last reported running), its KV cache
  nearly full (``saturation_kv_usage``), or its decodes already near the request's TPOT SLO (the
  engine's recent inter-token latency over ``saturation_itl_fraction`` of it: each new prefill
  shares its steps with them). Once at least half the candidates are full, a request that
  routing sent to one too slow by that last test (or, for a queue head about to be released, to
  one with its backlog already at the bound) counts the fleet as saturated: room elsewhere is
  not where it goes.
  Optional, off by default: a bound on the predicted queue wait (``saturation_queue_wait_ms``)
  or on the decode interference (``saturation_decode_interference_ms``) also marks a replica
  full. While most replicas have room, everything is admitted: nothing waits and nothing is
  shed below saturation. The predicted
  TTFT is not the saturation test because it is a model of the engine's queue that under- or
  overcounts it by workload; it is the test of whether a request can meet its SLO.
* **critical** is always admitted while a replica is up: it jumps the queue.
* **Critical steering** (``steer_critical``; the gateway and the simulator drive it through
  ``routing.flow_control.steer``). Routing does not read the engines' decode pace, and critical
  requests are never held, so a critical request routed to a replica whose decodes
  already run too slow for its TPOT (the inter-token test) would decode there at that pace.
  Unless it is already late there (its expected TTFT over its SLO), it is routed again among
  the replicas with room (``steer_candidates``: not full by any test), and goes to that choice
  if its expected TTFT there is no worse (``takes_steer``), so that no cached prefix or shorter
  queue is given up for it.
* **Calm steering** (``steer_when_calm``). A standard or sheddable request that would be held
  for the same reason (routing chose a replica decoding too slowly, and most of the fleet is
  full) while the fleet is calm (nothing queued, and nothing held for ``calm_window_s``) is
  routed again among the replicas with room, and admitted there if its expected TTFT meets its
  SLO. A burst on a quiet fleet (the opening seconds of traffic, a spike at light load) then
  goes to the idle replicas instead of waiting; sustained overload, where requests are held
  every few seconds, is held as before.
* **Protected critical decodes** (``protect_critical_decodes``, off by default). Each critical
  request in flight has a budget of prefill stall it can absorb and still meet its TPOT, spent
  by every prefill admitted to its replica after it (``DecodeGuard``). While decodes miss
  their TPOT (the inter-token bound below its start) and any replica is full, a standard or
  sheddable request whose prefill would overspend a budget on the replica routing chose waits,
  as if the fleet were saturated. Past saturation these stalls, not the
  mean inter-token latency, are what make critical requests miss; holding for them costs the
  other classes (docs/flow-control.md, *Protected critical decodes*, has both sides).
* The inter-token bound moves with what the decodes actually get: each request that finishes
  moves it (``tpot_target``). A TPOT miss tightens it, so that new work is held sooner and the
  running decodes get the steps; a met TPOT relaxes it, up to ``max_itl_fraction``. It settles
  where the share ``1 - tpot_target`` of requests miss their TPOT, wherever that is: a fleet
  whose decodes are slowed by the odd long prefill (most of them still meeting their TPOT) is
  not held back for it, and one whose decodes all crawl is held as soon as they do.
* **sheddable**, when saturated, is refused at once if its predicted TTFT is over its SLO; else
  it queues behind everything else.
* **standard**, when saturated, queues. A queued request leaves with a refusal when its wait
  passes ``max_queue_wait_ms`` or, by default, when it can no longer meet its TTFT SLO (its wait
  plus its predicted TTFT is over it): serving it late would only make the next ones late too.
* The queue holds at most ``max_queue_length``; a full queue makes room for a higher class by
  refusing its newest lowest-class entry, else refuses the newcomer.
* Refusals carry ``retry_after_s``: the predicted drain of the shortest engine queue, longer in
  proportion to how full the gateway queue is (a full one doubles it), and at least the time the
  gateway queue takes to empty at the pace it has been releasing requests; in whole seconds, 1
  to 60.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from routing.flow_control.classes import FlowRequest, RequestClass
from routing.flow_control.decode_guard import DecodeGuard
from routing.flow_control.estimate import FleetEstimate, ReplicaLoad
from routing.flow_control.queue import FairQueue, QueuedEntry
from routing.types import ReplicaId

__all__ = [
    "ITL_BOUND_STEP",
    "MAX_RETRY_AFTER_S",
    "Decision",
    "FlowControlSettings",
    "FlowController",
    "ShedReason",
    "Verdict",
]


class Decision(enum.StrEnum):
    """What happens to a request now."""

    ADMIT = "admit"
    QUEUE = "queue"
    SHED = "shed"


class ShedReason(enum.StrEnum):
    """Why a request was refused (a metric label and part of the client's error message)."""

    PREDICTED_TTFT_OVER_SLO = "predicted_ttft_over_slo"
    QUEUE_FULL = "queue_full"
    QUEUE_WAIT_EXCEEDED = "queue_wait_exceeded"
    SLO_UNREACHABLE = "slo_unreachable"
    TOKEN_BUDGET = "token_budget"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The decision on one request, why, and (for a refusal) when to retry."""

    decision: Decision
    reason: str
    retry_after_s: float = 0.0
    #: Seconds the request spent in the gateway queue (0 if never queued).
    waited_s: float = 0.0

    @property
    def shed_reason(self) -> ShedReason | None:
        """The refusal's reason, when this is a refusal."""
        return ShedReason(self.reason) if self.decision is Decision.SHED else None


@dataclass(frozen=True)
class FlowControlSettings:
    """The knobs of flow control (the YAML ``flow_control:`` section); checked on construction."""

    enabled: bool = True
    #: A replica is full when this many requests wait to start there (engine-reported, or sent
    #: by this gateway and not yet running). Once at least half the fleet is full, a queue head
    #: routed to a replica full by this test is not released there (*Releasing the queue*) ...
    saturation_backlog_requests: int = 2
    #: ... or its KV cache usage is at least this fraction. Saturated = every replica full.
    saturation_kv_usage: float = 0.92
    #: Optional: also full when its predicted queue wait is over this (ms; None: not used) ...
    saturation_queue_wait_ms: float | None = None
    #: ... or its decode interference is (ms; None: not used).
    saturation_decode_interference_ms: float | None = None
    #: ... or its engine's recent inter-token latency is over this fraction of the request's
    #: TPOT SLO: its decodes already run near the SLO, and each new prefill slows them more
    #: (None: not used; requests without a TPOT SLO are not judged by it). When at least half
    #: the replicas are full, a request routed to one too slow by this test waits, whatever the
    #: others.
    #: This is where the bound starts: ``tpot_target`` moves it.
    saturation_itl_fraction: float | None = 0.8
    #: Requests the gateway queue holds (all classes together).
    max_queue_length: int = 1000
    #: Longest a request may wait in the queue (ms); None: until it can no longer meet its SLO.
    max_queue_wait_ms: float | None = None
    #: Saturated or not, a request whose predicted TTFT is at most this fraction of its SLO is
    #: admitted (unless others of its class or higher wait): holding a request that would meet
    #: its SLO now only spends its slack. None: saturation alone decides.
    admit_within_slo_fraction: float | None = None
    #: Share of requests (every class) that should meet their TPOT SLO. Each request that
    #: finishes moves the inter-token bound (``saturation_itl_fraction``): a TPOT miss lowers
    #: it by ``ITL_BOUND_STEP``, a TPOT met raises it by that step × (1 - target) / target, so
    #: that it settles where about 1 - target of them miss. None: the bound stays where it is
    #: set.
    tpot_target: float | None = 0.97
    #: The lowest the inter-token bound goes (a fraction of the TPOT SLO) ...
    min_itl_fraction: float = 0.5
    #: ... and the highest: at 1.0 a replica whose decodes already miss the SLO is full.
    max_itl_fraction: float = 1.0
    #: While decodes miss their TPOT and any replica is full, hold a standard or sheddable
    #: request whose prefill would push a critical decode in flight on its chosen replica past
    #: its TPOT SLO (``DecodeGuard``).
    protect_critical_decodes: bool = False
    #: A critical request routed to a replica whose decodes run too slow for its TPOT SLO is
    #: routed again among the replicas with room, and goes there when its expected TTFT is no
    #: worse (``FlowController.steer_candidates``, ``takes_steer``).
    steer_critical: bool = True
    #: A standard or sheddable request that would be held because routing chose a replica
    #: decoding too slowly while most of the fleet is full is routed again among the replicas
    #: with room, and admitted there if its expected TTFT meets its SLO, while the fleet is calm:
    #: nothing queued and nothing held for ``calm_window_s``.
    steer_when_calm: bool = True
    #: Seconds without a request held after which the fleet counts as calm again.
    calm_window_s: float = 5.0
    #: Once at least half the fleet is full, a queue head routed to a replica with
    #: ``saturation_backlog_requests`` or more already waiting is not released there; when that
    #: is all that holds it, it goes to an idle replica if what it waited plus its expected TTFT
    #: there meets its SLO. False: released whenever any replica has room (docs/flow-control.md,
    #: *Releasing the queue*).
    hold_for_backlog: bool = True

    def __post_init__(self) -> None:
        backlog = self.saturation_backlog_requests
        if backlog < 1:
            raise ValueError(f"saturation_backlog_requests: must be >= 1 (got {backlog})")
        if not 0 < self.saturation_kv_usage <= 1:
            raise ValueError(
                f"saturation_kv_usage: must be in (0, 1] (got {self.saturation_kv_usage!r})"
            )
        bound = self.saturation_queue_wait_ms
        if bound is not None and not (bound >= 0 and math.isfinite(bound)):
            raise ValueError(f"saturation_queue_wait_ms: must be >= 0 (got {bound!r})")
        interference = self.saturation_decode_interference_ms
        if interference is not None and not (interference >= 0 and math.isfinite(interference)):
            raise ValueError(
                f"saturation_decode_interference_ms: must be >= 0 (got {interference!r})"
            )
        itl = self.saturation_itl_fraction
        if itl is not None and not (itl > 0 and math.isfinite(itl)):
            raise ValueError(f"saturation_itl_fraction: must be > 0 (got {itl!r})")
        if not (self.calm_window_s >= 0 and math.isfinite(self.calm_window_s)):
            raise ValueError(f"calm_window_s: must be >= 0 (got {self.calm_window_s!r})")
        if self.max_queue_length < 0:
            raise ValueError(f"max_queue_length: must be >= 0 (got {self.max_queue_length})")
        if self.max_queue_wait_ms is not None and not self.max_queue_wait_ms > 0:
            raise ValueError(f"max_queue_wait_ms: must be > 0 (got {self.max_queue_wait_ms!r})")
        fraction = self.admit_within_slo_fraction
        if fraction is not None and not (0 < fraction <= 1):
            raise ValueError(f"admit_within_slo_fraction: must be in (0, 1] (got {fraction!r})")
        target = self.tpot_target
        if target is not None and not (0 < target < 1):
            raise ValueError(f"tpot_target: must be in (0, 1) (got {target!r})")
        lowest, highest = self.min_itl_fraction, self.max_itl_fraction
        if not (lowest > 0 and math.isfinite(lowest)):
            raise ValueError(f"min_itl_fraction: must be > 0 (got {lowest!r})")
        if not (highest >= lowest and math.isfinite(highest)):
            raise ValueError(
                f"max_itl_fraction: must be >= min_itl_fraction ({lowest!r}) (got {highest!r})"
            )


#: How far one TPOT miss lowers the inter-token bound (a fraction of the SLO): ten misses in a
#: row take it from 0.8 to 0.6, and at a 97% target about 32 met bring one step back.
ITL_BOUND_STEP = 0.02

#: Releases from the queue whose pace ``retry_after_s`` reads ...
RELEASE_HISTORY = 32
#: ... and the longest hint it gives (clients honour no more: the openai client's cap is 60 s).
MAX_RETRY_AFTER_S = 60.0
#: Finishes older than this say nothing of the fleet's pace now (``_finish_rate``).
FINISH_WINDOW_S = 10.0

_ADMIT_IDLE = Verdict(Decision.ADMIT, "not_saturated")
_ADMIT_CRITICAL = Verdict(Decision.ADMIT, "critical")
_ADMIT_OFF = Verdict(Decision.ADMIT, "flow_control_off")
_ADMIT_UNKNOWN = Verdict(Decision.ADMIT, "no_estimate")
_ADMIT_WITHIN_SLO = Verdict(Decision.ADMIT, "within_slo")
_ADMIT_OVER_CONTEXT = Verdict(Decision.ADMIT, "fits_no_replica")
#: Why a request waits when its prefill would push a protected critical decode past its TPOT.
_PROTECTING = "protecting_critical_decode"


class FlowController:
    """Admission decisions and the gateway queue for one gateway process (or one simulation)."""

    def __init__(self, settings: FlowControlSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self._clock = clock
        self.queue = FairQueue()
        #: Requests refused while queued, for the driver to answer (evicted to make room).
        self._evicted: list[tuple[FlowRequest, Verdict]] = []
        #: Latest known shortest queue wait, for Retry-After on refusals without an estimate.
        self._last_min_wait_ms = 0.0
        #: When the latest requests left the queue, admitted or refused or gone (the pace a
        #: request's place in it advances at, which ``retry_after_s`` reads).
        self._releases: deque[float] = deque(maxlen=RELEASE_HISTORY)
        #: When the latest admitted requests finished while the fleet was saturated (something
        #: queued, or held lately): the pace the queue will drain at before it has released any
        #: (a new spell of saturation).
        self._finishes: deque[float] = deque(maxlen=RELEASE_HISTORY)
        #: How far TPOT misses have lowered the inter-token bound from where it starts
        #: (negative: met TPOTs have raised it).
        self._itl_lowered = 0.0
        #: The critical decodes in flight and the stall each can still absorb.
        self.guard = DecodeGuard()
        #: When a request of each pool was last held (queued); a pool is calm ``calm_window_s``
        #: after.
        self._last_hold_s: dict[str, float] = {}

    def now(self) -> float:
        """The controller's clock (arrival times of ``FlowRequest`` are on it)."""
        return self._clock()

    # ------------------------------------------------------------------ arrivals

    def admit(self, request: FlowRequest, estimate: FleetEstimate) -> Verdict:
        """Decide a new request: admit it, queue it, or refuse it."""
        settings = self.settings
        if not settings.enabled:
            return _ADMIT_OFF
        if request.fits_no_replica:
            # The engine's 400 ("maximum context length") comes at once and costs no prefill.
            # Held, it waited for nothing; shed, its client got a 429 and retried it forever.
            return _ADMIT_OVER_CONTEXT
        if request.request_class is RequestClass.CRITICAL:
            return self._admitted(request, estimate, _ADMIT_CRITICAL)
        self._remember(estimate)
        ahead = self.queue.waiting_at_or_above(request.request_class, request.pool)
        protecting = self._endangers(estimate, request)
        if not ahead and not protecting:
            if estimate.min_queue_wait_ms is None:
                return self._admitted(request, estimate, _ADMIT_UNKNOWN)
            if not self._saturated(estimate, request):
                return self._admitted(request, estimate, _ADMIT_IDLE)
            if self._within_slo(request, estimate):
                return self._admitted(request, estimate, _ADMIT_WITHIN_SLO)
        if (
            request.request_class is RequestClass.SHEDDABLE
            and estimate.predicted_ttft_ms is not None
            and estimate.predicted_ttft_ms + self._gateway_wait_ms(self._overtaking(request))
            > request.ttft_slo_ms
        ):
            return self._refusal(ShedReason.PREDICTED_TTFT_OVER_SLO, 0.0)
        if len(self.queue) >= settings.max_queue_length:
            victim = self.queue.newest_below(request.request_class)
            if victim is None:
                return self._refusal(ShedReason.QUEUE_FULL, 0.0)
            self.queue.remove(victim.request.request_id)
            self._releases.append(self._clock())
            self._evicted.append(
                (victim.request, self._refusal(ShedReason.QUEUE_FULL, self._waited(victim.request)))
            )
        if not self.queue:
            # A new spell of saturation: the pace the last one drained at says nothing of this
            # one (kept, an hour-old burst made the first hints 60 s).
            self._releases.clear()
        self.queue.push(request, estimate.predicted_ttft_ms)
        self._last_hold_s[request.pool] = self._clock()
        return Verdict(Decision.QUEUE, _PROTECTING if protecting else "saturated")

    def steer_candidates(
        self, request: FlowRequest, estimate: FleetEstimate
    ) -> frozenset[ReplicaId] | None:
        """The replicas to route a request again among, or None to keep routing's choice: those
        with room by every test of ``_full``, when routing chose one whose decodes run too slow
        for the request's TPOT SLO (the inter-token test) and some have. The caller routes again
        among them and keeps the new choice only if ``takes_steer``.

        * A critical request (``steer_critical``) is steered whenever that happens: it is never
          held, so it would decode at that pace.
        * A standard or sheddable one (``steer_when_calm``) only when it would otherwise be held
          (``_saturated``) on a calm fleet: nothing queued, nothing held for ``calm_window_s``.
          Holding it then only waits out a passing burst while replicas sit idle (rag at 0.5x
          held requests for 67 ms at start-up); in sustained overload, where something is held
          every few seconds, holding is what protects the decodes.

        A request whose expected TTFT at routing's choice is already over its SLO stays: it is
        late wherever it goes, and its prefill (long, to be that late) would slow the decodes of
        a replica that still has room. Steering those cost the conversation trace at 4x five
        points of goodput (docs/flow-control.md, *Critical steering*).
        """
        settings = self.settings
        if (
            not settings.enabled
            or estimate.predicted_ttft_ms is None
            or estimate.predicted_ttft_ms > request.ttft_slo_ms
            or not self._too_slow(estimate.chosen_decode_itl_ms, request)
        ):
            return None
        if request.request_class is RequestClass.CRITICAL:
            if not settings.steer_critical:
                return None
        elif not (
            settings.steer_when_calm
            and self._calm(request.pool)
            and self._saturated(estimate, request)
        ):
            return None
        return self._room_elsewhere(estimate, request) or None

    def takes_steer(
        self, request: FlowRequest, estimate: FleetEstimate, steered: FleetEstimate
    ) -> bool:
        """Whether the decision among the replicas with room replaces routing's first one.

        A critical request moves only if its expected TTFT there is no worse. A worse one means
        giving up a cached prefix or a shorter queue, and past saturation the prefill it adds
        costs the fleet more than the decode pace it saves (docs/flow-control.md, *Critical
        steering*). A standard or sheddable one would otherwise wait: it moves if its expected
        TTFT there meets its SLO.
        """
        first, then = estimate.predicted_ttft_ms, steered.predicted_ttft_ms
        if first is None or then is None:
            return False
        if request.request_class is RequestClass.CRITICAL:
            return then <= first
        return then <= request.ttft_slo_ms

    def head_steer_candidates(
        self, request: FlowRequest, estimate: FleetEstimate
    ) -> frozenset[ReplicaId] | None:
        """For a queue head about to be judged: the idle replicas (nothing running, nothing
        waiting) to route it again among, when the one thing that would hold it is its chosen
        replica's backlog (at least half the fleet full, routing's choice at the backlog bound,
        its decodes not too slow); None otherwise. Not every replica with room: there a cold
        prefill slows the running decodes (multi-turn lost 7-11 points of goodput).
        Released onto the backlogged replica, the queue flooded it while one with room stayed
        free; held for it, the whole queue waited behind the head while replicas sat idle (two
        live reviews). The caller routes again among them and releases the head there if
        ``takes_head_steer``; otherwise it waits for its replica as before."""
        if (
            not self.settings.enabled
            or not self.settings.hold_for_backlog
            or estimate.predicted_ttft_ms is None
            or not self._chosen_backlogged(estimate)
            or self._endangers(estimate, request)
            or self._saturated(estimate, request)  # held whatever the backlog: all full, or slow
            or not self._saturated(estimate, request, releasing=True)
            # admitted where it is anyway (``admit_within_slo_fraction``)
            or self._within_slo(request, estimate, self._waited(request))
        ):
            return None
        # Idle and not full by another test (e.g. its KV cache full of another's blocks: held
        # again there, it was counted as steered at every pump).
        return self._room_elsewhere(estimate, request, idle_only=True) or None

    def takes_head_steer(self, request: FlowRequest, steered: FleetEstimate) -> bool:
        """Whether a queue head goes to the decision among the idle replicas: if what it
        waited plus its expected TTFT there meets its SLO. Otherwise it waits for its own
        replica (a cached prefix, a shorter prefill), until its SLO can no longer be met."""
        then = steered.predicted_ttft_ms
        if then is None:
            return False
        return self._waited(request) * 1000.0 + then <= request.ttft_slo_ms

    # ------------------------------------------------------------------ the queue

    def pools(self) -> list[str]:
        """The pools with requests queued, the one whose head goes first first."""
        return self.queue.pools()

    def head(self, pool: str | None = None) -> FlowRequest | None:
        """The queued request of ``pool`` to judge next (highest class, fairest tenant), if any;
        with no pool, the head of the pool that goes first."""
        entry = self.queue.head(pool)
        return entry.request if entry is not None else None

    def judge_head(self, estimate: FleetEstimate, pool: str | None = None) -> Verdict:
        """Judge ``pool``'s head (as ``head``) again on a fresh estimate of its own pool: admit
        (dequeued), keep waiting, or refuse."""
        entry = self.queue.head(pool)
        if entry is None:
            raise IndexError("the queue is empty")
        pool = entry.request.pool
        self._remember(estimate)
        entry.predicted_ttft_ms = estimate.predicted_ttft_ms
        waited = self._waited(entry.request)
        request = entry.request
        protecting = self._endangers(estimate, request)
        if not protecting and (
            estimate.min_queue_wait_ms is None
            or not self._saturated(estimate, request, releasing=True)
        ):
            self.queue.pop_head(pool)
            self._releases.append(self._clock())
            return self._admitted(
                request, estimate, Verdict(Decision.ADMIT, "capacity_freed", waited_s=waited)
            )
        if not protecting and self._within_slo(request, estimate, waited):
            self.queue.pop_head(pool)
            self._releases.append(self._clock())
            return self._admitted(
                request,
                estimate,
                Verdict(Decision.ADMIT, _ADMIT_WITHIN_SLO.reason, waited_s=waited),
            )
        reason = self._expired(entry)
        if reason is not None:
            self.queue.pop_head(pool)
            self._releases.append(self._clock())
            return self._refusal(reason, waited)
        return Verdict(Decision.QUEUE, _PROTECTING if protecting else "saturated", waited_s=waited)

    def expire(self) -> list[tuple[FlowRequest, Verdict]]:
        """Refuse every queued request whose wait ran out (and any evicted): the driver answers."""
        refused, self._evicted = self._evicted, []
        for entry in self.queue.entries():
            reason = self._expired(entry)
            if reason is not None:
                self.queue.remove(entry.request.request_id)
                self._releases.append(self._clock())
                refused.append((entry.request, self._refusal(reason, self._waited(entry.request))))
        return refused

    def next_deadline_s(self) -> float | None:
        """The earliest clock time at which a queued request's wait runs out."""
        deadlines = [self._deadline_s(e) for e in self.queue.entries()]
        return min(deadlines) if deadlines else None

    def request_finished(self, request_id: str) -> None:
        """An admitted request ended (served, failed or cancelled): its decode needs no
        protection any more, and the fleet's pace of finishing moves."""
        self.guard.finished(request_id)
        now = self._clock()
        if self.queue or any(now - at <= FINISH_WINDOW_S for at in self._last_hold_s.values()):
            # Only while the fleet is saturated does its pace of finishing say how fast it can
            # go: before that it says how little was asked of it.
            self._finishes.append(now)

    def cancel(self, request_id: str) -> bool:
        """The client went away: leave the queue at once. False if it was not queued."""
        if self.queue.remove(request_id) is None:
            return False
        self._releases.append(self._clock())
        return True

    @property
    def itl_fraction(self) -> float | None:
        """The inter-token bound in force: ``saturation_itl_fraction``, moved by finished
        requests' TPOTs within [``min_itl_fraction``, ``max_itl_fraction``]; None when not
        used."""
        start = self.settings.saturation_itl_fraction
        if start is None:
            return None
        lowest, highest = self._itl_range(start)
        return min(highest, max(lowest, start - self._itl_lowered))

    def observe_finished(self, tpot_ms: float | None, tpot_slo_ms: float | None) -> None:
        """A request finished with this TPOT: it moves the inter-token bound (``tpot_target``).
        One without a TPOT or a TPOT SLO changes nothing."""
        settings = self.settings
        target = settings.tpot_target
        start = settings.saturation_itl_fraction
        if target is None or start is None or tpot_ms is None or tpot_slo_ms is None:
            return
        lowest, highest = self._itl_range(start)
        # Clamped first, so that a bound held at an end moves at once when the tide turns.
        lowered = min(start - lowest, max(start - highest, self._itl_lowered))
        if tpot_ms > tpot_slo_ms:
            lowered += ITL_BOUND_STEP
        else:
            lowered -= ITL_BOUND_STEP * (1.0 - target) / target
        self._itl_lowered = min(start - lowest, max(start - highest, lowered))

    def _itl_range(self, start: float) -> tuple[float, float]:
        """Where the inter-token bound may go; a start outside the range widens it."""
        settings = self.settings
        return min(start, settings.min_itl_fraction), max(start, settings.max_itl_fraction)

    # ------------------------------------------------------------------ helpers

    def _within_slo(
        self, request: FlowRequest, estimate: FleetEstimate, waited_s: float = 0.0
    ) -> bool:
        """Its predicted TTFT, after what it already waited, leaves the configured headroom."""
        fraction = self.settings.admit_within_slo_fraction
        ttft = estimate.predicted_ttft_ms
        if fraction is None or ttft is None:
            return False
        return waited_s * 1000.0 + ttft <= fraction * request.ttft_slo_ms

    def _admitted(self, request: FlowRequest, estimate: FleetEstimate, verdict: Verdict) -> Verdict:
        """Book an admission with the decode guard: its prefill spends the budgets of the
        critical decodes on its replica, and a critical request's own decode gets one."""
        if self.settings.protect_critical_decodes:
            self.guard.admitted(
                request.request_id,
                estimate.chosen_replica,
                estimate.chosen_prefill_ms,
                self._clock(),
                protect=request.request_class is RequestClass.CRITICAL,
                output_tokens=request.max_output_tokens,
                tpot_slo_ms=request.tpot_slo_ms,
                ttft_slo_ms=request.ttft_slo_ms,
                decode_itl_ms=estimate.chosen_decode_itl_ms,
            )
        return verdict

    def _endangers(self, estimate: FleetEstimate, request: FlowRequest) -> bool:
        """True when ``request`` (not critical) would push a protected decode on the chosen
        replica past its TPOT, while decodes miss their TPOT (the inter-token bound is below
        where it starts) and some replica is full. Otherwise holding work for one decode would
        only turn the queue into waits: at ordinary load, and where decodes keep pace."""
        return (
            self.settings.protect_critical_decodes
            and request.request_class is not RequestClass.CRITICAL
            and self._decodes_behind()
            and self.guard.endangers(
                estimate.chosen_replica, estimate.chosen_prefill_ms, self._clock()
            )
            and any(self._full(load, request) for load in estimate.loads)
        )

    def _decodes_behind(self) -> bool:
        """Finished requests have missed their TPOT more often than ``tpot_target`` allows:
        the inter-token bound has moved below where it starts. Always, when the bound does not
        move (no ``tpot_target``)."""
        start = self.settings.saturation_itl_fraction
        bound = self.itl_fraction
        if start is None or bound is None or self.settings.tpot_target is None:
            return True
        return bound < start

    def _calm(self, pool: str) -> bool:
        """Nothing of ``pool`` queued, and nothing of it held for ``calm_window_s``."""
        held_s = self._last_hold_s.get(pool, -math.inf)
        return (
            self.queue.head(pool) is None and self._clock() - held_s >= self.settings.calm_window_s
        )

    def _saturated(
        self, estimate: FleetEstimate, request: FlowRequest, releasing: bool = False
    ) -> bool:
        loads = estimate.loads
        if not loads:
            return False
        if not (
            self._too_slow(estimate.chosen_decode_itl_ms, request)
            or (releasing and self.settings.hold_for_backlog and self._chosen_backlogged(estimate))
        ):
            return all(self._full(load, request) for load in loads)  # stops at the first room
        # Routing chose a replica whose decodes already run too slow (it does not read the
        # engines' pace), or, for a queue head, one where requests already wait to start (its
        # cache affinity outweighed that queue): once at least half the fleet is full, room
        # elsewhere is room this request would not get. Judged by "any replica has room"
        # alone, the queue drained onto full replicas while one with room stayed free (a live
        # review); ``head_steer_candidates`` offers such a head the idle replicas. A new
        # arrival with nothing queued ahead is left to the room test: held there, light-load
        # bursts waited in the gateway (docs/flow-control.md, *Releasing the queue*). With
        # most replicas free, a slow or backlogged one is a passing state: admit.
        return 2 * sum(self._full(load, request) for load in loads) >= len(loads)

    def _room_elsewhere(
        self, estimate: FleetEstimate, request: FlowRequest, idle_only: bool = False
    ) -> frozenset[ReplicaId]:
        """The replicas other than routing's choice with room for ``request`` by every test of
        ``_full`` (and, ``idle_only``, running nothing and with nothing waiting)."""
        return frozenset(
            load.replica
            for load in estimate.loads
            if load.replica is not None
            and load.replica != estimate.chosen_replica
            and (load.idle or not idle_only)
            and not self._full(load, request)
        )

    def _chosen_backlogged(self, estimate: FleetEstimate) -> bool:
        """True when ``saturation_backlog_requests`` or more requests already wait to start on
        the replica routing chose (the backlog test of ``_full``)."""
        bound = self.settings.saturation_backlog_requests
        chosen = estimate.chosen_replica
        return chosen is not None and any(
            load.replica == chosen
            and load.backlog_requests is not None
            and load.backlog_requests >= bound
            for load in estimate.loads
        )

    def _too_slow(self, itl_ms: float | None, request: FlowRequest) -> bool:
        """True when decodes at ``itl_ms`` leave no headroom under ``request``'s TPOT SLO."""
        fraction = self.itl_fraction
        return (
            fraction is not None
            and request.tpot_slo_ms is not None
            and itl_ms is not None
            and itl_ms > fraction * request.tpot_slo_ms
        )

    def _full(self, load: ReplicaLoad, request: FlowRequest) -> bool:
        """True when ``load``'s replica has no room for ``request`` to start at once."""
        settings = self.settings
        if self._too_slow(load.decode_itl_ms, request):
            return True
        if (
            load.backlog_requests is not None
            and load.backlog_requests >= settings.saturation_backlog_requests
        ):
            return True
        if load.kv_usage is not None and load.kv_usage >= settings.saturation_kv_usage:
            return True
        wait_bound = settings.saturation_queue_wait_ms
        if wait_bound is not None and load.queue_wait_ms > wait_bound:
            return True
        interference_bound = settings.saturation_decode_interference_ms
        return interference_bound is not None and load.decode_interference_ms > interference_bound

    def _remember(self, estimate: FleetEstimate) -> None:
        if estimate.min_queue_wait_ms is not None:
            self._last_min_wait_ms = estimate.min_queue_wait_ms

    def _waited(self, request: FlowRequest) -> float:
        """Seconds since ``request`` arrived (what it has waited in the queue, if queued)."""
        return max(0.0, self._clock() - request.arrival_s)

    def _deadline_s(self, entry: QueuedEntry) -> float:
        request = entry.request
        limit_ms = self.settings.max_queue_wait_ms
        if limit_ms is None:
            limit_ms = request.ttft_slo_ms - (entry.predicted_ttft_ms or 0.0)
        return request.arrival_s + max(0.0, limit_ms) / 1000.0

    def _expired(self, entry: QueuedEntry) -> ShedReason | None:
        if self._clock() < self._deadline_s(entry):
            return None
        if self.settings.max_queue_wait_ms is not None:
            return ShedReason.QUEUE_WAIT_EXCEEDED
        return ShedReason.SLO_UNREACHABLE

    def _refusal(self, reason: ShedReason, waited_s: float) -> Verdict:
        return Verdict(Decision.SHED, reason.value, self.retry_after_s(), waited_s)

    def retry_after_s(self) -> float:
        """Predicted time until a retry would be admitted (whole seconds, 1 to
        ``MAX_RETRY_AFTER_S``): the predicted drain of the shortest engine queue, longer in
        proportion to how full the gateway queue is (a full one doubles it), and at least the
        time the gateway queue takes to empty at the pace it has been releasing requests. While
        the gateway holds the work the engines' queues stay short: read alone, they said 1 s to
        clients that waited 20 s, and the openai client's retries came back at once, twice."""
        queued = len(self.queue)
        fill = queued / max(1, self.settings.max_queue_length)
        drain_ms = self._last_min_wait_ms * (1.0 + min(1.0, fill))
        drain_ms = max(drain_ms, self._gateway_wait_ms(queued))
        return min(MAX_RETRY_AFTER_S, max(1.0, math.ceil(drain_ms / 1000.0)))

    def _overtaking(self, request: FlowRequest) -> int:
        """Queued requests of a sheddable ``request``'s pool sure to leave before it: the
        standard ones (strict priority; critical ones are never held). Other sheddable ones are
        left out: fair queuing may put it before another tenant's, and they may be refused
        rather than served."""
        return self.queue.waiting_at_or_above(RequestClass.STANDARD, request.pool)

    def _gateway_wait_ms(self, ahead: int) -> float:
        """The least a request behind ``ahead`` queued ones waits in the gateway queue: they
        leave at the pace requests have been leaving it (admitted, or refused once they could
        no longer make their SLO), or, before any has (a burst that just began), at the pace the
        fleet has been finishing them, each finish making room for one. A lower bound: a higher
        class arriving later overtakes."""
        if not ahead:
            return 0.0
        pace = self._release_rate() or self._finish_rate()
        return ahead / pace * 1000.0 if pace else 0.0

    def _finish_rate(self) -> float | None:
        """Admitted requests finished per second, while saturated, over the latest ones of the
        last ``FINISH_WINDOW_S``; None: too few."""
        horizon = self._clock() - FINISH_WINDOW_S
        recent = [t for t in self._finishes if t >= horizon]
        if len(recent) < 2 or recent[-1] <= recent[0]:
            return None
        return (len(recent) - 1) / (recent[-1] - recent[0])

    def _release_rate(self) -> float | None:
        """Requests leaving the queue per second, over the latest ones and up to now (so a
        queue that stopped moving reads as slow); None: too few."""
        if len(self._releases) < 2:
            return None
        span = self._clock() - self._releases[0]
        return (len(self._releases) - 1) / span if span > 0 else None
