"""The discrete-event loop: one policy, one trace, N engine models, in virtual time.

Two kinds of events, taken in time order from a heap (step ends before arrivals at equal times,
so a decision sees the freshest state):

* **arrival** — route the request through the real ``RoutingEngine`` exactly as the gateway does
  (in-flight counts, one index lookup, the profile's scorers and picker), then insert its chain
  into the index speculatively, count it in flight, and submit it to the chosen engine — at
  once, or, with a calibrated profile, through the replica's request path
  (``replica/sim/request_path.py``);
* **admitted** (request path only) — the API server has handed the request to the engine;
* **pump** (flow control only) — judge the head of the gateway queue again on a fresh routing
  estimate; queued after the step ends of the same instant, and every ``PUMP_INTERVAL_S`` while
  requests wait, so an idle fleet still drains the queue;
* **step end** — deliver the step's first tokens (through the request path, if any), finished
  requests and KV events: TTFT and completion go to the policy's learning hooks,
  ``BlockStored``/``BlockRemoved`` go to the block index (the feed a live replica agent
  provides), and the engine starts its next step.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from planning.simulator.config import SimulationConfig, TraceRequest
from planning.simulator.flow import assign_classes
from planning.simulator.prompts import PreparedPrompt, PromptFactory
from planning.simulator.replica import SimulatedReplica
from replica.sim.engine import EngineConfig, SimRequest, StepResult
from replica.sim.request_path import RequestPath
from routing.contracts import RoutingDecision, RoutingRequest
from routing.engine import Profile, RoutingEngine
from routing.flow_control import (
    Decision,
    FleetEstimate,
    FlowController,
    FlowRequest,
    RequestClass,
    Verdict,
    estimate_from_decision,
    steer_request,
)
from routing.index.memory import MemoryBlockIndex
from routing.policies.registry import builtin_profile
from routing.types import BlockHash, ReplicaId

__all__ = ["PolicyRun", "RequestOutcome", "ShedOutcome", "run_policy"]

log = logging.getLogger(__name__)

#: Virtual seconds between judgements of the gateway queue's head while requests wait (besides
#: every step end): a fleet with nothing running still drains the queue.
PUMP_INTERVAL_S = 0.01
#: Where the policies' wall clock starts (s): fixed, so that no replay depends on when it ran.
WALL_EPOCH_S = 1_000.0

#: The tenant every simulated request belongs to (one tenant: fairness is the gateway's tests').
SIM_TENANT = "simulate"


@dataclass(slots=True)
class RequestOutcome:
    """What happened to one request (times in virtual seconds)."""

    replica: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    #: Uncached prompt tokens the router predicted (for the in-flight prefill count).
    predicted_uncached: int
    #: When the engine received it (after the request path, if the profile has one).
    admitted_s: float = math.nan
    scheduled_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    cached_tokens: int = 0
    request_class: RequestClass = RequestClass.STANDARD
    #: Seconds spent in the gateway queue before dispatch (flow control).
    gateway_wait_s: float = 0.0

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first (NaN under two tokens or unfinished)."""
        if self.output_tokens < 2:
            return math.nan
        return (self.finish_s - self.first_token_s) * 1000.0 / (self.output_tokens - 1)

    @property
    def dispatched_s(self) -> float:
        """When the gateway sent it to the engine."""
        return self.arrival_s + self.gateway_wait_s


@dataclass(frozen=True, slots=True)
class ShedOutcome:
    """A request flow control refused (a 429 at a live gateway): a miss for goodput."""

    request_class: RequestClass
    reason: str
    arrival_s: float
    waited_s: float


@dataclass
class PolicyRun:
    """The raw result of replaying a trace through one policy."""

    policy: str
    outcomes: list[RequestOutcome]
    #: Requests the engines refused (e.g. longer than the model's context).
    rejected: int
    routed_per_replica: list[int]
    preemptions: int
    price_per_hour: float
    replicas: int
    degraded_decisions: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    #: Whether the run had flow control at the gateway.
    flow_control: bool = False
    #: ... and the policy gave it no TTFT estimate to judge by, so it admitted everything.
    flow_control_blind: bool = False
    #: Requests flow control refused.
    shed: list[ShedOutcome] = field(default_factory=list)
    #: Requests that waited in the gateway queue (served or refused later).
    queued: int = 0
    #: Requests flow control moved off a replica whose decodes were too slow (critical ones,
    #: and others it would have held on a calm fleet).
    steered: int = 0
    #: Requests routed as overflow: predicted to miss the TTFT SLO on every replica.
    overflow: int = 0
    #: Why the first refused request was refused (the engine's message), for the summary.
    rejection_example: str | None = None


class _Simulation:
    """State of one policy run; ``run`` drives it to completion."""

    def __init__(
        self,
        policy: str,
        requests: Sequence[TraceRequest],
        config: SimulationConfig,
        engine_config: EngineConfig | Sequence[EngineConfig],
        prompts: PromptFactory,
        on_done: Callable[[int], None] | None,
        profile_factory: Callable[[], Profile] | None = None,
    ) -> None:
        self.policy = policy
        self.requests = requests
        self.config = config
        self.prompts = prompts
        self.on_done = on_done
        self.now = 0.0
        self._last_wall = -math.inf
        self.index = MemoryBlockIndex(config.index_max_entries, clock=self._clock)
        profile = profile_factory() if profile_factory is not None else builtin_profile(policy)
        if profile.name != policy:
            raise ValueError(
                f"profile factory for {policy!r} built a profile named {profile.name!r}"
            )
        # Plugins that measure elapsed time (expected-ttft's backlog drain) must measure it in
        # the replay's virtual time, as a live gateway's monotonic clock moves with its traffic;
        # the wall clock of a replay runs at an unrelated pace. So must those that compare wall
        # times with when engine figures were read (``metrics_read_at``): on a fixed epoch.
        for plugin in profile.plugins:
            bind = getattr(plugin, "bind_elapsed_clock", None)
            if callable(bind):
                bind(self._clock)
            bind_wall = getattr(plugin, "bind_wall_clock", None)
            if callable(bind_wall):
                bind_wall(self.wall)
        self.router = RoutingEngine(self.index, {policy: profile})
        # Policies that never read prefix matches need no index feed: skip its cost.
        self.feed_index = profile.needs_prefix
        configs = (
            [engine_config] * config.replicas
            if isinstance(engine_config, EngineConfig)
            else list(engine_config)
        )
        profiles = config.replica_profiles()
        #: A mixed fleet (``--profile a:N,b:M``): each profile's replicas are a pool, as an
        #: operator would declare them, and engines differ in what they refuse.
        self.mixed = len(set(profiles)) > 1
        pools = profiles if self.mixed else ["default"] * len(profiles)
        self.replicas = [
            SimulatedReplica(
                i, configs[i], config.model, config.seed + i, config.stats_interval_s,
                pool=pools[i],
            )
            for i in range(config.replicas)
        ]
        self.by_id = {r.replica_id: r for r in self.replicas}
        #: Per replica, its request path (a calibrated profile's API server), or None.
        self.paths = [RequestPath.of(c.step_time) for c in configs]
        #: Per replica, requests on their way through its path, in the order they come out.
        self.admitting: list[deque[SimRequest]] = [deque() for _ in self.replicas]
        # Every replica can serve every adapter (a shared catalog); none starts loaded, so the
        # first request for an adapter on a replica pays its load, as on a fresh vLLM.
        for name in sorted({r.adapter for r in requests if r.adapter is not None}):
            for replica in self.replicas:
                replica.engine.register_adapter(name)
        self.outcomes: dict[str, RequestOutcome] = {}
        self.routing_requests: dict[str, RoutingRequest] = {}
        #: Per replica, requests not yet seen in a step (for queue time).
        self.unscheduled: list[set[str]] = [set() for _ in self.replicas]
        self.heap: list[tuple[float, int, int]] = []
        self.rejected = 0
        self.rejection_example: str | None = None
        #: Flow control saw a TTFT estimate (a policy that gives none leaves it admitting all).
        self.flow_judged = False
        self.degraded = 0
        self.overflow = 0
        self._seed_rng = random.Random(f"{config.seed}:routing")
        self.classes = (
            assign_classes([r.record for r in requests], config.classes, config.seed)
            if config.classes is not None
            else None
        )
        self.flow = (
            FlowController(config.flow_control, self._clock)
            if config.flow_control is not None and config.flow_control.enabled
            else None
        )
        #: Requests waiting in the gateway queue, by request id.
        self.waiting: dict[str, _Waiting] = {}
        self.shed: list[ShedOutcome] = []
        self.queued = 0
        #: Requests flow control moved off a replica whose decodes were too slow (critical ones,
        #: and others it would have held on a calm fleet).
        self.steered = 0
        self.pump_due: float | None = None

    def wall(self) -> float:
        """The policies' wall clock: the virtual time on a fixed epoch, moved on by the least
        step a float allows at each reading within one virtual instant. Like a real clock, it
        reads later at each call (a figure read after a request was sent is read after it),
        and no figure of a replay depends on how fast the machine runs it."""
        reading = WALL_EPOCH_S + self.now
        if reading <= self._last_wall:
            reading = math.nextafter(self._last_wall, math.inf)
        self._last_wall = reading
        return reading

    def _clock(self) -> float:
        return self.now

    async def run(self) -> PolicyRun:
        for replica in self.replicas:
            await self.index.set_epoch(replica.replica_id, replica.epoch)
        arrivals = iter(self.requests)
        upcoming = next(arrivals, None)
        while upcoming is not None or self.heap:
            if self.heap and (upcoming is None or self.heap[0][0] <= upcoming.arrival_s):
                end, replica_index, index = heapq.heappop(self.heap)
                self._advance(end)
                if index == _PUMP:
                    self.pump_due = None
                    await self._pump()
                    continue
                if index == _ADMITTED:
                    self._admitted(self.replicas[replica_index])
                    continue
                await self._step_ended(self.replicas[index])
                if self.waiting:
                    await self._pump()
            else:
                assert upcoming is not None
                self._advance(upcoming.arrival_s)
                if self.waiting:
                    await self._pump()
                await self._arrive(upcoming)
                upcoming = next(arrivals, None)
        finished = [o for o in self.outcomes.values() if not math.isnan(o.finish_s)]
        return PolicyRun(
            policy=self.policy,
            outcomes=finished,
            rejected=self.rejected,
            rejection_example=self.rejection_example,
            routed_per_replica=[r.routed for r in self.replicas],
            preemptions=sum(r.engine.stats().preemptions for r in self.replicas),
            # The mean: ``replicas x price`` is then the fleet's bill, mixed or not.
            price_per_hour=sum(r.engine.config.replica_price_per_hour for r in self.replicas)
            / len(self.replicas),
            replicas=len(self.replicas),
            degraded_decisions=self.degraded,
            overflow=self.overflow,
            flow_control=self.flow is not None,
            flow_control_blind=self.flow is not None and not self.flow_judged,
            shed=self.shed,
            queued=self.queued,
            steered=self.steered,
        )

    def _advance(self, now: float) -> None:
        self.now = now

    def _schedule(self, replica: SimulatedReplica) -> None:
        end = replica.start_step(self.now)
        heapq.heappush(self.heap, (end, replica.index, replica.index))

    # ------------------------------------------------------------------ arrivals

    async def _arrive(self, request: TraceRequest) -> None:
        record = request.record
        request_id = f"req-{request.index}"
        # Every engine of a fleet is alike: one that refuses the request's length, all do. In a
        # mixed one, a request is refused on arrival only if every engine would refuse it.
        engines = [r.engine for r in self.replicas] if self.mixed else [self.replicas[0].engine]
        refusal = None
        for engine in engines:
            refusal = engine.length_problem(request_id, record.input_length, record.output_length)
            if refusal is None:
                break
        if refusal is None:
            prompt = self.prompts.prepare(record.hash_ids, record.input_length, record.adapter)
        else:
            prompt = self.prompts.chain_only(record.hash_ids, record.input_length, record.adapter)
        routing_request = RoutingRequest(
            request_id=request_id,
            model=self.config.model,
            adapter=record.adapter,
            tenant=SIM_TENANT,
            route="simulate",
            prompt_tokens=record.input_length,
            chain=prompt.chain,
            block_size=self.config.trace_block_size,
            max_output_tokens=record.output_length,
            # The objectives goodput is measured against, declared as a route's ``slo`` would be.
            ttft_slo_ms=self.config.slo_ttft_ms,
            tpot_slo_ms=self.config.slo_tpot_ms,
            seed=self._seed_rng.getrandbits(63),
        )
        waiting = _Waiting(request, routing_request, prompt, self._class_of(request), refusal)
        decision = await self._route(waiting)
        if self.flow is None:
            await self._dispatch(waiting, decision, 0.0)
            return
        flow_request = FlowRequest(
            request_id,
            SIM_TENANT,
            waiting.request_class,
            self.config.slo_ttft_ms,
            1.0,
            request.arrival_s,
            self.config.slo_tpot_ms,
            record.output_length,
            # Every engine refuses it (``refusal``): let through to that refusal, as the
            # gateway does, so that it counts as refused in every row, not shed in some.
            fits_no_replica=refusal is not None,
        )
        decision, estimate, steered = await self._steer(waiting, flow_request, decision)
        self.flow_judged = self.flow_judged or estimate.predicted_ttft_ms is not None
        verdict = self.flow.admit(flow_request, estimate)
        if verdict.decision is Decision.ADMIT:
            self.steered += steered
            await self._dispatch(waiting, decision, 0.0)
        elif verdict.decision is Decision.QUEUE:
            self.waiting[request_id] = waiting
            self.queued += 1
            self._arm_pump()
        else:
            self._record_shed(waiting, verdict)

    async def _steer(
        self,
        waiting: _Waiting,
        flow_request: FlowRequest,
        decision: RoutingDecision,
        queued: bool = False,
    ) -> tuple[RoutingDecision, FleetEstimate, bool]:
        """A request routed to a replica decoding too slowly for it, critical or (on a calm
        fleet) about to be held, or a queue head held for its replica's backlog (``queued``):
        routed again among the replicas with room (idle ones, for a head), kept there if the
        controller takes the new decision (``routing.flow_control.steer_request``, as in the
        gateway); whether it moved, counted in ``steered`` once it is admitted there."""
        assert self.flow is not None
        steering = await steer_request(
            self.flow,
            flow_request,
            decision,
            waiting.routing_request,
            self._estimate,
            lambda room: self._route(waiting, room),
            queued=queued,
        )
        return steering.routed, steering.estimate, steering.steered

    def _estimate(self, decision: RoutingDecision) -> FleetEstimate:
        """Flow control's view of ``decision``: its estimate, and each engine's queue as polled."""
        return estimate_from_decision(decision, (r.state for r in self.replicas))

    def _class_of(self, request: TraceRequest) -> RequestClass:
        return self.classes[request.index] if self.classes is not None else RequestClass.STANDARD

    async def _route(
        self, waiting: _Waiting, only: frozenset[ReplicaId] | None = None
    ) -> RoutingDecision:
        """One routing decision on the fleet as it is now (arrival, or a queue head judged),
        among ``only`` those replicas if given."""
        adapter = waiting.request.record.adapter
        views = [
            r.routing_view(self.now, self.wall())
            for r in self.replicas
            if only is None or r.replica_id in only
        ]
        if adapter is not None:
            # What the gateway's adapter registry supplies live: each replica's cold-load cost.
            waiting.routing_request.adapter_cold_load_ms = {
                r.replica_id: 1000.0 * r.engine.adapter_cold_load_s(adapter) for r in self.replicas
            }
        return await self.router.route(waiting.routing_request, views, self.policy)

    async def _pump(self) -> None:
        """Refuse what waited too long, then admit queue heads while the fleet has room."""
        flow = self.flow
        assert flow is not None
        for flow_request, verdict in flow.expire():
            self._record_shed(self.waiting.pop(flow_request.request_id), verdict)
        while (head := flow.head()) is not None:
            waiting = self.waiting[head.request_id]
            decision, estimate, steered = await self._steer(
                waiting, head, await self._route(waiting), queued=True
            )
            verdict = flow.judge_head(estimate)
            if verdict.decision is Decision.QUEUE:
                break
            del self.waiting[head.request_id]
            if verdict.decision is Decision.ADMIT:
                self.steered += steered
                await self._dispatch(waiting, decision, verdict.waited_s)
            else:
                self._record_shed(waiting, verdict)
        self._arm_pump()

    def _arm_pump(self) -> None:
        if not self.waiting or self.pump_due is not None:
            return
        assert self.flow is not None
        due = self.now + PUMP_INTERVAL_S
        deadline = self.flow.next_deadline_s()
        if deadline is not None:
            due = min(due, max(self.now, deadline))
        self.pump_due = due
        heapq.heappush(self.heap, (due, len(self.replicas), _PUMP))

    def _record_shed(self, waiting: _Waiting, verdict: Verdict) -> None:
        self.shed.append(
            ShedOutcome(
                waiting.request_class,
                verdict.reason,
                waiting.request.arrival_s,
                verdict.waited_s,
            )
        )

    def _refused(self, request_id: str, replica: SimulatedReplica, why: str) -> None:
        """vLLM would answer 400; the request never loads the fleet. Counted, not timed."""
        self.rejected += 1
        if self.rejection_example is None:
            self.rejection_example = why
        # One line per refusal, per policy replayed, is noise: the caller sums them up.
        log.debug("request %s refused by %s: %s", request_id, replica.replica_id, why)

    async def _dispatch(
        self, waiting: _Waiting, decision: RoutingDecision, gateway_wait_s: float
    ) -> None:
        """Send a routed request to its replica, as the gateway's forward phase does."""
        request, routing_request, prompt = waiting.request, waiting.routing_request, waiting.prompt
        record = request.record
        request_id = routing_request.request_id
        replica = self.by_id[decision.replica]
        refusal = waiting.refusal
        if refusal is None and self.mixed:  # routed to an engine too small for it after all
            refusal = replica.engine.length_problem(
                request_id, record.input_length, record.output_length
            )
        if refusal is not None:
            self._refused(request_id, replica, refusal)
            return
        sim_request = SimRequest(
            request_id,
            prompt.token_ids,
            record.output_length,
            adapter=record.adapter,
            arrival_s=self.now,
            # The gateway sends the class as vLLM's priority to engines scheduling by it.
            priority=waiting.request_class.engine_priority
            if replica.engine.config.scheduling_policy == "priority"
            else 0,
        )
        try:
            replica.engine.check(sim_request)
        except ValueError as exc:
            self._refused(request_id, replica, str(exc))
            return
        # Counted for requests an engine took: a refused one is in ``rejected`` alone.
        if decision.degraded:
            self.degraded += 1
        if routing_request.overflow:
            self.overflow += 1
        explanation = decision.explanations.get(decision.replica)
        matched = explanation.matched_blocks if explanation else 0
        uncached = max(0, record.input_length - matched * self.config.trace_block_size)
        replica.inflight_start(uncached)
        self.router.observe_start(routing_request, replica.replica_id)
        if self.feed_index and prompt.chain:
            await self.index.record(
                replica.replica_id,
                replica.epoch,
                list(prompt.chain),
                ttl_s=self.config.speculative_ttl_s,
            )
        self.outcomes[request_id] = RequestOutcome(
            replica.index,
            request.arrival_s,
            record.input_length,
            record.output_length,
            uncached,
            request_class=waiting.request_class,
            gateway_wait_s=gateway_wait_s,
        )
        self.routing_requests[request_id] = routing_request
        self.unscheduled[replica.index].add(request_id)
        path = self.paths[replica.index]
        if path is None:
            self._submit(replica, sim_request)
        else:
            self.admitting[replica.index].append(sim_request)
            heapq.heappush(self.heap, (path.admit(self.now), replica.index, _ADMITTED))

    def _admitted(self, replica: SimulatedReplica) -> None:
        """The request path handed its oldest request to the engine."""
        self._submit(replica, self.admitting[replica.index].popleft())

    def _submit(self, replica: SimulatedReplica, request: SimRequest) -> None:
        self.outcomes[request.request_id].admitted_s = self.now
        replica.submit(request, self.now)
        if not replica.busy:
            self._schedule(replica)

    # ------------------------------------------------------------------ step ends

    async def _step_ended(self, replica: SimulatedReplica) -> None:
        started, result = replica.take_step()
        waiting = self.unscheduled[replica.index]
        if waiting:
            for request_id in waiting.intersection(result.tokens):
                self.outcomes[request_id].scheduled_s = started
                waiting.discard(request_id)
        path = self.paths[replica.index]
        # When the client has this step's tokens: now, or once the request path delivered them.
        delivered = (
            self.now if path is None else path.deliver(self.now, sum(result.tokens.values()))
        )
        for request_id in result.first_token:
            outcome = self.outcomes[request_id]
            outcome.first_token_s = delivered
            outcome.cached_tokens = replica.engine.cached_tokens(request_id)
            replica.inflight_prefilled(outcome.predicted_uncached)
        for request_id in result.finished:
            self._finish(replica, request_id, delivered)
        if self.feed_index and result.kv_events:
            await self._ingest_events(replica, result)
        if replica.engine.has_work():
            self._schedule(replica)

    def _finish(self, replica: SimulatedReplica, request_id: str, delivered_s: float) -> None:
        outcome = self.outcomes[request_id]
        outcome.finish_s = delivered_s
        replica.inflight_finish()
        routing_request = self.routing_requests.pop(request_id)
        # The engine's TTFT, from dispatch: calibration must not learn the gateway queue's wait.
        ttft_ms = (outcome.first_token_s - outcome.dispatched_s) * 1000.0
        self.router.observe_complete(
            routing_request, replica.replica_id, ttft_ms, outcome.cached_tokens, True
        )
        if self.flow is not None:
            self.flow.request_finished(request_id)
            if outcome.output_tokens >= 2:
                self.flow.observe_finished(outcome.tpot_ms, self.config.slo_tpot_ms)
        if self.on_done is not None:
            self.on_done(1)

    async def _ingest_events(self, replica: SimulatedReplica, result: StepResult) -> None:
        """KV events -> block index, as the replica agent does (engine hash -> fleetgate hash)."""
        mapping = self.prompts.routing_hash_of
        for event in result.kv_events:
            if event.kind == "AllBlocksCleared":
                # As the agent does: a new epoch hides every entry of the old one at once.
                await self.index.set_epoch(replica.replica_id, replica.new_epoch())
                continue
            blocks: list[BlockHash] = [mapping[h] for h in event.block_hashes if h in mapping]
            if not blocks:
                continue
            if event.kind == "BlockStored":
                await self.index.record(replica.replica_id, replica.epoch, blocks)
            else:
                await self.index.remove(replica.replica_id, replica.epoch, blocks)


#: Heap entries that are not a replica's step end (which carry the replica's index).
_PUMP = -1
_ADMITTED = -2


@dataclass(slots=True)
class _Waiting:
    """A request between arrival and dispatch (routed, maybe queued at the gateway)."""

    request: TraceRequest
    routing_request: RoutingRequest
    prompt: PreparedPrompt
    request_class: RequestClass
    #: Why every engine refuses it (over the context window), known on arrival; None: taken.
    refusal: str | None = None


async def run_policy(
    policy: str,
    requests: Sequence[TraceRequest],
    config: SimulationConfig,
    engine_config: EngineConfig | Sequence[EngineConfig],
    prompts: PromptFactory,
    on_done: Callable[[int], None] | None = None,
    profile_factory: Callable[[], Profile] | None = None,
) -> PolicyRun:
    """Replay ``requests`` through ``policy`` on a fresh fleet; ``on_done`` counts completions.

    ``policy`` names a built-in profile, unless ``profile_factory`` builds the profile (an
    experimental variant; it must carry the name ``policy``).
    """
    simulation = _Simulation(
        policy, requests, config, engine_config, prompts, on_done, profile_factory
    )
    return await simulation.run()
