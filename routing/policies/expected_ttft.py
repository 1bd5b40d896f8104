"""``expected-ttft`` policy: send each request where its first token is expected soonest.

For every candidate replica the scorer estimates, in milliseconds::

    expected_ttft_ms = queue_wait_ms                # prefill work still queued + decode contention
                     + prefill_ms                   # uncached prompt tokens / prefill speed
                     + adapter_cold_load_ms         # loading the LoRA adapter if not resident
                     + adapter_slot_wait_ms         # waiting for a GPU LoRA slot to free
                     + kv_penalty_ms                # steep as KV usage nears preemption
                     + stale_penalty_ms             # distrust of load figures that are old

adds ``decode_interference_ms`` (the replica's recent prefill duty cycle, which its running
decodes pay in TPOT) to get the cost, and scores ``(best + floor) / (cost + floor)`` (1.0 for the
cheapest). The ``max-score`` picker then takes the best under a bounded-load guard, with
near-equal costs (within 1% in the built-in profile) taken in turns, least recently chosen first,
so a hot shared prefix spreads over several replicas instead of piling onto the one that cached it.

The queue is the prefill work this gateway sent to the replica, drained at the prefill speed as
time passes (``backlog.py``) and capped by the gateway's in-flight counter. Prefill speed starts
from ``ReplicaState.prefill_tokens_per_s`` and is recalibrated online from each completed
request's TTFT minus the queue wait predicted when it was routed: one factor per pool, with
per-replica deviations shrunk toward it (``calibration.py``). Requests that had to load their
adapter calibrate the adapter's cold-load time instead.

**LoRA slots.** An engine runs at most ``--max-loras`` adapters at once: a request whose adapter
is not among its running requests' adapters waits, while all the slots are held, until one of
them drains (vLLM skips it in its waiting queue and schedules the others). How long depends on
the decodes still running and on how often the slot-holding adapters are asked for, so it is
learned: requests sent to a replica whose slots were all held calibrate ``adapter_slot_wait_ms``
(one estimate per scorer, in log space, from their TTFT minus the rest of their prediction),
and they calibrate nothing else. A slot frees when its adapter has no request left running
there, so the estimate is per request in flight: the slot-holding adapter with the fewest of
this scorer's requests on that replica frees first. Adapters already waiting there take the free
slots and the next ones to free, so a request behind them waits for a later release (a free slot
is no help when more adapters wait for it). Adapters this scorer sent to a replica since its
figures were read count as holding a slot there. Without the term, on the b2b-lora workload at
3x, 740 of 2,000 requests went to a replica whose slots were all held and waited a median 6.9 s,
predicted 134 ms (docs/policies/fleet-cost.md, *LoRA slots*).
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from pydantic import Field

from routing.contracts import RoutingRequest
from routing.engine import PluginTerms, Profile
from routing.policies.backlog import DrainingBacklog, RecentPrefill
from routing.policies.base import Plugin, PluginKind, PluginParams
from routing.policies.calibration import SpeedCalibration
from routing.policies.max_score import MaxScorePicker
from routing.policies.placements import Placements
from routing.state import ReplicaState
from routing.types import ReplicaId


@dataclass(frozen=True)
class TtftEstimate:
    """The cost terms of one replica's expected TTFT, in ms (tokens for ``uncached_tokens``)."""

    queue_wait_ms: float
    prefill_ms: float
    uncached_tokens: int
    adapter_cold_load_ms: float
    kv_penalty_ms: float
    stale_penalty_ms: float
    prefill_tokens_per_s: float
    #: Not part of the TTFT: the stall this prefill puts on the replica's running decodes.
    decode_interference_ms: float = 0.0
    #: Waiting for a GPU LoRA slot: every slot there is held by other adapters' requests.
    adapter_slot_wait_ms: float = 0.0

    @property
    def expected_ttft_ms(self) -> float:
        """The sum of the time terms."""
        return (
            self.queue_wait_ms
            + self.prefill_ms
            + self.adapter_cold_load_ms
            + self.adapter_slot_wait_ms
            + self.kv_penalty_ms
            + self.stale_penalty_ms
        )

    @property
    def cost_ms(self) -> float:
        """What the scorer minimises: the expected TTFT plus the decode interference."""
        return self.expected_ttft_ms + self.decode_interference_ms

    def as_terms(self) -> dict[str, float]:
        """The terms as a decision explanation shows them."""
        return {
            "queue_wait_ms": self.queue_wait_ms,
            "prefill_ms": self.prefill_ms,
            "uncached_tokens": float(self.uncached_tokens),
            "adapter_cold_load_ms": self.adapter_cold_load_ms,
            "adapter_slot_wait_ms": self.adapter_slot_wait_ms,
            "kv_penalty_ms": self.kv_penalty_ms,
            "stale_penalty_ms": self.stale_penalty_ms,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_interference_ms": self.decode_interference_ms,
            "expected_ttft_ms": self.expected_ttft_ms,
            "cost_ms": self.cost_ms,
        }


#: The cost terms, in the order ``_terms`` computes them (one tuple per replica per decision).
TERM_NAMES = (
    "queue_wait_ms",
    "prefill_ms",
    "uncached_tokens",
    "adapter_cold_load_ms",
    "adapter_slot_wait_ms",
    "kv_penalty_ms",
    "stale_penalty_ms",
    "prefill_tokens_per_s",
    "decode_interference_ms",
    "expected_ttft_ms",
    "cost_ms",
)
_COST = TERM_NAMES.index("cost_ms")


class LazyTerms(Mapping[ReplicaId, Mapping[str, float]]):
    """Replica -> its cost terms as a dict (keys ``names``), built from the computed tuple on
    first read.

    A decision computes every candidate's terms but usually reads back one replica's (the chosen
    one, for calibration) or none (explanations are rendered only when asked for): one tuple per
    replica instead of one dict measured about a third off the scorer at 64 replicas.
    """

    __slots__ = ("_built", "_names", "_raw")

    def __init__(
        self, raw: dict[ReplicaId, tuple[float, ...]], names: tuple[str, ...] = TERM_NAMES
    ) -> None:
        self._raw = raw
        self._names = names
        self._built: dict[ReplicaId, dict[str, float]] = {}

    def __getitem__(self, replica: ReplicaId) -> dict[str, float]:
        built = self._built.get(replica)
        if built is None:
            built = self._built[replica] = dict(zip(self._names, self._raw[replica], strict=True))
        return built

    def __contains__(self, replica: object) -> bool:
        return replica in self._raw

    def __iter__(self) -> Iterator[ReplicaId]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


class _Pending(NamedTuple):
    """What routing predicted for one request, kept until it completes (for calibration)."""

    #: Per replica, the cost terms of the decision (the explanation's terms).
    terms: Mapping[ReplicaId, Mapping[str, float]]
    #: Replicas whose cold-load term is this plugin's own estimate (so it may be calibrated).
    cold_load_is_ours: set[ReplicaId]
    #: Once it started: its LoRA-slot wait term over the slot-wait estimate of that moment
    #: (the adapters waiting there ahead of it), so that what it waited calibrates the estimate.
    slot_wait_multiple: float = 0.0


class ExpectedTtftScorer(Plugin):
    """Scores replicas by estimated time to first token; learns prefill speed from outcomes."""

    type_name: ClassVar[str] = "expected-ttft"
    kind: ClassVar[PluginKind] = "scorer"
    needs_prefix: ClassVar[bool] = True
    #: Costs each replica on its own figures: pruning cannot change a replica's cost.
    prunable: ClassVar[bool] = True

    class Params(PluginParams):
        """Parameters of ``expected-ttft``."""

        #: Adapter load time when it is neither resident nor host-cached and no estimate is given.
        default_adapter_cold_load_ms: float = Field(default=500.0, ge=0.0)
        #: Adapter load time when it is cached in host memory (``--max-cpu-loras``).
        cpu_cached_adapter_load_ms: float = Field(default=50.0, ge=0.0)
        #: Wait for a GPU LoRA slot where all are held, until requests that waited calibrate it.
        default_adapter_slot_wait_ms: float = Field(default=1000.0, gt=0.0)
        #: Prompt tokens assumed per engine-waiting request the gateway did not send itself.
        waiting_request_tokens: int = Field(default=512, ge=0)
        #: Share of a decode step each running request adds before this prefill runs.
        decode_contention: float = Field(default=0.05, ge=0.0)
        #: KV usage (0..1) above which the preemption penalty applies.
        kv_threshold: float = Field(default=0.9, gt=0.0, lt=1.0)
        #: Penalty at a full KV cache; it grows quadratically from 0 at the threshold.
        kv_penalty_ms: float = Field(default=2000.0, ge=0.0)
        #: Load figures older than this are distrusted ... Above the gateway's poll cycle: its
        #: health poll reads the engines every ``health_check_interval_s`` (2 s) and then takes
        #: up to its timeout (2 s), so a reading routinely ages past 2 s before the next one. At
        #: 2 s every replica took a penalty before each poll, larger for a slow-answering one.
        stale_after_s: float = Field(default=5.0, ge=0.0)
        #: ... at this many ms of penalty per second of extra age ...
        stale_penalty_ms_per_s: float = Field(default=100.0, ge=0.0)
        #: ... up to this cap.
        max_stale_penalty_ms: float = Field(default=5000.0, ge=0.0)
        #: EWMA weight of one observation when calibrating speed (in log space) and adapter load.
        calibration_alpha: float = Field(default=0.2, gt=0.0, le=1.0)
        #: One observation counts as at most this factor from the replica's estimate (outliers).
        max_calibration_step: float = Field(default=4.0, ge=1.0)
        #: Requests with fewer uncached tokens than this do not calibrate speed (too noisy).
        min_calibration_tokens: int = Field(default=64, ge=1)
        #: ... nor do requests whose predicted queue wait was more than this share of that wait
        #: plus their prefill (their uncached tokens at the speed then assumed): what such a
        #: request waited is mostly queue, and the queue model's error would be learned as
        #: prefill speed. None: every request does.
        max_calibration_queue_share: float | None = Field(default=0.5, gt=0.0, le=1.0)
        #: Cost differences well below this many ms barely change the score (tie-friendly).
        cost_floor_ms: float = Field(default=10.0, gt=0.0)
        #: Predictions kept for requests awaiting completion (oldest dropped first).
        max_pending: int = Field(default=65536, ge=1)
        #: Drain this gateway's dispatched prefill work at the prefill speed as time passes.
        drain_backlog: bool = True
        #: ms of cost per ms of prefill sent to the replica recently (its prefill duty cycle,
        #: which its running decodes pay in TPOT) ...
        recent_prefill_weight: float = Field(default=0.05, ge=0.0)
        #: ... decayed with this time constant (about a decode's lifetime).
        recent_prefill_window_s: float = Field(default=2.0, gt=0.0)

    params: Params

    def __init__(
        self,
        params: PluginParams | None = None,
        *,
        name: str | None = None,
        clock: Callable[[], float] = time.time,
        elapsed_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(params, name=name)
        #: Wall clock, comparable with ``ReplicaState.metrics_read_at``; injectable for tests.
        self._clock = clock
        #: Clock for elapsed time (backlog drain); the simulator binds its virtual clock here.
        self._elapsed_clock = elapsed_clock
        p = self.params
        self._calibration = SpeedCalibration(p.calibration_alpha, p.max_calibration_step)
        self._backlog = DrainingBacklog()
        self._recent = RecentPrefill(p.recent_prefill_window_s)
        #: Per replica, its pool and configured speed as last seen (calibration is relative).
        self._pool_of: dict[ReplicaId, str] = {}
        self._configured: dict[ReplicaId, float] = {}
        self._cold_load_ms: dict[str, float] = {}
        #: Learned wait for a held LoRA slot (log ms); None before any request waited for one.
        self._slot_wait_log: float | None = None
        #: Per replica, adapter -> wall time this scorer sent it there to run at once (it holds
        #: a slot from then; the engine's figures show it once read after that).
        self._sent_adapters: dict[ReplicaId, dict[str, float]] = {}
        #: Per replica, the adapters of the requests this scorer has in flight there.
        self._adapters_in_flight: Placements[str] = Placements(p.max_pending)
        self._pending: OrderedDict[str, _Pending] = OrderedDict()

    # ------------------------------------------------------------------ estimating

    def bind_elapsed_clock(self, clock: Callable[[], float]) -> None:
        """Measure elapsed time (the backlog drain) with ``clock``: the simulator's virtual time."""
        self._elapsed_clock = clock

    def bind_wall_clock(self, clock: Callable[[], float]) -> None:
        """Read wall-clock time (what ``ReplicaState.metrics_read_at`` is compared with) from
        ``clock``: the simulator's virtual time on a fixed epoch, so that a replay's decisions
        never depend on how fast the machine runs it."""
        self._clock = clock

    def calibrated_speed(self, replica: ReplicaId) -> float | None:
        """The calibrated prefill speed of ``replica`` in tokens/s, or None before any feedback."""
        configured = self._configured.get(replica)
        if configured is None:
            return None
        factor = self._calibration.factor(replica)
        if factor is None:
            factor = self._calibration.pool_factor(self._pool_of[replica])
        return None if factor is None else configured * factor

    def _speed_of(self, replica: ReplicaState) -> float:
        """Configured speed × the learned factor (the replica's own, shrunk, else its pool's)."""
        rid = replica.replica_id
        configured = replica.prefill_tokens_per_s
        if not (configured > 0 and configured != math.inf):
            return 1.0  # a broken figure (0, NaN, inf) must not divide by zero or win everything
        self._configured[rid] = configured
        self._pool_of[rid] = replica.pool
        factor = self._calibration.factor(rid)
        if factor is None:
            factor = self._calibration.pool_factor(replica.pool)
        return configured if factor is None else configured * factor

    def adapter_cold_load_estimate_ms(self, adapter: str) -> float:
        """Cold-load time assumed for ``adapter`` when the request carries no estimate."""
        return self._cold_load_ms.get(adapter, self.params.default_adapter_cold_load_ms)

    @property
    def adapter_slot_wait_estimate_ms(self) -> float:
        """The wait assumed for a LoRA slot whose adapter has one request left in flight, where
        no other adapter waits for one."""
        if self._slot_wait_log is None:
            return self.params.default_adapter_slot_wait_ms
        return math.exp(self._slot_wait_log)

    def _slot_wait_ms(self, adapter: str, replica: ReplicaState) -> float:
        """How long ``adapter`` would wait for a GPU LoRA slot on ``replica`` (0: it gets one)."""
        limit = replica.max_loras
        if not limit:
            return 0.0  # slots unknown (or LoRA off): nothing to wait for that we can see
        holders = set(replica.running_adapters)
        if adapter in holders:
            return 0.0
        sent = self._sent_adapters.get(replica.replica_id)
        if sent:
            read_at = replica.metrics_read_at
            for name, at in list(sent.items()):
                if at <= read_at:
                    del sent[name]  # the engine's figures already show it (or it has ended)
                elif name == adapter:
                    return 0.0
                else:
                    holders.add(name)
        # Adapters already waiting there take the free slots, then the next ones to free.
        ahead = len(replica.waiting_adapters - holders - {adapter})
        releases = ahead - (limit - len(holders))
        if releases < 0:
            return 0.0
        # A slot frees when its adapter has no request left running there, so the holder with
        # the fewest of this scorer's requests in flight frees first (one it cannot see counts
        # as one). Past one release per slot, each further round takes about as long again.
        # With no holder in sight (figures between steps), the adapters waiting take the slots
        # at once and hold them for one request each.
        in_flight = Counter(self._adapters_in_flight.on(replica.replica_id))
        drains = sorted(max(1, in_flight[name]) for name in holders) or [1]
        last = len(drains) - 1
        units = drains[min(releases, last)] * (1.0 + max(0, releases - last) / limit)
        return self.adapter_slot_wait_estimate_ms * units

    def estimate(
        self, request: RoutingRequest, replica: ReplicaState, now: float | None = None
    ) -> TtftEstimate:
        """The expected-TTFT terms of sending ``request`` to ``replica``."""
        values, _ = self._terms(
            request, replica, self._clock() if now is None else now, self._elapsed_clock()
        )
        terms = dict(zip(TERM_NAMES, values, strict=True))
        return TtftEstimate(
            queue_wait_ms=terms["queue_wait_ms"],
            prefill_ms=terms["prefill_ms"],
            uncached_tokens=int(terms["uncached_tokens"]),
            adapter_cold_load_ms=terms["adapter_cold_load_ms"],
            kv_penalty_ms=terms["kv_penalty_ms"],
            stale_penalty_ms=terms["stale_penalty_ms"],
            prefill_tokens_per_s=terms["prefill_tokens_per_s"],
            decode_interference_ms=terms["decode_interference_ms"],
            adapter_slot_wait_ms=terms["adapter_slot_wait_ms"],
        )

    def _terms(
        self, request: RoutingRequest, replica: ReplicaState, now: float, elapsed_now: float
    ) -> tuple[tuple[float, ...], bool]:
        """The cost terms (in ``TERM_NAMES`` order), and whether the cold-load term is ours.

        A plain tuple: this runs once per replica per decision; ``LazyTerms`` turns the ones
        read back (explanation, calibration record) into dicts.
        """
        p = self.params
        rid = replica.replica_id
        speed = self._speed_of(replica)
        matches = request.prefix_matches
        prompt = request.prompt_tokens if request.prompt_tokens > 0 else 0
        cached = matches.get(rid, 0) * request.block_size if matches else 0
        uncached = prompt - cached if cached < prompt else 0

        # The gateway's in-flight prefill tokens and the engine's waiting queue describe the same
        # backlog from two sides (the engine's also sees other clients): take the larger.
        backlog: float = replica.inflight_prefill_tokens
        if p.drain_backlog:
            # What this gateway sent there, drained at the prefill speed since: a replica nearly
            # through its prefill is nearly free. The counter bounds it (first tokens arrived).
            backlog = self._backlog.remaining(rid, elapsed_now, speed, backlog)
        # In floats: an absurd count makes an infinite cost, where exact integers overflowed
        # on the division below and the scorer failed for the whole fleet.
        waiting_tokens = float(replica.waiting) * p.waiting_request_tokens
        if waiting_tokens > backlog:
            backlog = waiting_tokens
        # Running decodes share each engine step with the prefill (chunked prefill).
        running = replica.running_now
        queue_ms = backlog / speed * 1000.0 + (
            running * replica.decode_step_ms * p.decode_contention
        )
        prefill_ms = uncached / speed * 1000.0
        # Chunked prefill shares engine steps with the running decodes, so a replica that has
        # prefilled a lot lately has stalled its decodes a lot: spread prefill work over time
        # (round-robin's strength), not only over the backlog of this instant.
        interference_ms = 0.0
        if p.recent_prefill_weight > 0 and running > 0:
            interference_ms = p.recent_prefill_weight * self._recent.load_ms(rid, elapsed_now)

        cold_ms, cold_is_ours, slot_ms = 0.0, False, 0.0
        adapter = request.adapter
        if adapter:
            slot_ms = self._slot_wait_ms(adapter, replica)
            given = request.adapter_cold_load_ms.get(rid)
            if given is not None:
                cold_ms = given if given > 0 else 0.0
            elif adapter in replica.loaded_adapters:
                cold_ms = 0.0
            elif adapter in replica.cpu_cached_adapters:
                cold_ms = p.cpu_cached_adapter_load_ms
            else:
                cold_ms, cold_is_ours = self.adapter_cold_load_estimate_ms(adapter), True

        kv_penalty = 0.0
        kv_usage = replica.kv_usage_now
        if kv_usage > p.kv_threshold:
            excess = (min(1.0, kv_usage) - p.kv_threshold) / (1.0 - p.kv_threshold)
            kv_penalty = p.kv_penalty_ms * excess * excess

        # Old figures may hide a queue that built up since: assume worse, not better.
        stale_s = now - replica.metrics_read_at - p.stale_after_s
        stale_penalty = 0.0
        if stale_s > 0:
            stale_penalty = min(p.max_stale_penalty_ms, stale_s * p.stale_penalty_ms_per_s)
        expected_ms = queue_ms + prefill_ms + cold_ms + slot_ms + kv_penalty + stale_penalty
        return (
            queue_ms,
            prefill_ms,
            float(uncached),
            cold_ms,
            slot_ms,
            kv_penalty,
            stale_penalty,
            speed,
            interference_ms,
            expected_ms,
            expected_ms + interference_ms,
        ), cold_is_ours

    # ------------------------------------------------------------------ scoring

    def score(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> dict[ReplicaId, float]:
        """(best cost + floor) / (cost + floor) per replica: 1.0 for the lowest expected TTFT."""
        return self.score_with_terms(request, replicas)[0]

    def score_with_terms(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> tuple[dict[ReplicaId, float], PluginTerms]:
        """``score`` plus every replica's cost terms; remembers them for calibration."""
        now = self._clock()
        elapsed_now = self._elapsed_clock()
        raw: dict[ReplicaId, tuple[float, ...]] = {}
        cold_ours: set[ReplicaId] = set()
        for replica in replicas:
            values, cold_is_ours = self._terms(request, replica, now, elapsed_now)
            raw[replica.replica_id] = values
            if cold_is_ours:
                cold_ours.add(replica.replica_id)
        terms = LazyTerms(raw)
        self._remember(request.request_id, _Pending(terms, cold_ours))
        if not raw:
            return {}, terms
        floor = self.params.cost_floor_ms
        return relative_scores({rid: values[_COST] + floor for rid, values in raw.items()}), terms

    def _remember(self, request_id: str, pending: _Pending) -> None:
        self._pending[request_id] = pending
        self._pending.move_to_end(request_id)
        while len(self._pending) > self.params.max_pending:
            self._pending.popitem(last=False)

    # ------------------------------------------------------------------ calibration

    def on_request_start(self, request: RoutingRequest, replica: ReplicaId) -> None:
        """Count the request's prefill on ``replica``; keep only the prediction made for it.

        Also called for a retry on a fallback replica, whose prediction may already be gone:
        the prefill work is then recomputed from the request's own prefix matches.
        """
        if request.adapter:
            before = self._adapters_in_flight.where(request.request_id)
            self._adapters_in_flight.place(request.request_id, replica, request.adapter)
            if before is not None and before != replica:  # a retry left that replica
                self._release_slot(before, request.adapter)
        pending = self._pending.get(request.request_id)
        chosen = pending.terms.get(replica) if pending is not None else None
        if pending is not None and chosen is not None:
            self._pending[request.request_id] = _Pending(
                {replica: chosen},
                pending.cold_load_is_ours & {replica},
                chosen["adapter_slot_wait_ms"] / self.adapter_slot_wait_estimate_ms,
            )
        if chosen is not None:
            uncached, prefill_ms = chosen["uncached_tokens"], chosen["prefill_ms"]
            if request.adapter and chosen["adapter_slot_wait_ms"] == 0.0:
                # It runs at once, so it holds a slot there until the engine's figures show it.
                self._sent_adapters.setdefault(replica, {})[request.adapter] = self._clock()
        else:
            matches = request.prefix_matches
            cached = matches.get(replica, 0) * request.block_size if matches else 0
            uncached = float(max(0, request.prompt_tokens - cached))
            speed = self.calibrated_speed(replica) or self._configured.get(replica)
            prefill_ms = uncached / speed * 1000.0 if speed else 0.0
        now = self._elapsed_clock()
        self._backlog.add(replica, uncached, now)
        self._recent.add(replica, prefill_ms, now)

    def _release_slot(self, replica: ReplicaId, adapter: str) -> None:
        """``adapter``'s requests there have ended (or moved away): its slot is free once none
        of them is left. Kept until the engine's next figures, it charged a slot wait on an
        idle replica (up to a health interval live; the simulator reads fresh figures and never
        showed it)."""
        sent = self._sent_adapters.get(replica)
        if sent and adapter in sent and adapter not in self._adapters_in_flight.on(replica):
            del sent[adapter]

    def on_request_complete(
        self,
        request: RoutingRequest,
        replica: ReplicaId,
        ttft_ms: float | None,
        cached_tokens: int | None,
        ok: bool,
    ) -> None:
        """Move the replica's prefill speed (or the adapter's load time) toward the observation."""
        self._adapters_in_flight.forget(request.request_id)
        if request.adapter:
            self._release_slot(replica, request.adapter)
        pending = self._pending.pop(request.request_id, None)
        if not ok or ttft_ms is None or not math.isfinite(ttft_ms) or pending is None:
            return
        predicted = pending.terms.get(replica)
        if predicted is None:
            return
        p = self.params
        # The engine's own cached_tokens is the truth; the index's prediction is the fallback.
        if cached_tokens is not None:
            uncached = max(0.0, float(request.prompt_tokens - cached_tokens))
        else:
            uncached = predicted["uncached_tokens"]
        # Its uncached tokens at the speed assumed when it was routed.
        speed = predicted["prefill_tokens_per_s"]
        prefill_then_ms = uncached / speed * 1000.0
        queue_ms = predicted["queue_wait_ms"]
        residual_ms = ttft_ms - queue_ms
        if predicted["adapter_slot_wait_ms"] > 0.0:
            # It waited for a LoRA slot: what the rest of the prediction does not explain is
            # that wait (and it says nothing reliable about prefill speed).
            multiple = pending.slot_wait_multiple
            if multiple > 0.0:
                rest_ms = prefill_then_ms + predicted["adapter_cold_load_ms"]
                self._observe_slot_wait(max(1.0, residual_ms - rest_ms) / multiple)
            return

        if replica in pending.cold_load_is_ours and request.adapter:
            # The adapter had to be loaded: attribute what prefill does not explain to the load.
            # In log space, at most ``max_calibration_step``-fold per observation: one TTFT
            # blown up by something else (a stall, a restart) cannot make the adapter look
            # minutes long to load, and then, avoided on every cold replica, never be corrected.
            observed = max(1.0, residual_ms - prefill_then_ms)
            old = max(1.0, self.adapter_cold_load_estimate_ms(request.adapter))
            bound = math.log(p.max_calibration_step)
            step = min(bound, max(-bound, math.log(observed) - math.log(old)))
            self._cold_load_ms[request.adapter] = old * math.exp(p.calibration_alpha * step)
            return
        if uncached < p.min_calibration_tokens or replica not in self._configured:
            return
        share = p.max_calibration_queue_share
        if share is not None and queue_ms > share * (queue_ms + prefill_then_ms):
            return  # mostly queue: the residual says more about the queue model than speed
        prefill_ms = residual_ms - predicted["adapter_cold_load_ms"]
        # Speed relative to the configured figure; SpeedCalibration bounds each step and shares
        # what it learns across the pool (identical replicas must not drift apart on noise).
        implied = uncached / (prefill_ms / 1000.0) if prefill_ms > 0 else math.inf
        ratio = min(implied, speed * p.max_calibration_step) / self._configured[replica]
        self._calibration.observe(replica, self._pool_of[replica], ratio)

    def _observe_slot_wait(self, observed_ms: float) -> None:
        """A request waited ``observed_ms`` for a slot (per unit of the estimate: no adapters
        ahead of it): move the estimate toward it in log space, at most
        ``max_calibration_step``-fold per observation."""
        p = self.params
        current = math.log(self.adapter_slot_wait_estimate_ms)
        bound = math.log(p.max_calibration_step)
        step = min(bound, max(-bound, math.log(observed_ms) - current))
        self._slot_wait_log = current + p.calibration_alpha * step


def relative_scores(costs: dict[ReplicaId, float]) -> dict[ReplicaId, float]:
    """``best / cost`` per replica (1 for the cheapest). A cost that is not a number (a broken
    figure somewhere upstream) scores 0 rather than making every score NaN; with no finite cost
    at all, the infinite ones tie at 1."""
    finite = [cost for cost in costs.values() if math.isfinite(cost)]
    if not finite:
        return {rid: 1.0 if cost == math.inf else 0.0 for rid, cost in costs.items()}
    best = min(finite)
    return {rid: best / cost if cost == cost else 0.0 for rid, cost in costs.items()}


#: Near-equal costs within 1% count as ties. ``max-score``'s default 5% is ~10 ms on a 200 ms
#: prefill: enough to send a request to a replica still finishing another prefill.
TIE_TOLERANCE = 0.01


def profile() -> Profile:
    """The built-in ``expected-ttft`` profile: this scorer alone, picked by ``max-score``."""
    return Profile(
        name="expected-ttft",
        filters=(),
        scorers=((ExpectedTtftScorer(), 1.0),),
        picker=MaxScorePicker(MaxScorePicker.Params(tie_tolerance=TIE_TOLERANCE)),
    )
